"""Kubernetes discovery against a stand-in API server (tests/proxy/k8s_api.py): pods that
become Ready, NotReady, terminating, deleted or added change the proxy's backends; the
watch survives bookmarks, a 410 expiry, a dropped stream, a rotated token and an outage
(which keeps the last set). Also the settings and flags of `--discovery kubernetes`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.proxy import k8s_settings as proxy_k8s
from appliance.proxy.__main__ import main
from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.nodes.backends import Backends
from appliance.proxy.nodes.discovery import KubernetesDiscovery
from appliance.proxy.server import serve
from appliance.proxy.settings import KubernetesSettings, ProxySettings, load_settings
from tests.proxy.conftest import FAST
from tests.proxy.conftest import until as wait_until
from tests.proxy.fakes import FakeBootstrap, FakeVLLM
from tests.proxy.k8s_api import FakeKubeApi

P = {"app.kubernetes.io/instance": "r", "app.kubernetes.io/component": "prefill"}
D = {"app.kubernetes.io/instance": "r", "app.kubernetes.io/component": "decode"}
SELECTORS = {"prefill_selector": "app.kubernetes.io/instance=r,"
                                 "app.kubernetes.io/component=prefill",
             "decode_selector": "app.kubernetes.io/instance=r,"
                                "app.kubernetes.io/component=decode"}


async def until(check: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> None:
    await wait_until(check, timeout)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeKubeApi]:
    server = FakeKubeApi()
    await server.start()
    (tmp_path / "token").write_text("token-1\n")
    yield server
    await server.stop()


def k8s_settings(api: FakeKubeApi, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"namespace": api.namespace, "api_server": api.url,
            "token_file": str(tmp_path / "token"), "ca_file": str(tmp_path / "no-ca.crt"),
            "retry_max_s": 0.2, **SELECTORS, **extra}


class Watched:
    """Discovery feeding a real Backends (no health poller: nothing is contacted)."""

    def __init__(self, api: FakeKubeApi, tmp_path: Path, **extra: Any) -> None:
        settings = ProxySettings.model_validate({
            "discovery": "kubernetes", "kubernetes": k8s_settings(api, tmp_path, **extra)})
        self.backends = Backends(settings, ProxyMetrics())
        self.discovery = KubernetesDiscovery(settings.kubernetes, self.backends.reconcile)

    def prefill(self) -> list[tuple[str, str]]:
        return sorted((b.url, b.bootstrap_url) for b in self.backends.prefill)

    def decode(self) -> list[str]:
        return sorted(b.url for b in self.backends.decode)


@pytest.fixture
async def watched(api: FakeKubeApi, tmp_path: Path) -> AsyncIterator[Watched]:
    w = Watched(api, tmp_path)
    yield w
    await w.discovery.stop()


def _p(ip: str) -> tuple[str, str]:
    return f"http://{ip}:8010", f"http://{ip}:8998"


async def test_pods_changing_change_the_backends(api: FakeKubeApi, watched: Watched) -> None:
    api.set_pod("r-prefill-0", P, "10.1.0.1")
    api.set_pod("r-prefill-1", P, "10.1.0.2", ready=False)
    api.set_pod("r-prefill-2", P, None, ready=False)  # pending: no IP yet
    api.set_pod("r-decode-0", D, "10.1.1.1")
    api.set_pod("other-0", {**P, "app.kubernetes.io/instance": "s"}, "10.9.9.9")
    watched.discovery.start()
    await until(lambda: watched.prefill() == [_p("10.1.0.1")]
                and watched.decode() == ["http://10.1.1.1:8020"])

    api.set_pod("r-prefill-1", P, "10.1.0.2")  # Ready
    await until(lambda: watched.prefill() == [_p("10.1.0.1"), _p("10.1.0.2")])
    api.set_pod("r-prefill-0", P, "10.1.0.1", ready=False)  # NotReady
    await until(lambda: watched.prefill() == [_p("10.1.0.2")])
    api.set_pod("r-prefill-1", P, "10.1.0.2", terminating=True)  # deletionTimestamp set
    await until(lambda: watched.prefill() == [])
    api.set_pod("r-prefill-2", P, "10.1.0.3")  # scheduled, then Ready
    api.set_pod("r-decode-1", D, "fd00::5")  # an IPv6 pod
    api.delete_pod("r-decode-0")
    await until(lambda: watched.prefill() == [_p("10.1.0.3")]
                and watched.decode() == ["http://[fd00::5]:8020"])
    api.set_pod("r-decode-1", D, "fd00::6")  # restarted with a new IP
    await until(lambda: watched.decode() == ["http://[fd00::6]:8020"])
    assert api.lists == 2  # one per role: every change came by the watch


async def test_bookmarks_expiry_and_dropped_streams_are_survived(
        api: FakeKubeApi, watched: Watched) -> None:
    api.set_pod("r-prefill-0", P, "10.1.0.1")
    api.set_pod("r-decode-0", D, "10.1.1.1")
    watched.discovery.start()
    await until(lambda: len(api.watches) == 2)
    api.bookmark()
    api.set_pod("r-decode-1", D, "10.1.1.2")
    await until(lambda: len(watched.decode()) == 2)

    api.expire()  # 410 Gone: both roles list again
    await until(lambda: api.lists >= 4 and len(api.watches) == 2)
    api.set_pod("r-prefill-1", P, "10.1.0.2")
    await until(lambda: len(watched.prefill()) == 2)

    api.drop_watches()
    api.delete_pod("r-decode-0")  # while no watch runs: the next list finds it gone
    await until(lambda: watched.decode() == ["http://10.1.1.2:8020"])
    assert api.lists >= 6
    await until(lambda: len(api.watches) == 2)
    api.set_pod("r-decode-2", D, "10.1.1.3")
    await until(lambda: len(watched.decode()) == 2)


async def test_a_watch_the_server_ends_is_resumed_without_a_list(
        api: FakeKubeApi, tmp_path: Path) -> None:
    w = Watched(api, tmp_path, watch_timeout_s=1)
    api.set_pod("r-prefill-0", P, "10.1.0.1")
    w.discovery.start()
    try:
        await until(lambda: len(api.watches) == 2)
        api.bookmark()  # the next watches resume from it, not from the list's version
        await until(lambda: api.watched_from.count(api.version) == 2)
        api.set_pod("r-decode-0", D, "10.1.1.1")
        await until(lambda: w.decode() == ["http://10.1.1.1:8020"])
        assert api.lists == 2
    finally:
        await w.discovery.stop()


async def test_a_rotated_token_is_read_again(api: FakeKubeApi, watched: Watched,
                                             tmp_path: Path) -> None:
    api.set_pod("r-decode-0", D, "10.1.1.1")
    watched.discovery.start()
    await until(lambda: len(api.watches) == 2)
    # The kubelet writes the new token; the old one stops working; streams get cut.
    (tmp_path / "token").write_text("token-2-rotated\n")
    api.token = "token-2-rotated"
    api.drop_watches()
    api.set_pod("r-decode-1", D, "10.1.1.2")
    await until(lambda: len(watched.decode()) == 2)
    assert api.refused == 0  # the new token was read before the first request with it

    api.token = "token-3"  # refused until the file says so: keep the set, retry
    api.drop_watches()
    await until(lambda: api.refused >= 2)
    assert len(watched.decode()) == 2
    (tmp_path / "token").write_text("token-3\n")
    api.delete_pod("r-decode-0")
    await until(lambda: watched.decode() == ["http://10.1.1.2:8020"])


async def test_an_api_server_outage_keeps_the_last_set(
        api: FakeKubeApi, watched: Watched, caplog: pytest.LogCaptureFixture) -> None:
    api.set_pod("r-prefill-0", P, "10.1.0.1")
    api.set_pod("r-decode-0", D, "10.1.1.1")
    watched.discovery.start()
    await until(lambda: len(api.watches) == 2)
    caplog.set_level(logging.WARNING, "appliance.proxy.nodes.discovery")
    await api.stop()
    await until(lambda: sum("keeping the 1 known" in r.getMessage()
                            for r in caplog.records) >= 4)  # both roles failed, twice
    assert watched.prefill() == [_p("10.1.0.1")] and watched.decode() == ["http://10.1.1.1:8020"]
    api.delete_pod("r-decode-0")  # changes while it was down
    api.set_pod("r-decode-1", D, "10.1.1.2")
    await api.start()
    await until(lambda: watched.decode() == ["http://10.1.1.2:8020"])
    assert watched.prefill() == [_p("10.1.0.1")]


@asynccontextmanager
async def discovered_proxy(api: FakeKubeApi, tmp_path: Path,
                           **extra: Any) -> AsyncIterator[tuple[Any, FakeVLLM, FakeBootstrap]]:
    """The whole proxy with discovery, and a fake P (with its sidecar) and D whose ports
    the pods' are: (the proxy, D, the sidecar)."""
    p, b, d = FakeVLLM("p"), FakeBootstrap({0: "engine-p"}), FakeVLLM("d")
    for node in (p, b, d):
        await node.start()
    settings = ProxySettings.model_validate({**FAST, **extra, "discovery": "kubernetes",
                                             "kubernetes": k8s_settings(
                                                 api, tmp_path, prefill_port=p.port,
                                                 decode_port=d.port, bootstrap_port=b.port)})
    proxy = None
    try:
        proxy = await serve(settings)
        yield proxy, d, b
    finally:
        if proxy is not None:
            await proxy.close()
        for node in (p, b, d):
            await node.stop()
        assert b.side is not None
        b.side.close()


