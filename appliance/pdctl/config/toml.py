"""The host config written back as TOML (`pdctl init`): the main keys always, every other
key only where it differs from its default."""

from __future__ import annotations

import json
from typing import Any

from appliance.pdctl.config.hostconfig import HostConfig

_HEADER = """\
# pd-appliance host config: one file per host (written by `pdctl init`).
# Check it with `pdctl doctor`; `pdctl render` turns it into what compose and systemd read.
"""


def toml_value(value: Any) -> str:
    """A value as TOML writes it on one line (a table inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a string: JSON's escapes are TOML's basic string's


def toml_lines(data: dict[str, Any]) -> list[str]:
    """Top-level `key = value` lines (None values left out)."""
    return [f"{key} = {toml_value(value)}" for key, value in data.items() if value is not None]


# Written even when they equal the default: the keys an operator looks for first.
_CLUSTER = ("cluster", "prefill", "decode", "proxy", "prefill_backends", "decode_backends",
            "sidecars")
_ALWAYS = {"host": ("name", "ip"), "model": ("path",), "gpus": ("prefill", "decode"),
           "transfer": ("protocol", "device", "gpudirect"),
           "ports": ("proxy", "prefill", "decode", "bootstrap"), "cluster": _CLUSTER}
_ALWAYS_CPU = {**_ALWAYS, "gpus": (), "cpus": ("prefill", "decode"), "transfer": ("protocol",)}
# A cluster host's devices are in [cluster]: the 1P1D sections would only mislead.
_NOT_IN_CLUSTER = ("gpus", "cpus")


def to_toml(cfg: HostConfig, header: str = _HEADER) -> str:
    """The config as TOML: the main keys, plus every other key that differs from its default."""
    full = cfg.model_dump(exclude_none=True)
    changed = cfg.model_dump(exclude_defaults=True, exclude_none=True)
    always = _ALWAYS_CPU if cfg.stack == "cpu" else _ALWAYS
    lines = [header, f"stack = {toml_value(cfg.stack)}", ""]
    for section in HostConfig.model_fields:
        if section == "stack" or section not in full or (
                cfg.cluster is not None and section in _NOT_IN_CLUSTER):
            continue
        keys = [k for k in full[section]
                if k in always.get(section, ()) or k in changed.get(section, {})]
        if not keys:
            continue
        lines.append(f"[{section}]")
        lines += toml_lines({key: full[section][key] for key in keys})
        lines.append("")
    return "\n".join(lines)
