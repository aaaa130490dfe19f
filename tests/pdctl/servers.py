"""Live stand-ins on loopback for `pdctl status` / `up` / `logs`: the real bootstrap sidecar
and proxy, fake vLLM servers, and a fake Docker Engine API on a unix socket (the docker SDK
talks to it like to dockerd). They run on an event loop in a background thread so that
pdctl's blocking calls can reach them from the test's thread."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from appliance.bootstrap.app import build_app as bootstrap_app
from appliance.bootstrap.settings import BootstrapSettings
from appliance.proxy.server import build_app as proxy_app
from appliance.proxy.settings import ProxySettings
from tests.conftest import free_port

API_VERSION = "1.47"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"

VLLM_METRICS = {
    "prefill": """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 0.0
# TYPE vllm:pd_kv_transfers counter
vllm:pd_kv_transfers_total{engine="0",model_name="qwen"} 41.0
# TYPE vllm:pd_kv_failed_transfers counter
vllm:pd_kv_failed_transfers_total{engine="0",model_name="qwen"} 2.0
""",
    "decode": """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
# TYPE vllm:pd_kv_received counter
vllm:pd_kv_received_total{engine="0",model_name="qwen"} 40.0
# TYPE vllm:pd_kv_failed_receives counter
vllm:pd_kv_failed_receives_total{engine="0",model_name="qwen"} 1.0
""",
}


@dataclass
class FakeVLLM:
    role: str
    healthy: bool = True
    extra_metrics: str = ""  # appended to the role's /metrics

    def app(self) -> web.Application:
        app = web.Application()

        async def health(_r: web.Request) -> web.Response:
            return web.Response(status=200 if self.healthy else 503)

        async def metrics(_r: web.Request) -> web.Response:
            return web.Response(text=VLLM_METRICS[self.role] + self.extra_metrics)

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        return app


@dataclass
class FakeContainer:
    service: str
    state: str = "running"
    health: str | None = "healthy"
    restarts: int = 0
    exit_code: int = 0
    log: str = ""
    project: str = "pd-appliance"

    @property
    def id(self) -> str:
        return f"{self.service:0<12}".replace(" ", "0") + "f" * 52

    @property
    def name(self) -> str:
        return f"{self.project}-{self.service}-1"

    def labels(self) -> dict[str, str]:
        return {PROJECT_LABEL: self.project, SERVICE_LABEL: self.service}

    def summary(self) -> dict[str, Any]:
        return {"Id": self.id, "Names": [f"/{self.name}"], "Image": "pd-appliance/x:0.1.0",
                "Labels": self.labels(), "State": self.state, "Status": self.state}

    def inspect(self) -> dict[str, Any]:
        state: dict[str, Any] = {"Status": self.state, "Running": self.state == "running",
                                 "ExitCode": self.exit_code}
        if self.health:
            state["Health"] = {"Status": self.health}
        return {"Id": self.id, "Name": f"/{self.name}", "RestartCount": self.restarts,
                "State": state, "Config": {"Labels": self.labels(), "Tty": False,
                                           "Image": "pd-appliance/x:0.1.0"}}


@dataclass
class FakeDocker:
    containers: list[FakeContainer] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append(f"{request.method} {request.path_qs}")
            return await handler(request)

        app.middlewares.append(record)

        async def version(_r: web.Request) -> web.Response:
            return web.json_response({"Version": "28.2.2", "ApiVersion": API_VERSION,
                                      "MinAPIVersion": "1.24", "Os": "linux"})

        def find(request: web.Request) -> FakeContainer:
            for c in self.containers:
                if request.match_info["id"] in (c.id, c.name):
                    return c
            raise web.HTTPNotFound(text=json.dumps({"message": "No such container"}),
                                   content_type="application/json")

        async def listing(request: web.Request) -> web.Response:
            filters = json.loads(request.query.get("filters", "{}"))
            wanted = filters.get("label", [])
            wanted = [wanted] if isinstance(wanted, str) else list(wanted)
            out = [c.summary() for c in self.containers
                   if all(c.labels().get(k) == v for k, v in
                          (w.split("=", 1) for w in wanted))]
            return web.json_response(out)

        async def inspect(request: web.Request) -> web.Response:
            return web.json_response(find(request).inspect())

        async def logs(request: web.Request) -> web.Response:
            body = b""
            for line in find(request).log.splitlines(keepends=True):
                data = line.encode()
                body += struct.pack(">BxxxL", 1, len(data)) + data
            return web.Response(body=body,
                                content_type="application/vnd.docker.multiplexed-stream")

        async def ping(_r: web.Request) -> web.Response:
            return web.Response(text="OK")

        for prefix in ("", "/{ver}"):
            app.router.add_get(f"{prefix}/version", version)
            app.router.add_get(f"{prefix}/_ping", ping)
            app.router.add_get(f"{prefix}/containers/json", listing)
            app.router.add_get(f"{prefix}/containers/{{id}}/json", inspect)
            app.router.add_get(f"{prefix}/containers/{{id}}/logs", logs)
        return app


class Servers:
    """An event loop in a thread, hosting aiohttp apps on loopback ports or unix sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def tcp(self, app: web.Application, port: int | None = None,
            host: str = "127.0.0.1") -> str:
        port = port or free_port()

        async def start() -> None:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            self.runners.append(runner)

        self._call(start())
        return f"http://{host}:{port}"

    def unix(self, app: web.Application, path: Path) -> str:
        async def start() -> None:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.UnixSite(runner, str(path)).start()
            self.runners.append(runner)

        self._call(start())
        return f"unix://{path}"

    def close(self) -> None:
        async def stop() -> None:
            for runner in reversed(self.runners):
                await runner.cleanup()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def register(bootstrap: str, engine_id: str) -> None:
    """A P worker's registration with the sidecar at `bootstrap`."""
    req = urllib.request.Request(
        f"{bootstrap}/register", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"engine_id": engine_id, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                         "addr": "tcp://127.0.0.1:5555"}).encode())
    urllib.request.urlopen(req, timeout=5).close()


