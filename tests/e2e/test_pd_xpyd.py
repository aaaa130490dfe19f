"""xPyD at run time: 2P1D and 1P2D, each vLLM server on a host of its own (a network
namespace on one switch), brought up from a cluster description through `pdctl render
--cluster` and each host's rendered compose files (see cluster_up). Real vLLM (CPU), KV over
Mooncake TCP across the hosts.

Checked: a plain server's greedy output token for token; every request's KV moved from the
P the proxy named to the D it named (the proxy's access log against P's "sent" and D's
"received" lines); both routing policies use every node of the role there is more than one
of; a P killed mid-run (its transfers slowed by tests.faults, so some are in flight) is
routed around, every request ending in an exact answer or a clear error."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections import Counter

import pytest

from appliance import kvbudget
from appliance.process import CPU_BLOCK_SIZE, ServiceProcess
from tests.e2e.cluster_up import TIMEOUTS, bring_up, render, wait_ready
from tests.e2e.conftest import plain_request, token_prompt
from tests.e2e.fabric import fabric

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                 reason="needs root and iproute2")]

# Each topology: hosts (name, its CPU count, its instances), the proxy on the last one. The
# machine has two cores: P and D never share one.
TOPOLOGIES = {
    "2p1d": [("p0", 1, {"prefill": [[0]]}), ("p1", 1, {"prefill": [[0]]}),
             ("d0", 2, {"decode": [[1]]})],
    "1p2d": [("p0", 1, {"prefill": [[0]]}), ("d0", 2, {"decode": [[1]]}),
             ("d1", 2, {"decode": [[1]]})],
}
DELAY_MS = 1500  # p0's KV writes start this late: a kill lands while transfers are in flight
MAX_TOKENS = 12


def _toml(value: object) -> str:
    return json.dumps(value)


def description(model: str, hosts: list, ips: list[str]) -> str:
    kv = kvbudget.budget(None, model, 2048, CPU_BLOCK_SIZE)
    lines = ['stack = "cpu"', "[model]", f"path = {_toml(model)}", 'served_name = "tiny"',
             "max_model_len = 2048", f"kv_cache_bytes = {kv}",
             'extra_args = ["--enforce-eager"]', "[proxy]", f'host = "{hosts[-1][0]}"',
             'split = "always"',  # every request's KV crosses hosts: what is checked
             "[timeouts]", *(f"{k} = {v}" for k, v in TIMEOUTS.items())]
    for (name, cpus, roles), ip in zip(hosts, ips, strict=True):
        lines += ["[[hosts]]", f'name = "{name}"', f'ip = "{ip}"', f"cpus = {cpus}",
                  *(f"{role} = {devices}" for role, devices in roles.items())]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def cluster(request, tiny_model, tmp_path_factory):
    shape = TOPOLOGIES[request.param]
    out = tmp_path_factory.mktemp(f"xpyd-{request.param}")
    with fabric(len(shape)) as hosts:
        rendered = render(description(str(tiny_model), shape, [h.ip for h in hosts]), out)
        by_name = {name: h for (name, _, _), h in zip(shape, hosts, strict=True)}
        slow_p0 = {"p0/prefill-0": f"write_delay_ms={DELAY_MS}"}
        with bring_up(rendered, by_name, out / "logs", slow_p0) as running:
            proxy_host = shape[-1][0]
            proxy = f"http://{by_name[proxy_host].ip}:8000"
            took = wait_ready(running, proxy_host, proxy, backends=len(shape))
            print(f"{request.param}: every instance in rotation {took:.0f} s after start")
            yield request.param, running, proxy_host, proxy


@pytest.fixture(scope="module")
def expected(plain_server):
    """Prompts and a plain server's greedy token ids for them."""
    import asyncio

    prompts = [token_prompt(24 + 37 * i, seed=700 + i) for i in range(8)]

    async def ids() -> list[list[int]]:
        return [(await plain_request(plain_server, "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}))["choices"][0]["token_ids"] for p in prompts]

    return prompts, asyncio.run(ids())


_ACCESS = re.compile(r"xfer=(\S+) p=(\S+?)(?:#dp\d+)? d=(\S+) status=(\d+)")


def access(log: str) -> list[tuple[str, str, str, int]]:
    """(transfer id, P url, D url, status) of each request the proxy logged."""
    return [(m[1], m[2], m[3], int(m[4])) for m in _ACCESS.finditer(log)]


def _owner(cluster, url: str, role: str) -> str:
    """The service "<host>/<role>-0" whose host has this URL's address."""
    host = next(n for n, h in cluster.hosts.items() if f"//{h.ip}:" in url)
    return f"{host}/{role}-0"


def _ask(cluster, host: str, proxy: str, prompts: list, concurrency: int) -> list:
    return cluster.driver(host, {"op": "ask", "proxy": proxy, "prompts": prompts,
                                 "max_tokens": MAX_TOKENS, "concurrency": concurrency})["answers"]


def test_parity_and_every_kv_moved_where_the_proxy_said(cluster, expected):
    shape, running, host, proxy = cluster
    prompts, want = expected
    answers = _ask(running, host, proxy, prompts, concurrency=2)
    assert [(a[0], a[1]) for a in answers] == [(200, ids) for ids in want]
    logged = access(running.log(f"{host}/proxy"))
    assert len(logged) == len(prompts) and all(status == 200 for *_, status in logged)
    for xfer, p_url, d_url, _ in logged:
        assert re.search(rf"sent p_req=\S+ d_req=\S+ transfer={xfer} ",
                         running.log(_owner(running, p_url, "prefill"))), (xfer, p_url)
        assert f"transfer={xfer} blocks=" in running.log(_owner(running, d_url, "decode"))
    # round robin: every node of the role there are two of served
    spread = Counter(p if shape == "2p1d" else d for _, p, d, _ in logged)
    assert len(spread) == 2 and min(spread.values()) >= 2, spread
    # pdctl status --cluster, from a host of the cluster: all healthy and in rotation, the
    # KV counted where it moved (vLLM publishes its counters with its next step), no warning
    deadline = time.monotonic() + 15
    while True:
        res = running.pdctl(host, "status", "--cluster", str(running.description), "--json")
        status = json.loads(res.stdout)
        assert res.returncode == 0 and status["healthy"] and not status["warnings"], status
        kv = [m["kv"] for m in status["members"]]
        moved = (sum(k.get("sent", 0) for k in kv), sum(k.get("received", 0) for k in kv))
        if min(moved) >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert min(moved) >= len(prompts), status


def test_least_outstanding_spreads_too(cluster, expected, tmp_path):
    shape, running, host, proxy = cluster
    prompts, want = expected
    rendered = running.services[f"{host}/proxy"].argv
    command = rendered[rendered.index(sys.executable):]
    second = ServiceProcess("proxy-lo", running.hosts[host].run(
        [*command, "--port", "8001", "--policy", "least_outstanding"]), tmp_path / "lo.log")
    second.start()
    try:
        url = proxy.replace(":8000", ":8001")
        running.driver(host, {"op": "ready", "proxy": url, "backends": 3, "wait_s": 60})
        answers = _ask(running, host, url, prompts, concurrency=4)
        assert [(a[0], a[1]) for a in answers] == [(200, ids) for ids in want]
        logged = access(second.log_path.read_text())
        spread = Counter(p if shape == "2p1d" else d for _, p, d, _ in logged)
        assert len(spread) == 2, spread
    finally:
        second.stop()


def test_a_prefill_killed_mid_run_is_routed_around(cluster, expected):
    shape, running, host, proxy = cluster
    if shape != "2p1d":
        pytest.skip("needs a second P")
    prompts, want = expected
    driver = running.start_driver(host, {"op": "ask", "proxy": proxy, "prompts": prompts,
                                         "max_tokens": MAX_TOKENS, "concurrency": 8})
    assert driver.stderr is not None
    while "sending" not in driver.stderr.readline():  # the driver has started its requests
        assert driver.poll() is None, driver.communicate()
    time.sleep(0.6)  # p0 has answered its prefills; their KV waits DELAY_MS to be written
    killed = time.monotonic()
    running.kill("p0/prefill-0")
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, err[-2000:]
    answers = json.loads(out.strip().splitlines()[-1])["answers"]
    ended = time.monotonic() - killed
    errors = [a for a in answers if a[0] != 200]
    # p0's transfers in flight: D's calls waiting on its KV asked again on D alone
    moved = running.log(f"{host}/proxy").count("fallback=prefill_down")
    print(f"p0 killed: all {len(answers)} ended {ended:.1f} s after the kill, "
          f"{len(errors)} with an error, {moved} asked again on D alone")
    assert moved >= 1
    for (status, got, _), ids in zip(answers, want, strict=True):
        assert got == ids if status == 200 else (status >= 400 and isinstance(got, str)
                                                 and got), (status, got)
    # from now on p1 alone serves, exactly
    again = _ask(running, host, proxy, prompts[:4], concurrency=2)
    assert [(a[0], a[1]) for a in again] == [(200, ids) for ids in want[:4]]
    p1 = f"http://{running.hosts['p1'].ip}:8010"
    assert {p for _, p, _, _ in access(running.log(f"{host}/proxy"))[-4:]} == {p1}
