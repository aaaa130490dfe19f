"""`bench/transfer.py --auth both`: the connector's whole side-channel path with CURVE off and
on, side by side in one run; `--verify both`: the same with D checking none of its pulls
against P's digest (`verify_kv = off`) and all of them (`all`).

One process, one event loop, as a P worker and a D worker would each run theirs: a real
Sender and Receiver per mode, each mode with its own bootstrap sidecar, both modes sharing
one pair of Mooncake engines and KV caches, so the only difference is the side channel. One
transfer: P's KV is ready, D asks (request over ZMQ), P's Mooncake batch write, P's FINISH
reply (with its digest, when D asked), D sums what landed and reports the request received.
Timed from D's ask to D's report; the first transfer
of each mode (sidecar lookup, connect, CURVE handshake, layout) is reported apart. Modes
alternate, their order rotating, so drift and neighbours hit both alike. A throughput case
runs IN_FLIGHT transfers at once (each into D blocks of its own) and times them together.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

IN_FLIGHT = 4  # transfers at once in the throughput case

# Each comparison: its two modes, the settings each adds, and what its table is called.
COMPARISONS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "auth": ("CURVE", {"off": {}, "on": {"side_channel_key_file": "KEY"}}),
    "verify": ("verify_kv", {"off": {"verify_kv": "off"}, "all": {"verify_kv": "all"}}),
}


def _receiver_class() -> type:
    from appliance.connector.transfers.receiver import Receiver

    class TimedReceiver(Receiver):
        """Sets an event when a request is reported, so no polling adds to the time."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.waiters: dict[str, asyncio.Event] = {}

        def _report(self, req_id: str, ok: bool) -> None:
            super()._report(req_id, ok)
            event = self.waiters.pop(req_id, None)
            if event is not None:
                event.set()

    return TimedReceiver


class _Mode:
    def __init__(self, name: str, url: str, extra: dict[str, Any], p: Any, d: Any) -> None:
        from appliance.connector.settings import ConnectorSettings
        from appliance.connector.stats import TransferStats
        from appliance.connector.transfers.sender import Sender

        common = {"bootstrap_addr": url, "host": "127.0.0.1", "register_interval_s": 0.5,
                  **extra}
        self.name, self.url, self.engine = name, url, f"p-{name}"
        self.sender = Sender(ConnectorSettings(engine_id=self.engine, role="producer",
                                               **common), p.transport, p.regions, "127.0.0.1",
                             0, 1, 0, TransferStats())
        self.receiver = _receiver_class()(
            ConnectorSettings(engine_id=f"d-{name}", role="consumer", **common), d.transport,
            d.regions, "127.0.0.1", 0, 1, TransferStats())
        self.n = 0
        self.received: set[str] = set()
        self.sent: set[str] = set()

    async def transfer(self, src: list[int], dst: list[int]) -> float:
        from appliance.connector.metadata import RecvSpec

        self.n += 1
        tid = f"{self.name}-{self.n}"
        self.sender.on_ready(f"p{tid}", tid, [src], None)
        done = self.receiver.waiters[f"d{tid}"] = asyncio.Event()
        t = time.perf_counter()
        self.receiver.on_recv(f"d{tid}", RecvSpec(tid, [dst], self.engine, self.url))
        await asyncio.wait_for(done.wait(), 60)
        seconds = time.perf_counter() - t
        finished, failed = self.receiver.take_results()  # others' too, when several run
        self.received |= finished
        assert f"d{tid}" in self.received and not failed, (finished, failed)
        self.received.discard(f"d{tid}")
        self.sender.on_finished({f"p{tid}"})
        self.sent |= self.sender.take_finished()
        assert f"p{tid}" in self.sent
        self.sent.discard(f"p{tid}")
        return seconds

    async def close(self) -> None:
        await self.sender.close()
        await self.receiver.close()


class _Side:
    def __init__(self, kv_cache: Callable[..., Any], shape: Any, num_blocks: int,
                 fill: bool) -> None:
        from appliance.connector.planning.plan import TensorInfo, registration_spans
        from appliance.connector.transfers.mooncake import MooncakeTransport

        self.buf, layers = kv_cache(shape, num_blocks, fill)
        infos = [TensorInfo.from_tensor(t) for t in layers]
        self.regions = [r for i in infos for r in i.regions(num_blocks, 0)]
        self.transport = MooncakeTransport()
        self.transport.start("127.0.0.1", "tcp")
        self.transport.register(registration_spans(infos))