async def test_the_proxy_serves_through_discovered_pods(api: FakeKubeApi,
                                                        tmp_path: Path) -> None:
    """The whole proxy: pods on 127.0.0.1 whose ports are the fakes'; a pod going NotReady
    takes its node out."""
    api.set_pod("r-prefill-0", P, "127.0.0.1")
    api.set_pod("r-decode-0", D, "127.0.0.1")
    async with discovered_proxy(api, tmp_path) as (proxy, d, b), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
        async def health() -> bool:
            async with http.get(f"{proxy.url}/health") as r:
                return r.status == 200
        await until(health)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        async with http.post(f"{proxy.url}/v1/completions", json=body) as r:
            assert r.status == 200
        assert d.received[0].kv["remote_bootstrap_addr"] == b.url

        api.set_pod("r-decode-0", D, "127.0.0.1", ready=False)

        async def decode_gone() -> bool:
            async with http.get(f"{proxy.url}/status") as r:
                return (await r.json())["decode"] == []
        await until(decode_gone)
        assert not await health()


async def test_a_discovered_pod_is_checked_at_once_not_at_the_next_round(
        api: FakeKubeApi, tmp_path: Path) -> None:
    """In a rollout the pod a new one replaces leaves moments after the new one is Ready:
    were the new one in rotation only after the poller's next round, no node of its role
    would be for up to an interval (requests got 503s on a real node). Here the interval is
    an hour, and the pods appear after the first round."""
    async with discovered_proxy(api, tmp_path, health_interval_s=3600) as (proxy, _, _b), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
        async def ready() -> bool:
            async with http.get(f"{proxy.url}/ready") as r:
                return r.status == 200
        assert not await ready()  # no pod yet; the poller's first round is done
        api.set_pod("r-prefill-0", P, "127.0.0.1")
        api.set_pod("r-decode-0", D, "127.0.0.1")
        await until(ready, timeout=5)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        async with http.post(f"{proxy.url}/v1/completions", json=body) as r:
            assert r.status == 200


