"""Draining: a node taken out of rotation through the admin API finishes what it has and
gets nothing new; SIGTERM to the proxy lets requests in flight finish, then ends the rest
with an error."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.conftest import free_port
from tests.proxy.conftest import MakeCluster
from tests.proxy.fakes import FakeBootstrap, FakeVLLM


async def _admin(c, verb: str, node: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with c.http.post(f"{c.url}/admin/{verb}", json={"node": node}, headers=headers) as r:
        return r.status, await r.json()


async def test_a_drained_node_finishes_its_requests_and_gets_nothing_new(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    d0, d1 = c.decode
    d0.delay = d1.delay = 0.5
    in_flight = [asyncio.create_task(c.post()) for _ in range(2)]  # one on each
    await d0.wait_requests(1)
    status, body = await _admin(c, "drain", d0.url)
    assert status == 200 and {n["url"]: n["draining"] for n in body["nodes"]}[d0.url]
    assert [(await t)[0] for t in in_flight] == [200, 200]  # what it had finished
    d0.delay = d1.delay = 0.0
    for _ in range(6):
        assert (await c.post())[0] == 200
    assert (len(d0.received), len(d1.received)) == (1, 7)  # nothing new on d0
    async with c.http.get(f"{c.url}/status") as r:
        assert [n["draining"] for n in (await r.json())["decode"]] == [True, False]
    assert (await _admin(c, "undrain", "decode"))[0] == 200
    for _ in range(4):
        await c.post()
    assert len(d0.received) > 1


async def test_admin_api_needs_the_node_key_and_names_nodes(make_cluster: MakeCluster) -> None:
    c = await make_cluster(backend_api_key="node-key")
    assert (await _admin(c, "drain", "decode"))[0] == 401
    assert (await _admin(c, "drain", "decode", "wrong"))[0] == 401
    status, body = await _admin(c, "drain", "http://nowhere:1", "node-key")
    assert status == 404 and "known:" in body["error"]["message"]
    assert (await _admin(c, "drain", "decode", "node-key"))[0] == 200
    assert (await c.post())[0] == 200  # every decode node drained: P answers it whole
    assert (await _admin(c, "drain", "prefill", "node-key"))[0] == 200
    assert (await c.post())[0] == 503  # and with P drained too, nothing is left


class _Proxy:
    """The proxy as its own process, as `pdctl up` runs it, in front of fakes."""

    def __init__(self, p: FakeVLLM, b: FakeBootstrap, d: FakeVLLM, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "appliance.proxy", "--host", "127.0.0.1", "--port",
             str(self.port), "--prefill", f"{p.url},{b.url}", "--decode", d.url,
             "--health-interval", "0.05", "--no-first-token-from-prefill", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    async def ready(self) -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, self.proc.stderr.read()
                await asyncio.sleep(0.1)


@pytest.fixture
async def fakes():
    p, b, d = FakeVLLM("p"), FakeBootstrap({0: "engine-p"}), FakeVLLM("d")
    for node in (p, b, d):
        await node.start()
    yield p, b, d
    d.hang = d.hang_after_headers = False
    for node in (p, b, d):
        await asyncio.wait_for(node.stop(), 30)
    if b.side is not None:
        b.side.close()  # its ZMQ socket: an open one blocks the interpreter's exit


async def _ask(url: str, stream: bool) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.text()


async def test_sigterm_lets_requests_in_flight_finish(fakes) -> None:
    p, b, d = fakes
    proxy = _Proxy(p, b, d, "--drain-grace", "10")
    try:
        await proxy.ready()
        d.delay = 1.0
        asks = [asyncio.create_task(_ask(proxy.url, stream)) for stream in (False, True, True)]
        await d.wait_requests(3)
        proxy.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        with pytest.raises(aiohttp.ClientError):  # the listener is closed: nothing new
            await _ask(proxy.url, False)
        results = await asyncio.gather(*asks)
        assert [s for s, _ in results] == [200, 200, 200]
        assert all(raw.endswith("data: [DONE]\n\n") for _, raw in results[1:])
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
    finally:
        proxy.proc.kill()


async def test_sigterm_ends_what_outlives_the_grace_with_an_error(fakes) -> None:
    p, b, d = fakes
    proxy = _Proxy(p, b, d, "--drain-grace", "0.5", "--decode-read-timeout", "60")
    try:
        await proxy.ready()
        d.hang_after_headers = True  # a stream that would run for a minute
        ask = asyncio.create_task(_ask(proxy.url, True))
        await d.wait_requests(1)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        status, raw = await asyncio.wait_for(ask, 10)
        assert time.monotonic() - started < 5
        events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        assert status == 200 and "shutting down" in events[-1]["error"]["message"]
        assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
    finally:
        proxy.proc.kill()


async def test_pdctl_drain_and_undo_against_the_running_proxy(make_cluster: MakeCluster,
                                                               tmp_path) -> None:
    from click.testing import CliRunner

    from appliance.pdctl.cli import cli
    from appliance.pdctl.node.localstate import LocalState

    c = await make_cluster(n_decode=2, backend_api_key="node-key")
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "keys" / "api-key").write_text("node-key\n")
    LocalState(run_id="r", supervisor_pid=None, started_at=0.0, model="m",
               endpoints={"proxy": c.url}, services=[]).save(run_dir)
    c.decode[0].delay = 1.0
    slow = asyncio.create_task(c.post())
    await c.decode[0].wait_requests(1)

    def pdctl(*args: str):
        return CliRunner().invoke(cli, [*args, "--local", "--run-dir", str(run_dir)])

    res = await asyncio.to_thread(pdctl, "drain", c.decode[0].url, "--wait", "10")
    assert res.exit_code == 0, res.output
    assert f"decode {c.decode[0].url}: draining, 0 in flight" in res.output
    assert (await slow)[0] == 200  # the drain waited for it
    res = await asyncio.to_thread(pdctl, "drain", "decode", "--undo")
    assert res.exit_code == 0 and res.output.count("in rotation") == 2, res.output
    (run_dir / "keys" / "api-key").write_text("wrong\n")
    res = await asyncio.to_thread(pdctl, "drain", "decode")
    assert res.exit_code == 1 and "the proxy answered 401" in res.output


async def test_a_p_drained_while_a_request_waits_for_its_slot_is_not_called(
        make_cluster: MakeCluster) -> None:
    """The request's P is picked from the rotation as it is once D admitted it, not as it
    was when it arrived: P drained meanwhile gets nothing, D serves it alone."""
    c = await make_cluster(max_in_flight_per_decode=1, max_queued=4, queue_timeout_s=5.0)
    c.decode[0].delay = 0.5
    first = asyncio.create_task(c.post())
    await c.decode[0].wait_requests(1)
    second = asyncio.create_task(c.post())  # waits for D's one slot
    await asyncio.sleep(0.1)
    assert (await _admin(c, "drain", c.prefill[0].url))[0] == 200
    c.decode[0].delay = 0.0
    assert [(await t)[0] for t in (first, second)] == [200, 200]
    assert len(c.prefill[0].received) == 1  # the first's only
    assert "kv_transfer_params" not in c.decode[0].bodies()[1]  # D alone
