"""pilotrun: a pilot-first pretraining system.

Folders, in the order data flows (each imports only the ones before it): `data/` (sources become token shards,
read back with cursors), `model/` (tokens become a loss), `optim/` (the loss becomes an update), `run/` (the
run folder's format, torch-free), `training/` (the loop and its callbacks, checkpoints), `report/` (a run
becomes evidence: summarize, the rules, the verdict), `commands/` (the command line and the API).

The Python API (`pilotrun.prepare`, `train`, `summarize`, `verdict`, `load_model`, `export`; see
commands/api.py) is resolved on first use, so that `import pilotrun` (and `pilotrun --help`) does not import
torch.
"""

from pilotrun.version import __version__

API = ("prepare", "train", "summarize", "verdict", "load_model", "export")
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name in API:
        from pilotrun.commands import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pilotrun' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))
