"""pilotrun: a pilot-first pretraining system.

Folders, in the order data flows: `data/` (sources become token shards, read back with cursors),
`model/` (tokens become a loss), `optim/` (the loss becomes an update), `train/` (the loop, precision,
checkpoints and the run record), `report/` (a run becomes evidence: summarize and verdict).

The Python API (`pilotrun.prepare`, `train`, `summarize`, `verdict`, `load_model`, `export`; see api.py) is
resolved on first use, so that `import pilotrun` (and `pilotrun --help`) does not import torch.
"""

__version__ = "0.1.0"

API = ("prepare", "train", "summarize", "verdict", "load_model", "export")
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name == "train":  # the subpackage, which is callable (see pilotrun/train/__init__.py)
        import pilotrun.train

        return pilotrun.train
    if name in API:
        from pilotrun import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pilotrun' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))
