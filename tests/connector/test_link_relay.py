"""The side channel's TCP link drops while P lives (a reset flow, a front-end NIC outage
while KV moves over another path): D must not hand back blocks P may still write.

D reaches P's side channel through a TCP relay. While P's prefill is held, the relay resets
both ends of every connection (RST) and refuses new ones for 10 s; meanwhile P's prefill
ends and P writes D's blocks batch by batch (the KV path is not the side channel), and its
answer is lost with the link. D gives the pull up when the link drops, yet reports it (and so
hands its blocks back to vLLM) only after P's last batch began, when P can write no more.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from appliance.bootstrap.wire import Registration
from tests.connector.fake_transport import FakeNetwork, FakeTransport
from tests.connector.test_side_channel import Pair

REFUSE_S = 10.0


class Relay:
    """127.0.0.1:port -> the target, byte for byte, until `cut`."""

    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._pipe_both, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _pipe_both(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        assert self.target is not None
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._links += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def cut(self, refuse_s: float) -> None:
        """Reset every connection, refuse new ones for `refuse_s`, then listen again."""
        assert self._server is not None
        self._server.close()  # refused from now on
        for w in self._links:
            try:  # linger 0: closing sends a RST, as a reset flow or a dead middlebox does
                w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                      struct.pack("ii", 1, 0))
            except OSError:
                pass
            w.transport.abort()
        self._links.clear()
        await asyncio.sleep(refuse_s)
        await self.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


async def test_blocks_stay_held_while_p_writes_behind_a_reset_link(bootstrap_url):
    network = FakeNetwork()
    pair = Pair(bootstrap_url, new_transport=lambda: FakeTransport(network),
                recv_timeout_s=6, cancel_grace_s=1, max_batch_descs=1)
    relay = Relay()
    port = await relay.start()
    sender = pair.sender
    sender._registration = lambda: Registration(  # D is told the relay's address
        engine_id="p0", addr=f"tcp://127.0.0.1:{port}", dp_rank=0, tp_rank=0, pp_rank=0,
        tp_size=1)
    await pair.start()
    host, p_port = sender.side_channel_addr.removeprefix("tcp://").rsplit(":", 1)
    relay.target = (host, int(p_port))
    assert pair.receiver is not None and isinstance(pair.p.transport, FakeTransport)
    try:
        pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))
        for _ in range(300):  # P has D's request; its prefill is still held
            t = sender.by_transfer.get("x1")
            if t is not None and t.d_req_id == "d1":
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("P never got D's request")
        cut = asyncio.create_task(relay.cut(REFUSE_S))
        await asyncio.sleep(0.5)
        pair.p.transport.faults.batch_delay_s = 0.5  # a batch a layer: 2 s of writing
        sender.on_ready("p1", "x1", [[3, 4]], None)
        started = time.monotonic()
        reported_at, (done, failed) = None, (set(), set())
        while time.monotonic() - started < REFUSE_S + 5:
            done, failed = pair.receiver.take_results()
            if done:
                reported_at = time.monotonic()
                break
            await asyncio.sleep(0.02)
        assert reported_at is not None, "D never gave the pull back"
        starts = pair.p.transport.batch_starts
        assert len(starts) == 4 and max(starts) < reported_at  # held past P's last batch
        assert done == {"d1"} and failed == {"d1"}  # given up: vLLM recomputes it
        await asyncio.sleep(0.5)
        assert len(pair.p.transport.batch_starts) == 4  # and nothing after
        await cut
    finally:
        relay.close()
        await pair.close()
