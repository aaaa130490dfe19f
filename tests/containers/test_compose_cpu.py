"""The whole node in containers on this CPU machine, as a user runs it.

A private Docker Engine (tests/containers/engine.py), a Debian base made with debootstrap,
every CPU-stack image built by images/build.sh, then pdctl init --stack cpu / up / status /
logs / down on the tiny model. Greedy output through the containers equals a plain vLLM
server's, D's container killed comes back by its restart policy, and after `down` and the
engine's stop nothing is left: no container, mount, namespace or process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance import kvbudget
from appliance.pdctl.config.hostconfig import parse_config
from appliance.pdctl.config.toml import to_toml
from appliance.process import (
    CPU_BLOCK_SIZE,
    ServiceProcess,
    cpu_env,
    kv_cache_flags,
    vllm_serve_argv,
)
from tests import netlisten
from tests.conftest import free_port
from tests.containers.engine import DockerEngine, build_images
from tests.e2e.observe import calibrated, metric, received_for_each_remote, remote_decisions

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROJECT = "pdtest"
LONG = " ".join(f"word{i % 37} and more text number {i}" for i in range(40))  # > 4 blocks
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", LONG]
CHAT = [[{"role": "user", "content": "Say something about the sea."}],
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": LONG}]]


def requests_to_check() -> list[tuple[str, dict]]:
    out = []
    for stream in (False, True):
        out += [("/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 16,
                                     "temperature": 0, "stream": stream}) for p in PROMPTS]
        out += [("/v1/chat/completions", {"model": "tiny", "messages": m, "max_tokens": 16,
                                          "temperature": 0, "stream": stream}) for m in CHAT]
    return out


def answer(base: str, path: str, body: dict, timeout: float = 120) -> str:
    """The generated text of one request, streaming or not."""
    chat = path.endswith("chat/completions")
    with httpx.Client(timeout=timeout) as http:
        if not body.get("stream"):
            r = http.post(base + path, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        pieces = []
        with http.stream("POST", base + path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append((choice.get("delta") or {}).get("content") or ""
                                  if chat else choice.get("text") or "")
        return "".join(pieces)


@pytest.fixture(scope="module")
def engine(docker_engine, tmp_path_factory):
    """The module's engine (conftest.py: stopped after the module, nothing left) with the
    Debian base and every CPU-stack image built."""
    times = build_images(docker_engine, tmp_path_factory.mktemp("build") / "build.log")
    print(f"\nimages: {', '.join(f'{k} {v:.0f} s' for k, v in times.items())}")
    return docker_engine


@pytest.fixture(scope="module")
def expected(tiny_model, tmp_path_factory):
    """A plain server's answers, taken before the containers run (two cores only). It runs
    vLLM's defaults, as the node's P and D do: a compiled graph and an eager one differ in
    the last bits, and greedy output with them (measured: token 7 of the first prompt)."""
    port = free_port()
    proc = ServiceProcess(
        "plain-vllm", vllm_serve_argv(tiny_model, port, served_model_name="tiny",
                                      block_size=CPU_BLOCK_SIZE, max_model_len=2048,
                                      extra=kv_cache_flags(kvbudget.FLOOR)),
        tmp_path_factory.mktemp("plain") / "vllm.log", env=cpu_env("0"),
        health_url=f"http://127.0.0.1:{port}/health", cpus=[0])
    proc.start()
    try:
        proc.wait_healthy(300)
        return [answer(f"http://127.0.0.1:{port}", path, body)
                for path, body in requests_to_check()]
    finally:
        proc.stop()


def pdctl(engine: DockerEngine, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.pdctl", *args], capture_output=True,
                          text=True, env=engine.env, timeout=timeout)


@pytest.fixture(scope="module")
def node(engine, expected, tiny_model, tmp_path_factory):
    etc = tmp_path_factory.mktemp("etc")
    config = etc / "host.toml"
    ports = {name: free_port() for name in ("proxy", "prefill", "decode", "bootstrap")}
    res = pdctl(engine, "init", "--config", str(config), "--stack", "cpu", "--model",
                str(tiny_model), "--served-name", "tiny", "--host-ip", "127.0.0.1",
                "--max-model-len", "2048",
                *(arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))))
    assert res.returncode == 0, res.stderr
    data = tomllib.loads(config.read_text())
    assert data["ports"] == ports and data["stack"] == "cpu"
    # No vLLM flag added: P and D compile their graphs with the image's g++, as for a user.
    assert "extra_args" not in data["model"]
    data["compose"] = {"project": PROJECT}
    config.write_text(to_toml(parse_config(data)))
    up = pdctl(engine, "up", "--config", str(config), "--timeout", "600")
    print(up.stdout)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr
    try:
        yield {"config": config, "proxy": f"http://127.0.0.1:{ports['proxy']}", "up": up}
    finally:
        pdctl(engine, "down", "--config", str(config))


def status(engine: DockerEngine, node: dict) -> dict:
    res = pdctl(engine, "status", "--config", str(node["config"]), "--json", timeout=60)
    return json.loads(res.stdout)


def test_up_reports_every_container_healthy_with_timings(engine, node):
    assert "node healthy in" in node["up"].stdout
    for step in ("created", "bootstrap", "prefill", "decode", "proxy"):
        assert step in node["up"].stdout
    st = status(engine, node)
    assert st["healthy"], st
    for svc in st["services"]:
        assert svc["state"].startswith("running") and svc["exit_code"] == 0, svc
        assert svc["healthy"], svc


def test_greedy_output_through_containers_equals_a_plain_server(engine, node, expected):
    # The default split is auto, timed at start on the fresh node through the whole
    # split: P's KV reached D between the containers before any client asked.
    assert calibrated(node["proxy"])["handoff"]["samples"] >= 1
    before = status(engine, node)["counters"].get("decode.received", 0)
    assert before >= 4
    remote = remote_decisions(node["proxy"])
    got = [answer(node["proxy"], path, body) for path, body in requests_to_check()]
    assert got == expected
    # Then an idle node answers mostly by D alone; D used P's KV for each one placed
    # remote, none failed, and pdctl status shows the split.
    remote = remote_decisions(node["proxy"]) - remote
    st = status(engine, node)
    after = st["counters"]
    assert after["decode.received"] - before == remote
    assert after.get("decode.receive_failures", 0) == 0
    assert st["split"]["policy"] == "auto"
    assert sum(st["split"]["last_minute"].values()) >= len(expected)
    # The slim image's proxy tokenized the prompts with the model's own tokenizer (its
    # folder mounted), and its ids were D's own.
    tokenizer = httpx.get(node["proxy"] + "/status", timeout=10).json()["prefix"]["tokenizer"]
    assert tokenizer["where"] == "proxy" and "differed" not in tokenizer, tokenizer
    assert sum(tokenizer["checked"].values()) >= 1, tokenizer


def test_nothing_listens_on_a_wildcard_but_the_proxy_and_mooncake(engine, node):
    """P, D and the sidecar listen on host.ip alone; the proxy on compose.bind (0.0.0.0
    here, as configured); Mooncake, which cannot be bound, within transfer.port_range."""
    roots = set()
    for service in ("bootstrap", "prefill", "decode", "proxy"):
        pid = engine.docker("inspect", "-f", "{{.State.Pid}}", f"{PROJECT}-{service}-1")
        roots.add(int(pid.stdout.strip()))
    found = netlisten.listeners(netlisten.descendants(roots))
    proxy_port = int(node["proxy"].rsplit(":", 1)[1])
    for addr, port, _pid in found:
        if addr in netlisten.WILDCARDS:
            assert port == proxy_port or 17000 <= port <= 17199, f"{addr}:{port}"
        else:
            assert addr == "127.0.0.1", f"{addr}:{port}"
    assert any(p == proxy_port for _, p, _ in found)


def test_logs_prints_decode_log(engine, node):
    res = pdctl(engine, "logs", "decode", "--config", str(node["config"]), "--tail", "0",
                timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Creating v1 connector with name: PDConnector" in res.stdout, res.stdout[-2000:]
    assert "kv_consumer" in res.stdout


def test_decode_whose_engine_died_exits_and_comes_back_and_serves(engine, node, expected):
    """D's EngineCore killed (a crash of the engine, not of the server): the API server must
    exit, so the container's restart policy brings D back."""
    name = f"{PROJECT}-decode-1"
    pid = int(engine.docker("inspect", "-f", "{{.State.Pid}}", name).stdout.strip())
    cores = [p for p in netlisten.descendants({pid})
             if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    assert len(cores) == 1, cores
    os.kill(cores[0], 9)
    deadline = time.monotonic() + 300
    state = ""
    while time.monotonic() < deadline:
        state = engine.docker("inspect", "-f", "{{.RestartCount}} {{.State.Health.Status}}",
                              name).stdout.strip()
        if state.startswith(("1 healthy", "2 healthy")):
            break
        time.sleep(2)
    assert state.endswith("healthy"), state
    path, body = requests_to_check()[0]
    deadline = time.monotonic() + 60
    while True:  # the proxy's health poll puts D back in rotation within seconds
        try:
            assert answer(node["proxy"], path, body) == expected[0]
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_down_removes_every_container(engine, node):
    res = pdctl(engine, "down", "--config", str(node["config"]))
    assert res.returncode == 0, res.stderr
    left = engine.docker("ps", "-a", "-q", "--filter",
                         f"label=com.docker.compose.project={PROJECT}")
    assert left.stdout.strip() == ""
    # Images stay for the next run (the warm path).
    assert engine.docker("image", "inspect", "pd-appliance/vllm-cpu:0.1.0").returncode == 0


def test_up_says_which_server_cannot_start_and_why(engine, node, tmp_path):
    """A vLLM that exits at start (here: a max_model_len the model cannot take) is restarted
    by its policy and would look "starting" for ever: `pdctl up` stops at the first restart
    with the cause from the container's log, not at its timeout."""
    data = tomllib.loads(node["config"].read_text())
    data["model"]["max_model_len"] = 100000  # the tiny model takes 4,096
    data["compose"] = {"project": f"{PROJECT}-broken"}
    data["ports"] = {name: free_port() for name in data["ports"]}  # whatever else runs
    config = tmp_path / "host.toml"
    config.write_text(to_toml(parse_config(data)))
    begin = time.monotonic()
    up = pdctl(engine, "up", "--config", str(config), "--timeout", "600")
    took = time.monotonic() - begin
    try:
        print(f"\nbroken node: pdctl up failed after {took:.0f} s:\n{up.stderr}")
        assert up.returncode == 1, up.stdout[-2000:] + up.stderr
        first = up.stderr.splitlines()[0]
        assert first.startswith(("pdctl: error: prefill failed: ",
                                 "pdctl: error: decode failed: ")), up.stderr
        # caught while restarting (exit code 1) or just after its restart
        assert ("exit code 1" in first or "exited and was restarted" in first) and \
            "see `pdctl logs " in first, first
        assert "max_model_len" in up.stderr.split("\n", 1)[1], up.stderr
    finally:
        pdctl(engine, "down", "--config", str(config))


CLUSTER = """\
stack = "cpu"
[model]
path = "{model}"
served_name = "tiny"
max_model_len = 2048
[proxy]
host = "d"
[ports]
proxy = {proxy}
[[hosts]]
name = "p"
ip = "127.0.0.2"
cpus = 2
prefill = [[0]]
[[hosts]]
name = "d"
ip = "127.0.0.3"
cpus = 2
decode = [[1]]
"""


@pytest.fixture(scope="module")
def cluster_hosts(engine, expected, tiny_model, tmp_path_factory):
    """A two-host cluster on this one machine: `pdctl render --cluster`, then `pdctl up` on
    each host's config, as on two machines (loopback addresses of their own; each host's
    compose project renamed, since both run on one engine here)."""
    etc = tmp_path_factory.mktemp("cluster")
    port = free_port()
    (etc / "cluster.toml").write_text(CLUSTER.format(model=tiny_model, proxy=port))
    res = pdctl(engine, "render", "--cluster", str(etc / "cluster.toml"))
    assert res.returncode == 0, res.stderr
    configs = []
    for host in ("p", "d"):  # P's host first: D's host holds the proxy
        config = etc / "cluster" / host / "host.toml"
        config.write_text(config.read_text().replace(
            "[host]", f'[compose]\nproject = "{PROJECT}-{host}"\n\n[host]'))
        up = pdctl(engine, "up", "--config", str(config), "--timeout", "600")
        print(up.stdout)
        configs.append(config)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr
    try:
        yield {"configs": configs, "proxy": f"http://127.0.0.3:{port}"}
    finally:
        for config in configs:
            pdctl(engine, "down", "--config", str(config))


def test_a_cluster_brought_up_host_by_host(engine, cluster_hosts, expected):
    """P's host runs bootstrap-0 and prefill-0, D's host decode-0 and the proxy; greedy
    output through them equals a plain server's, and each host's status names its own."""
    p_conf, d_conf = cluster_hosts["configs"]
    # The default split is auto, timed at start through the whole split: P's KV crossed
    # from P's host to D's before any client asked.
    decode = "http://127.0.0.3:8020"
    assert calibrated(cluster_hosts["proxy"])["handoff"]["samples"] >= 1
    before = metric(decode, "vllm:pd_kv_received_total")
    assert before >= 4
    remote = remote_decisions(cluster_hosts["proxy"])
    got = [answer(cluster_hosts["proxy"], path, body) for path, body in requests_to_check()]
    assert got == expected
    # Each request the proxy then placed remote brought P's KV to D.
    received_for_each_remote(decode, before, remote_decisions(cluster_hosts["proxy"]) - remote)
    for config, members in ((p_conf, ["p/prefill-0", "p/bootstrap"]),
                            (d_conf, ["d/decode-0", "d/proxy"])):
        res = pdctl(engine, "status", "--config", str(config), "--json", timeout=60)
        st = json.loads(res.stdout)
        assert res.returncode == 0 and st["healthy"], st
        assert [m["name"] for m in st["members"]] == members
    res = pdctl(engine, "logs", "decode-0", "--config", str(d_conf), "--tail", "0", timeout=60)
    assert res.returncode == 0 and "kv_consumer" in res.stdout
