"""The bootstrap sidecar as a real aiohttp server on an ephemeral loopback port."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from appliance.bootstrap import BootstrapSettings, build_app
from appliance.bootstrap.client import BootstrapClient, BootstrapError
from appliance.bootstrap.wire import Registration
from tests.conftest import free_port

REG = {"engine_id": "6c1f-e2", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
       "addr": "tcp://10.0.0.1:41235"}


class Server:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner, self.url = runner, url
        self.http = aiohttp.ClientSession()

    async def post(self, path: str, body, headers=None) -> tuple[int, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.http.post(self.url + path, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str, headers=None) -> tuple[int, dict]:
        async with self.http.get(self.url + path, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def delete(self, path: str, headers=None) -> tuple[int, dict]:
        async with self.http.delete(self.url + path, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def start(**kw) -> Server:
    runner = web.AppRunner(build_app(BootstrapSettings(host="127.0.0.1", port=0, **kw)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - ephemeral port
    return Server(runner, f"http://127.0.0.1:{port}")


@pytest.fixture
async def server():
    srv = await start(ttl=0)
    yield srv
    await srv.http.close()
    await srv.runner.cleanup()


async def test_register_query_round_trip_in_reference_shape(server):
    assert await server.post("/register", REG) == (200, {"status": "ok"})
    await server.post("/register", {**REG, "tp_rank": 1, "addr": "tcp://10.0.0.1:41236"})
    status, body = await server.get("/query")
    assert status == 200
    # Exactly the reference's shape: string keys dp -> {engine_id, worker_addr: tp -> pp -> addr}
    assert body == {"0": {"engine_id": "6c1f-e2",
                          "worker_addr": {"0": {"0": "tcp://10.0.0.1:41235"},
                                          "1": {"0": "tcp://10.0.0.1:41236"}}}}
    assert await server.get("/health") == (200, {"status": "ok", "engines": 1})


async def test_defaults_for_ranks_and_several_dp_ranks(server):
    assert (await server.post("/register", {"engine_id": "a", "addr": "tcp://h:1"}))[0] == 200
    await server.post("/register", {"engine_id": "b", "dp_rank": 1, "addr": "tcp://h:2"})
    _, body = await server.get("/query")
    assert {k: v["engine_id"] for k, v in body.items()} == {"0": "a", "1": "b"}


async def test_same_registration_again_is_accepted(server):
    for _ in range(3):
        assert await server.post("/register", REG) == (200, {"status": "ok"})
    _, body = await server.get("/query")
    assert body["0"]["worker_addr"] == {"0": {"0": REG["addr"]}}


@pytest.mark.parametrize("change", [
    {"engine_id": "other-engine"},                 # dp rank 0 held by another engine
    {"addr": "tcp://10.0.0.9:5555"},               # known worker, different address
    {"dp_rank": 1},                                # same engine id on a second dp rank
])
async def test_conflicts_are_400_and_change_nothing(server, change):
    await server.post("/register", REG)
    before = await server.get("/query")
    status, body = await server.post("/register", {**REG, **change})
    assert status == 400
    assert body["error"]["type"] == "conflict_error" and body["error"]["message"]
    assert await server.get("/query") == before


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "invalid registration"),
    (b"[1, 2]", "invalid registration"),
    ({"dp_rank": 0, "addr": "tcp://h:1"}, "engine_id"),                 # missing field
    ({"engine_id": "e"}, "addr"),                                       # missing field
    ({**REG, "tp_rank": "zero"}, "tp_rank"),                            # wrong type
    ({**REG, "dp_rank": -1}, "dp_rank"),                                # negative rank
    ({**REG, "engine_id": ""}, "engine_id"),                            # empty id
    ({**REG, "addr": "http://10.0.0.1:1"}, "addr"),                     # not tcp://
    ({**REG, "addr": "tcp://10.0.0.1:99999"}, "addr"),                  # bad port
    ({**REG, "addr": 5}, "addr"),                                       # wrong type
])
async def test_malformed_registrations_are_400_and_leave_registry_unchanged(server, body, fragment):
    await server.post("/register", {"engine_id": "keep", "dp_rank": 3, "addr": "tcp://h:9"})
    before = await server.get("/query")
    status, answer = await server.post("/register", body)
    assert status == 400
    assert fragment in answer["error"]["message"]
    assert await server.get("/query") == before


async def test_oversized_body_is_413_json():
    srv = await start(ttl=0, max_body_bytes=2048)
    try:
        status, body = await srv.post("/register", {**REG, "engine_id": "x" * 5000})
        assert status == 413
        assert "too large" in body["error"]["message"]
        assert await srv.get("/query") == (200, {})
    finally:
        await srv.http.close()
        await srv.runner.cleanup()


async def test_unknown_path_and_method_are_json_errors(server):
    assert (await server.get("/nope"))[0] == 404
    async with server.http.put(server.url + "/register") as r:
        assert r.status == 405
        assert "error" in await r.json()


async def test_ttl_expiry_drops_unrefreshed_workers():
    srv = await start(ttl=0.6)
    try:
        await srv.post("/register", REG)
        await srv.post("/register", {"engine_id": "fresh", "dp_rank": 1, "addr": "tcp://h:7"})
        for _ in range(4):  # keep only "fresh" alive
            await asyncio.sleep(0.25)
            await srv.post("/register", {"engine_id": "fresh", "dp_rank": 1, "addr": "tcp://h:7"})
        _, body = await srv.get("/query")
        assert list(body) == ["1"]
        # After expiry another engine may take the dp rank (a restarted prefill node).
        assert (await srv.post("/register", {**REG, "engine_id": "restarted"}))[0] == 200
    finally:
        await srv.http.close()
        await srv.runner.cleanup()


async def test_delete_engine(server):
    await server.post("/register", REG)
    assert (await server.delete("/engines/6c1f-e2"))[0] == 200
    assert await server.get("/query") == (200, {})
    status, body = await server.delete("/engines/6c1f-e2")
    assert status == 404 and "not registered" in body["error"]["message"]


async def test_token_required_when_configured():
    srv = await start(ttl=0, token="s3cret")
    try:
        assert (await srv.post("/register", REG))[0] == 401
        assert (await srv.post("/register", REG, {"Authorization": "Bearer wrong"}))[0] == 401
        assert (await srv.get("/query"))[0] == 401  # it names P's side channels
        assert (await srv.get("/query", {"Authorization": "Bearer wrong"}))[0] == 401
        assert (await srv.get("/health"))[0] == 200
        ok = {"Authorization": "Bearer s3cret"}
        assert (await srv.post("/register", REG, ok))[0] == 200
        assert (await srv.get("/query", ok))[1]["0"]["engine_id"] == "6c1f-e2"
        client = BootstrapClient(srv.url, token="s3cret")
        try:
            assert (await client.query())["0"].engine_id == "6c1f-e2"
        finally:
            await client.close()
        assert (await srv.delete("/engines/6c1f-e2"))[0] == 401
        assert (await srv.delete("/engines/6c1f-e2", ok))[0] == 200
    finally:
        await srv.http.close()
        await srv.runner.cleanup()


async def test_client_register_query_delete(server):
    client = BootstrapClient(server.url)
    try:
        await client.register_with_retry(Registration(**REG))
        answer = await client.query()
        assert answer["0"].engine_id == "6c1f-e2"
        assert answer["0"].worker_addr["0"]["0"] == REG["addr"]
        with pytest.raises(BootstrapError, match="400"):
            await client.register(Registration(**{**REG, "engine_id": "intruder"}))
        await client.delete("6c1f-e2")
        assert await client.query() == {}
    finally:
        await client.close()


async def test_client_reports_unreachable_server_clearly():
    client = BootstrapClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    try:
        with pytest.raises(BootstrapError, match="unreachable"):
            await client.register_with_retry(Registration(**REG), attempts=2, first_delay=0.05)
    finally:
        await client.close()


def test_module_entry_point_serves_and_rejects_bad_settings(tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("abc\n")
    proc = subprocess.Popen([sys.executable, "-m", "appliance.bootstrap", "--host", "127.0.0.1",
                             "--port", str(port), "--ttl", "5", "--token-file", str(token)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import urllib.request
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert json.load(r)["status"] == "ok"
                    break
            except OSError:
                assert time.monotonic() < deadline, "bootstrap did not start"
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
    (tmp_path / "empty").write_text("")
    bad = subprocess.run([sys.executable, "-m", "appliance.bootstrap", "--token-file",
                          str(tmp_path / "empty")], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    expected = f"bootstrap: error: token file {tmp_path / 'empty'} is empty"
    assert bad.stderr.strip().splitlines() == [expected]
    # A sidecar anyone may register with is a choice, never a default.
    bare = subprocess.run([sys.executable, "-m", "appliance.bootstrap"], capture_output=True,
                          text=True, timeout=30)
    assert bare.returncode == 2
    assert bare.stderr.strip().splitlines() == [
        "bootstrap: error: give --token-file FILE (the shared token) or --no-token"]


async def test_a_restarted_worker_replaces_its_predecessor(server):
    """Same engine id, new side channel, before the old entry expires: a starting worker's
    registration (replace) takes the place; the old address, refreshing, now conflicts."""
    await server.post("/register", REG)
    moved = {**REG, "addr": "tcp://10.0.0.1:45000"}
    assert (await server.post("/register", moved))[0] == 400  # a refresh does not replace
    assert await server.post("/register", {**moved, "replace": True}) == \
        (200, {"status": "ok"})
    _, body = await server.get("/query")
    assert body["0"]["worker_addr"] == {"0": {"0": moved["addr"]}}
    status, body = await server.post("/register", REG)
    assert status == 400 and body["error"]["type"] == "conflict_error"
