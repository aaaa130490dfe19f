"""The KV connector package; vLLM loads `PDConnector` from here by
`"kv_connector_module_path": "appliance.connector"` (see `facade.py`).

The facade is imported lazily so that the pure parts (`plan`, `messages`) import without
vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PDConnector"]


def __getattr__(name: str) -> Any:
    if name in ("PDConnector", "PDConnectorMetadata"):
        from appliance.connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'appliance.connector' has no attribute {name!r}")