async def _sidecar() -> tuple[Any, str]:
    from aiohttp import web

    from appliance.bootstrap import BootstrapSettings, build_app

    runner = web.AppRunner(build_app(BootstrapSettings(ttl=0)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001


async def _registered(url: str) -> None:
    from appliance.bootstrap.client import BootstrapClient

    client = BootstrapClient(url)
    try:
        for _ in range(200):
            if "0" in await client.query():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the sender never registered at {url}")
    finally:
        await client.close()


async def _measure(kv_cache: Callable[..., Any], shape: Any, reps: int,
                   modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # see PSide: two OpenMP threads on 2 shared cores stall
    p = _Side(kv_cache, shape, shape.p_blocks, fill=True)
    # Room for IN_FLIGHT transfers at once, each into blocks of its own.
    d = _Side(kv_cache, shape, shape.d_first + IN_FLIGHT * shape.blocks, fill=False)
    src = list(range(shape.p_first, shape.p_blocks))
    cases = {
        f"{shape.blocks} blocks": (src, list(range(shape.d_first, shape.d_blocks))),
        "1 block": ([shape.p_first], [shape.d_first]),
    }
    # Throughput: IN_FLIGHT transfers at once (as a loaded node has them), timed together:
    # one transfer's sums can overlap another's write.
    many = f"{IN_FLIGHT} x {shape.blocks} blocks in flight"
    dsts = [list(range(shape.d_first + k * shape.blocks, shape.d_first + (k + 1) * shape.blocks))
            for k in range(IN_FLIGHT)]
    runners, running = [], []
    try:
        for name, extra in modes.items():
            runner, url = await _sidecar()
            runners.append(runner)
            mode = _Mode(name, url, extra, p, d)
            running.append(mode)
            await mode.sender.start()
            await _registered(url)
        first = {m.name: await m.transfer(*cases["1 block"]) for m in running}
        times: dict[str, dict[str, list[float]]] = {c: {m.name: [] for m in running}
                                                    for c in [*cases, many]}
        for rep in range(reps):
            order = running[rep % len(running):] + running[:rep % len(running)]
            for case, (ids, dst) in cases.items():
                for mode in order:
                    times[case][mode.name].append(await mode.transfer(ids, dst))
            for mode in order:
                t = time.perf_counter()
                await asyncio.gather(*(mode.transfer(src, dst) for dst in dsts))
                times[many][mode.name].append(time.perf_counter() - t)
        base, other = (list(modes) * 2)[:2]
        paired = {c: statistics.median(b / a for a, b in zip(
                      t[base], t[other], strict=True)) if len(t) == 2 else None
                  for c, t in times.items()}
        return {"first": first, "paired": paired,
                "median": {c: {m: statistics.median(v) for m, v in t.items()}
                           for c, t in times.items()},
                "bytes": {**{c: shape.layers * len(ids) * shape.chunk
                             for c, (ids, _) in cases.items()},
                          many: IN_FLIGHT * shape.layers * len(src) * shape.chunk},
                "reps": reps}
    finally:
        for mode in running:
            await mode.close()
        for runner in runners:
            await runner.cleanup()
        p.transport.close()
        d.transport.close()


def report(kv_cache: Callable[..., Any], shape: Any, reps: int, what: str,
           choice: str) -> None:
    """`kv_cache(shape, num_blocks, fill)`: bench/transfer.py's cache, in vLLM's layout;
    `what`: a COMPARISONS key; `choice`: one of its modes, or "both"."""
    from rich.console import Console
    from rich.table import Table

    from appliance.sidechannel.curve import generate_secret

    label, all_modes = COMPARISONS[what]
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "side-channel.key"
        key_file.write_text(generate_secret() + "\n")
        modes = {name: {k: str(key_file) if v == "KEY" else v for k, v in extra.items()}
                 for name, extra in all_modes.items() if choice in (name, "both")}
        start = time.perf_counter()
        res = asyncio.run(_measure(kv_cache, shape, reps, modes))
    names = list(modes)
    ratio = f"{names[-1]}/{names[0]}"
    table = Table(title=f"Side channel, {label} {' vs '.join(names)}: D asks, P writes "
                  "(Mooncake TCP loopback), P answers FINISH, D reports; one process")
    both = len(names) == 2
    # The ratio of the medians; paired: the median of each repetition's ratio, which the
    # drift of a shared machine between repetitions does not move.
    for col in ("transfer", "MiB", *(f"{label} {m} ms" for m in names),
                *([ratio, "paired"] if both else []), "reps"):
        table.add_column(col, justify="left" if col == "transfer" else "right")
    for case, med in res["median"].items():
        table.add_row(case, f"{res['bytes'][case] / (1 << 20):.2f}",
                      *(f"{med[m] * 1e3:.2f}" for m in names),
                      *([f"{med[names[1]] / med[names[0]]:.3f}", f"{res['paired'][case]:.3f}"]
                        if both else []),
                      str(res["reps"]))
    table.add_section()
    table.add_row("first (lookup, connect, handshake, layout)", "",
                  *(f"{res['first'][m] * 1e3:.2f}" for m in names),
                  *([f"{res['first'][names[1]] / res['first'][names[0]]:.3f}", ""]
                    if both else []), "1")
    Console(width=160).print(table)
    print(f"target: {ratio} <= 1.05 (median time); run took {time.perf_counter() - start:.0f} s")
