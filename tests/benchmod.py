"""A bench/ script imported as a module, for tests of its arithmetic (no servers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py as module `bench_<name>`; its sibling modules import as when it runs
    as a script."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module