@dataclass
class Node:
    """A fake node: real bootstrap + proxy, fake P and D, and the ports they use."""
    servers: Servers
    prefill: FakeVLLM
    decode: FakeVLLM
    ports: dict[str, int]
    engine_id: str = "node1-prefill"

    @classmethod
    def start(cls, servers: Servers, engine_id: str = "node1-prefill") -> Node:
        ports = {name: free_port() for name in ("proxy", "prefill", "decode", "bootstrap")}
        node = cls(servers, FakeVLLM("prefill"), FakeVLLM("decode"), ports, engine_id)
        servers.tcp(node.prefill.app(), ports["prefill"])
        servers.tcp(node.decode.app(), ports["decode"])
        boot = servers.tcp(bootstrap_app(BootstrapSettings(ttl=0)), ports["bootstrap"])
        register(boot, engine_id)
        settings = ProxySettings(
            host="127.0.0.1", port=ports["proxy"], health_interval_s=0.1,
            prefill=[{"url": f"http://127.0.0.1:{ports['prefill']}", "bootstrap_url": boot}],
            decode=[{"url": f"http://127.0.0.1:{ports['decode']}"}], log_requests=False)
        servers.tcp(proxy_app(settings), ports["proxy"])
        node.wait_proxy(200)
        return node

    def wait_proxy(self, status: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.ports['proxy']}/health"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    got = r.status
            except urllib.error.HTTPError as exc:
                got = exc.code
            except OSError:
                got = None
            if got == status:
                return
            assert time.monotonic() < deadline, f"proxy /health never answered {status}"
            time.sleep(0.05)

    def config_toml(self) -> str:
        p = self.ports
        return f"""\
[host]
name = "node1"
ip = "127.0.0.1"

[model]
path = "/models/qwen"

[transfer]
protocol = "rdma"
device = "mlx5_0"

[ports]
proxy = {p['proxy']}
prefill = {p['prefill']}
decode = {p['decode']}
bootstrap = {p['bootstrap']}
"""
