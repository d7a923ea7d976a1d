"""What a prepare is asked for, and whether a finished data folder is what that request would prepare.

`pilotrun pilot --workdir W` prepares W/data once and reuses it on every later call; a later call with another
`--source` or `--tokenizer` must not train on the old data as if it were the new. This module compares a
folder's manifest with a request before anything is read for tokenizing: the built-in corpus and local files
are hashed as prepare records them (so an edited file is a different source under the same name), a tokenizer
file is loaded and hashed as prepare hashes it, a BPE still to be trained is compared by its requested size
(what it is trained on is the source, compared too), and a hub source or tokenizer by what was requested
(name, config, revision as given), without the network: a pilot that reuses its data works offline.
"""

from __future__ import annotations

from typing import Any

from pilotrun.data.sources import describe_source, requested_source
from pilotrun.data.tokenizer import parse_bpe_spec, resolve_tokenizer


def request_options(
    *,
    train_tokens: int | None,
    val_fraction: float,
    shard_tokens: int,
    seed: int,
    shuffle_buffer: int,
    shuffle_buffer_bytes: int,
    text_field: str,
    eos: str | None,
) -> dict[str, Any]:
    """The manifest's `options`: what prepare records and what a reuse is compared on, in one form."""
    return {
        "train_tokens": None if train_tokens is None else int(train_tokens),
        "val_fraction": float(val_fraction),
        "shard_tokens": int(shard_tokens),
        "seed": int(seed),
        "shuffle_buffer": int(shuffle_buffer),
        "shuffle_buffer_bytes": int(shuffle_buffer_bytes),
        "text_field": text_field,
        "eos": eos,
    }


def requested_tokenizer(spec: str, eos: str | None = None) -> dict[str, Any]:
    """The fields of the manifest's `tokenizer` that this `--tokenizer` determines."""
    spec = str(spec).strip()
    if spec.startswith("bpe:"):
        return {"kind": "bpe", "requested_vocab_size": parse_bpe_spec(spec)}
    if spec.startswith("hub:"):
        name, _, revision = spec[len("hub:"):].partition("@")
        return {"kind": "hub", "name": name, "revision_requested": revision or "main"}
    identity = resolve_tokenizer(spec, eos).identity  # a file: loaded and hashed, never trained
    return {"kind": "file", "sha256": identity["sha256"]}


def describe_tokenizer(identity: dict[str, Any]) -> str:
    kind = identity.get("kind")
    if kind == "bpe":
        return f"bpe:{identity.get('requested_vocab_size')}"
    if kind == "hub":
        return f"hub:{identity.get('name')}@{identity.get('revision_requested')}"
    if kind == "file":
        return f"a tokenizer file with sha256 {str(identity.get('sha256'))[:12]}"
    return str(identity)


def prepared_differences(manifest: dict[str, Any], source: str, tokenizer: str,
                         options: dict[str, Any]) -> list[str]:
    """How the data folder of `manifest` differs from what prepare would make of this request, one phrase per
    difference (`source: ...`, `tokenizer: ...`, one per option); [] when it is the same request."""
    found = []
    recorded_source = manifest.get("source") or {}
    wanted = requested_source(source, options.get("text_field", "text"))
    if {key: recorded_source.get(key) for key in wanted} != wanted:
        found.append(f"source: prepared from {describe_source(recorded_source)}, this call asks for "
                     f"{describe_source(wanted)}")
    recorded_tokenizer = manifest.get("tokenizer") or {}
    wanted = requested_tokenizer(tokenizer, options.get("eos"))
    if {key: recorded_tokenizer.get(key) for key in wanted} != wanted:
        found.append(f"tokenizer: prepared with {describe_tokenizer(recorded_tokenizer)}, this call asks for "
                     f"{describe_tokenizer(wanted)}")
    recorded_options = manifest.get("options") or {}
    for key, value in options.items():
        if recorded_options.get(key) != value:
            found.append(f"{key}: prepared with {recorded_options.get(key)!r}, this call asks for {value!r}")
    return found
