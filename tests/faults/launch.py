"""What a test changes to start a vLLM server whose connector injects faults: its
`--kv-transfer-config` names tests.faults.connector, and its environment carries the plan
and this checkout (on PYTHONPATH, so every vLLM process can import `tests`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.faults.plan import ENV

MODULE = "tests.faults.connector"
ROOT = Path(__file__).resolve().parents[2]


def faulty_config(kv_transfer_config: str) -> str:
    """vLLM's `--kv-transfer-config` (JSON) with the fault-injection connector in place of
    the product's; everything else as it was."""
    config = json.loads(kv_transfer_config)
    config["kv_connector_module_path"] = MODULE
    return json.dumps(config)


def fault_env(plan: str) -> dict[str, str]:
    """The environment a server needs for `plan` (tests.faults.plan's syntax)."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {ENV: plan, "PYTHONPATH": os.pathsep.join(path)}
