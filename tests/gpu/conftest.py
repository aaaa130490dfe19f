"""GPU-path tests: KV in CUDA memory, moved by Mooncake's CUDA build, fenced on CUDA events.

They run only where torch sees a CUDA device (a GPU host: `python -m pytest tests/gpu`) and
are skipped everywhere else, CI included (each module's `pytestmark`). vLLM's CUDA build
need not be installed there: when `import vllm` fails, the two vLLM base classes that the
connector's worker side subclasses (`KVConnectorMetadata`, `KVConnectorStats`) are replaced
by stand-ins, the one seam of this folder. Mooncake, ZMQ, the bootstrap sidecar and torch
are real.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any


def _stand_in_vllm_bases() -> None:
    """Minimal `vllm...v1.base` / `...v1.metrics` modules, only when vLLM is absent."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.metrics  # noqa: F401
        return
    except ImportError:
        pass

    class KVConnectorMetadata:  # vLLM's is an empty ABC
        pass

    @dataclass
    class KVConnectorStats:  # vLLM's: a dataclass holding `data`
        data: dict[str, Any] = field(default_factory=dict)

    prefix = "vllm.distributed.kv_transfer.kv_connector.v1"
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector", prefix):
        sys.modules.setdefault(name, types.ModuleType(name))
    base = sys.modules[f"{prefix}.base"] = types.ModuleType(f"{prefix}.base")
    base.KVConnectorMetadata = KVConnectorMetadata  # type: ignore[attr-defined]
    metrics = sys.modules[f"{prefix}.metrics"] = types.ModuleType(f"{prefix}.metrics")
    metrics.KVConnectorStats = KVConnectorStats  # type: ignore[attr-defined]


try:
    import torch

    if torch.cuda.is_available():
        _stand_in_vllm_bases()
except ImportError:
    pass
