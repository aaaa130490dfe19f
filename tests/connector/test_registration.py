"""A prefill worker's registration loop: its first registration replaces a predecessor's
(a restarted process keeps its engine id), its refreshes do not."""

from __future__ import annotations

import asyncio

from appliance.bootstrap.client import BootstrapError
from appliance.bootstrap.wire import Registration
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.registration import keep_registered


class Client:
    def __init__(self, fail_first: int) -> None:
        self.sent: list[Registration] = []
        self.fail_first = fail_first

    async def register(self, reg: Registration) -> None:
        self.sent.append(reg)
        if len(self.sent) <= self.fail_first:
            raise BootstrapError("sidecar not up yet")


async def test_replace_until_registered_then_plain_refreshes() -> None:
    client = Client(fail_first=2)
    settings = ConnectorSettings(engine_id="p", role="producer", register_interval_s=0.01)
    reg = Registration(engine_id="p", addr="tcp://127.0.0.1:5555")
    task = asyncio.create_task(keep_registered(client, reg, settings))  # type: ignore[arg-type]
    while len(client.sent) < 6:
        await asyncio.sleep(0.01)
    task.cancel()
    assert [r.replace for r in client.sent[:3]] == [True, True, True]  # until it is in
    assert not any(r.replace for r in client.sent[3:])
