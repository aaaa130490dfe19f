"""The KV connector package; vLLM loads `PDConnector` from here by
`"kv_connector_module_path": "appliance.connector"` (see `facade.py`).

The facade (and with it vLLM's KV-connector classes) is imported lazily, on the first
`appliance.connector.PDConnector`, so that importing any other part of the package does not
load vLLM: `cpu_features`, which vLLM runs as a general plugin in every process of this
environment (a plain server's too), and the parts the GPU tests import where only two of
vLLM's base classes are stood in for (tests/gpu/conftest.py). The proxy imports nothing
here: the side channel's messages and CURVE are `appliance.sidechannel`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PDConnector"]


def __getattr__(name: str) -> Any:
    if name in ("PDConnector", "PDConnectorMetadata"):
        from appliance.connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'appliance.connector' has no attribute {name!r}")
