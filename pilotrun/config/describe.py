"""A recipe described: every leaf key with its value, default, type and one-line meaning, as `pilotrun config`
prints it (keys whose value differs from the default marked).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from pilotrun.config.run_config import RunConfig


def describe_config(config: RunConfig) -> list[dict[str, Any]]:
    """Every leaf key of a recipe with its value, default, type and one-line meaning, in declaration order."""
    rows: list[dict[str, Any]] = []

    def walk(instance: Any, default: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(instance))
        for f in dataclasses.fields(instance):
            key = f"{prefix}.{f.name}" if prefix else f.name
            value, default_value = getattr(instance, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, default_value, key)
                continue
            hint = hints[f.name]
            type_name = hint.__name__ if isinstance(hint, type) else str(hint)
            rows.append({"key": key, "value": value, "default": default_value, "type": type_name,
                         "meaning": f.metadata.get("meaning", "")})

    walk(config, RunConfig(), "")
    return rows


def format_config_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of `describe_config` rows; keys whose value differs from the default are marked
    '*'."""
    width = max(len(r["key"]) for r in rows)
    lines = []
    for r in rows:
        mark = "*" if r["value"] != r["default"] else " "
        value = yaml.safe_dump(r["value"], default_flow_style=True).strip().removesuffix("\n...").strip()
        default = yaml.safe_dump(r["default"], default_flow_style=True).strip().removesuffix("\n...").strip()
        lines.append(
            f"{mark} {r['key']:<{width}}  {value:<14} (default {default}, {r['type']})  {r['meaning']}"
        )
    return "\n".join(lines)
