"""bench_update's optional third comparison: nanochat's GPT and its own optimizers, imported from a checkout
of nanochat that the user names by path (`--nanochat PATH`). Nothing of nanochat lives in this repository;
without the flag the benchmark never imports it.

The adapter builds nanochat's model as its training script does (its config, `init_weights`, then its
optimizer set-up) with the benchmark's d_model, layers, heads, vocabulary and sequence length, every layer
attending to the full causal context (window pattern "L", as the other two models do) and as many key/value
heads as query heads. nanochat's config has no MLP width: its MLP is relu^2 at 4x d_model. So that it does the
same matmul work per token as pilotrun, the adapter replaces each block's two MLP projections with ones of
nanochat's own Linear class at the width where its matmul parameters equal pilotrun's active ones, before
`init_weights`, so nanochat's own initialisation applies to them. On the CPU nanochat picks fp32 as its
compute dtype itself; nothing else of it is patched. A checkout whose API does not match is refused with one
line naming what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

REQUIRED_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")


class NanochatError(Exception):
    """A path that is not a usable nanochat checkout: reported as one line, exit code 2."""


@dataclasses.dataclass
class Nanochat:
    """nanochat's gpt module as imported from one checkout."""

    path: Path
    gpt: object
    commit: str | None

    @property
    def compute_dtype(self) -> str:
        common = sys.modules.get("nanochat.common")
        return str(getattr(common, "COMPUTE_DTYPE", "unknown")).replace("torch.", "")


def load(path: str | Path) -> Nanochat:
    """Import nanochat.gpt from the checkout at `path` (and nowhere else), checking the API the adapter
    uses."""
    root = Path(path).resolve()
    where = f"--nanochat {path}"
    if not (root / "nanochat" / "gpt.py").is_file():
        raise NanochatError(f"{where}: not a nanochat checkout (no nanochat/gpt.py in it)")
    for name in [n for n in sys.modules if n == "nanochat" or n.startswith("nanochat.")]:
        del sys.modules[name]  # an earlier import from another place must not answer for this checkout
    sys.path.insert(0, str(root))
    said = io.StringIO()  # its import-time messages: kept off stdout (--json), and off a refusal's one line
    try:
        with contextlib.redirect_stdout(said):
            gpt = importlib.import_module("nanochat.gpt")
    except Exception as error:  # any failure of a foreign checkout's import is the user's input, not our bug
        first = (str(error).splitlines() or [""])[0]
        raise NanochatError(
            f"{where}: importing nanochat.gpt failed: {type(error).__name__}: {first}"
        ) from None
    finally:
        sys.path.remove(str(root))
    if root not in Path(gpt.__file__).resolve().parents:
        raise NanochatError(f"{where}: nanochat.gpt was imported from {gpt.__file__}, not from this checkout")
    for name in ("GPT", "GPTConfig"):
        if not hasattr(gpt, name):
            raise NanochatError(f"{where}: nanochat/gpt.py has no {name}")
    if not dataclasses.is_dataclass(gpt.GPTConfig):
        raise NanochatError(f"{where}: nanochat.gpt.GPTConfig is not a dataclass")
    fields = {field.name for field in dataclasses.fields(gpt.GPTConfig)}
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if missing:
        raise NanochatError(f"{where}: nanochat.gpt.GPTConfig has no field {', '.join(missing)}")
    if not any(hasattr(gpt.GPT, name) for name in ("setup_optimizer", "setup_optimizers")):
        raise NanochatError(f"{where}: nanochat.gpt.GPT has no setup_optimizer or setup_optimizers")
    sys.stderr.write(said.getvalue())
    return Nanochat(root, gpt, checkout_commit(root))


def checkout_commit(root: Path) -> str | None:
    """The checkout's commit where it is a git work tree (for the record), else None."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def matmul_parameters(model: nn.Module) -> int:
    """The parameters a token multiplies by: nanochat's own count where it has one, else every Linear
    weight."""
    if hasattr(model, "num_matmul_params"):
        return int(model.num_matmul_params())
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def mlps(model: nn.Module, where: str) -> list[nn.Module]:
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if blocks is None:
        raise NanochatError(f"{where}: nanochat's GPT has no transformer.h (its blocks)")
    found = [getattr(block, "mlp", None) for block in blocks]
    if not found or any(m is None or not all(hasattr(m, name) for name in ("c_fc", "c_proj")) for m in found):
        raise NanochatError(f"{where}: nanochat's blocks have no mlp.c_fc and mlp.c_proj")
    return found


def build(nanochat: Nanochat, *, d_model: int, n_layers: int, n_heads: int, vocab: int, seq: int,
          target_matmul: int) -> tuple[nn.Module, list[torch.optim.Optimizer], dict]:
    """nanochat's model, MLP width set so that its matmul parameters come nearest `target_matmul` (a multiple
    of 8), initialised by its own `init_weights`, with the optimizers its own set-up returns; and its
    shape."""
    gpt, where = nanochat.gpt, f"--nanochat {nanochat.path}"
    fields = {field.name for field in dataclasses.fields(gpt.GPTConfig)}
    changes = {
        "sequence_len": seq,
        "vocab_size": vocab,
        "n_layer": n_layers,
        "n_head": n_heads,
        "n_embd": d_model,
    }
    changes.update({"n_kv_head": n_heads} if "n_kv_head" in fields else {})
    changes.update({"window_pattern": "L"} if "window_pattern" in fields else {})
    with contextlib.redirect_stdout(sys.stderr):
        model = gpt.GPT(gpt.GPTConfig(**changes))
        blocks_mlp = mlps(model, where)
        shipped = sum(m.c_fc.weight.numel() + m.c_proj.weight.numel() for m in blocks_mlp)
        rest = matmul_parameters(model) - shipped
        hidden = max(8, int(round((target_matmul - rest) / (n_layers * 2 * d_model) / 8)) * 8)
        linear = type(blocks_mlp[0].c_fc)
        for mlp in blocks_mlp:
            mlp.c_fc, mlp.c_proj = linear(d_model, hidden, bias=False), linear(hidden, d_model, bias=False)
        if hasattr(model, "init_weights"):
            model.init_weights()
        model.train()
        setup = getattr(model, "setup_optimizer", None) or model.setup_optimizers
        optimizers = setup()
    optimizers = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    matmul = matmul_parameters(model)
    shape = {
        "nanochat_hidden": hidden,
        "nanochat_shipped_hidden": 4 * d_model,
        "nanochat_matmul_parameters": matmul,
        "nanochat_flops_per_token": 6 * matmul + 6 * n_layers * 2 * d_model * (seq + 1) / 2,
        "nanochat_parameters": sum(p.numel() for p in model.parameters()),
        "nanochat_compute_dtype": nanochat.compute_dtype,
        "nanochat_commit": nanochat.commit,
        "nanochat_optimizers": [type(o).__name__ for o in optimizers],
    }
    return model, optimizers, shape


def loss(model, tokens):
    # nanochat views its targets flat, which a column slice of the token block cannot be without a copy
    return model(tokens[:, :-1], tokens[:, 1:].contiguous())
