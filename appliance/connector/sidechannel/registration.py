"""A prefill worker's registration with the bootstrap sidecar (docs/protocol.md step 4),
kept alive."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from appliance.bootstrap.client import BootstrapClient, BootstrapError
from appliance.bootstrap.wire import Registration
from appliance.connector.settings import ConnectorSettings

log = logging.getLogger("vllm.appliance.connector.transfers.sender")


async def keep_registered(client: BootstrapClient, reg: Registration,
                          settings: ConnectorSettings) -> None:
    """Register, then refresh within the sidecar's TTL; never blocks start-up. A failure is
    retried with doubling delays up to the refresh interval."""
    delay = 0.5
    registered = False
    # Until it is in, this worker's registration replaces a predecessor's (the process it
    # restarts with the same engine id, not yet expired); then refreshes only refresh.
    starting = msgspec.structs.replace(reg, replace=True)
    while True:
        try:
            await client.register(reg if registered else starting)
            if not registered:
                log.info("engine %s tp %d registered side channel %s at %s", reg.engine_id,
                         reg.tp_rank, reg.addr, settings.bootstrap_addr)
            registered, delay = True, 0.5
            await asyncio.sleep(settings.register_interval_s)
        except BootstrapError as exc:
            log.warning("bootstrap registration failed (retrying in %.1fs): %s", delay, exc)
            registered = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, settings.register_interval_s)