# ---- settings ----------------------------------------------------------------------------

def test_kubernetes_flags(tmp_path: Path) -> None:
    s = load_settings(["--discovery", "kubernetes", "--k8s-namespace", "pd",
                       "--k8s-prefill-selector", SELECTORS["prefill_selector"],
                       "--k8s-decode-selector", SELECTORS["decode_selector"],
                       "--k8s-prefill-port", "9010", "--k8s-bootstrap-port", "9998",
                       "--k8s-token-file", "/t", "--k8s-ca-file", "/ca"],
                      environ={"KUBERNETES_SERVICE_HOST": "fd00::1",
                               "KUBERNETES_SERVICE_PORT": "6443"})
    k = s.kubernetes
    assert (s.discovery, k.namespace, k.prefill_port, k.decode_port, k.bootstrap_port) == (
        "kubernetes", "pd", 9010, 8020, 9998)
    assert (k.api_server, k.token_file, k.ca_file) == ("https://[fd00::1]:6443", "/t", "/ca")
    assert k.decode_selector == SELECTORS["decode_selector"]
    assert load_settings(["--decode", "http://d:1"], environ={}).discovery == "static"


def test_namespace_defaults_to_the_pods_own(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "namespace").write_text("serving\n")
    monkeypatch.setattr(proxy_k8s, "SERVICE_ACCOUNT_DIR", str(tmp_path))
    s = load_settings(["--discovery", "kubernetes", "--k8s-prefill-selector", "a=p",
                       "--k8s-decode-selector", "a=d", "--k8s-api-server", "http://k:8080"],
                      environ={})
    assert s.kubernetes.namespace == "serving"
    assert KubernetesSettings().token_file.endswith("/serviceaccount/token")


@pytest.mark.parametrize(("argv", "words"), [
    (["--k8s-decode-selector", "a=d"], "needs --k8s-prefill-selector"),
    (["--k8s-prefill-selector", "a=p", "--k8s-decode-selector", "a=d",
      "--prefill", "http://p:8010"], "give no --prefill or --decode"),
    (["--k8s-prefill-selector", "a=p", "--k8s-decode-selector", "a=d"],
     "KUBERNETES_SERVICE_HOST is not set"),
])
def test_bad_kubernetes_settings_get_one_line(argv, words, capsys, monkeypatch) -> None:
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--discovery", "kubernetes", "--k8s-namespace", "pd", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("proxy: error: ") and words in err[0], err
