"""`pdctl status`, `up`, `down` and `logs` (compose mode) against live stand-ins: the real
bootstrap and proxy, fake vLLM servers, a fake Docker Engine API; and the one line when
there is no Docker daemon."""

from __future__ import annotations

import json

import pytest

from appliance.pdctl.node.status import SERVICES
from tests.pdctl.servers import FakeContainer, FakeDocker, Node, Servers


@pytest.fixture
def servers():
    s = Servers()
    yield s
    s.close()


@pytest.fixture
def node(servers) -> Node:
    return Node.start(servers)


@pytest.fixture
def docker(servers, tmp_path) -> tuple[FakeDocker, str]:
    fake = FakeDocker([FakeContainer(name, log=f"{name} line 1\n{name} line 2\n")
                       for name in SERVICES])
    return fake, servers.unix(fake.app(), tmp_path / "docker.sock")


@pytest.fixture
def status(pdctl, write_config, node, docker):
    def run(*extra: str, docker_host: str | None = None) -> tuple[int, dict, str]:
        path = write_config(node.config_toml())
        res = pdctl("status", "--config", str(path), "--json", *extra,
                    env={"DOCKER_HOST": docker_host or docker[1]})
        assert "Traceback" not in res.output, res.output
        return res.exit_code, json.loads(res.stdout), res.stderr
    return run


def test_healthy_node(status, node):
    code, body, _ = status()
    assert code == 0 and body["healthy"] is True, body
    by_name = {s["name"]: s for s in body["services"]}
    assert list(by_name) == list(SERVICES)
    for s in by_name.values():
        assert s["running"] and s["healthy"] and s["state"] == "running (healthy)", s
        assert s["restarts"] == 0
    assert body["engine_ids"] == ["node1-prefill"]
    assert by_name["bootstrap"]["detail"] == "engines: node1-prefill"
    assert [(b["role"], b["in_rotation"]) for b in body["backends"]] == \
        [("prefill", True), ("decode", True)]
    assert body["backends"][0]["engine_ids"] == {"0": "node1-prefill"}
    assert body["in_flight"] == 0
    counters = body["counters"]
    assert counters["prefill.transfers"] == 41 and counters["prefill.transfer_failures"] == 2
    assert counters["decode.received"] == 40 and counters["decode.receive_failures"] == 1
    assert counters["requests_ok"] == 0 and counters["fallbacks"] == 0
    assert "running 1, waiting 0" in by_name["prefill"]["detail"]
    # The proxy's placement (appliance.proxy.placement), its default policy.
    assert body["split"] == {"policy": "auto",
                             "last_minute": {"remote": 0, "local": 0, "p_alone": 0}}
    assert by_name["proxy"]["detail"].endswith(
        "split auto, last minute: 0 remote (P then D), 0 local (D alone), 0 p_alone (P alone)")


def test_table_output(pdctl, write_config, node, docker):
    res = pdctl("status", "--config", str(write_config(node.config_toml())),
                env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 0, res.output
    for text in ("bootstrap", "prefill", "decode", "proxy", "node1-prefill", "transfers 41",
                 "proxy backends", "healthy"):
        assert text in res.stdout, text


def transport_info(role: str, installed: str) -> str:
    """The connector's transport series (appliance/connector/stats.py) as vLLM exports it."""
    rows = "".join(f'vllm:pd_kv_transport_info{{engine="0",model_name="qwen",role="{role}",'
                   f'transport="{t}"}} {1.0 if t == installed else 0.0}\n'
                   for t in ("tcp", "rdma"))
    return "# TYPE vllm:pd_kv_transport_info gauge\n" + rows


def test_prefill_and_decode_show_their_transport(status, node):
    node.prefill.extra_metrics = transport_info("producer", "rdma")
    node.decode.extra_metrics = transport_info("consumer", "tcp")
    _, body, _ = status()
    by_name = {s["name"]: s for s in body["services"]}
    assert by_name["prefill"]["detail"] == "running 1, waiting 0, transport rdma, transfers 41, " \
        "transfer_failures 2"
    assert "transport tcp, received 40" in by_name["decode"]["detail"]


def test_unhealthy_decode(status, node, docker):
    node.decode.healthy = False
    docker[0].containers[2].health = "unhealthy"
    docker[0].containers[2].restarts = 3
    node.wait_proxy(503)
    code, body, _ = status()
    assert code == 1 and body["healthy"] is False
    decode = next(s for s in body["services"] if s["name"] == "decode")
    assert decode["state"] == "running (unhealthy)" and decode["restarts"] == 3
    assert decode["health"] == "unhealthy: HTTP 503"
    proxy = next(s for s in body["services"] if s["name"] == "proxy")
    assert proxy["health"] == "unhealthy: no decode node is healthy"


def test_container_missing_or_exited(status, docker):
    fake = docker[0]
    fake.containers = [c for c in fake.containers if c.service != "bootstrap"]
    fake.containers[0].state, fake.containers[0].health = "exited", None
    code, body, _ = status()
    assert code == 1
    states = {s["name"]: (s["state"], s["running"]) for s in body["services"]}
    assert states["bootstrap"] == ("missing", False)
    assert states["prefill"] == ("exited", False)


def test_no_docker_daemon_is_one_line(status, tmp_path):
    code, body, stderr = status(docker_host=f"unix://{tmp_path / 'no-such.sock'}")
    assert code == 1 and body["healthy"] is False
    assert body["problems"] == [f"docker: cannot reach the Docker daemon at unix://"
                                f"{tmp_path / 'no-such.sock'} (no such socket: is dockerd "
                                f"running?)"]
    # the HTTP side is still reported
    assert all(s["healthy"] for s in body["services"])


def test_unregistered_prefill_engine(pdctl, write_config, servers, docker):
    node = Node.start(servers, engine_id="someone-else")
    path = write_config(node.config_toml())
    res = pdctl("status", "--config", str(path), "--json", env={"DOCKER_HOST": docker[1]})
    body = json.loads(res.stdout)
    assert res.exit_code == 1
    assert body["problems"] == ["bootstrap: prefill engine node1-prefill is not registered"]


def test_logs_through_the_docker_api(pdctl, write_config, node, docker):
    path = write_config(node.config_toml())
    res = pdctl("logs", "prefill", "--config", str(path), env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 0, res.output
    assert res.stdout == "prefill line 1\nprefill line 2\n"
    res = pdctl("logs", "--config", str(path), "--tail", "1", env={"DOCKER_HOST": docker[1]})
    assert "==> proxy <==" in res.stdout and "decode line 1" in res.stdout


def test_logs_without_daemon(pdctl, write_config, node, tmp_path):
    res = pdctl("logs", "proxy", "--config", str(write_config(node.config_toml())),
                env={"DOCKER_HOST": f"unix://{tmp_path / 'none.sock'}"})
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        f"pdctl: error: cannot reach the Docker daemon at unix://{tmp_path / 'none.sock'} "
        f"(no such socket: is dockerd running?)"]


def test_up_runs_compose_and_waits_for_health(pdctl, write_config, node, docker, runner):
    path = write_config(node.config_toml())
    res = pdctl("up", "--config", str(path), env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 0, res.output
    compose = [c for c in runner.calls if c[:3] == ["docker", "compose", "--project-directory"]]
    assert compose == [["docker", "compose", "--project-directory", str(path.parent),
                        "--project-name", "pd-appliance", "up", "--detach",
                        "--remove-orphans"]]
    assert (path.parent / ".env").exists()
    assert "node healthy" in res.stdout
    res = pdctl("down", "--config", str(path))
    assert res.exit_code == 0
    assert runner.calls[-1][-1] == "down"


def test_up_stops_at_an_unhealthy_container(pdctl, write_config, node, docker):
    docker[0].containers[1].health = "unhealthy"
    res = pdctl("up", "--config", str(write_config(node.config_toml())),
                env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 1
    assert "pdctl: error: prefill failed: unhealthy; see `pdctl logs prefill`" in res.stderr
    assert "  prefill: prefill line 2" in res.stderr  # no error line: the log's last lines


ENGINE_DIED = """\
(APIServer pid=1) INFO 12-02 06:28:19 [api_server.py:1] vLLM API server version 0.32.0
(APIServer pid=1) WARNING 12-02 06:28:19 [system_utils.py:255] Found ulimit of 20000 and \
failed to automatically increase with error current limit exceeds maximum limit.
(Worker pid=40) ERROR 12-02 06:29:03 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=40) ERROR 12-02 06:29:03 [multiproc_executor.py:1063]   File "/x.py", line 1, in f
(Worker pid=40) ERROR 12-02 06:29:03 [multiproc_executor.py:1063] torch._inductor.exc.\
InductorError: InvalidCxxCompiler: No working C++ compiler found in \
torch._inductor.config.cpp.cxx: (None, 'g++')
(EngineCore pid=30) ERROR 12-02 06:29:03 [core.py:1510] RuntimeError: Worker failed with \
error 'InvalidCxxCompiler', please check the stack trace above for the root cause
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_up_says_at_once_that_a_server_died_and_why(pdctl, write_config, node, docker):
    """A vLLM whose engine died at start exits; its restart policy starts it again and the
    health check says "starting" for ever: up fails at the first restart, with the cause."""
    prefill = docker[0].containers[1]
    prefill.state, prefill.health, prefill.restarts, prefill.exit_code = \
        "restarting", "starting", 1, 1
    prefill.log = ENGINE_DIED
    res = pdctl("up", "--config", str(write_config(node.config_toml())),
                env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 1
    assert res.stderr.splitlines()[:2] == [
        "pdctl: error: prefill failed: restarting (exit code 1, restarted 1 time); see "
        "`pdctl logs prefill`",
        "  prefill: torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ "
        "compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')"]
    assert "ulimit" not in res.stderr  # a warning is never the cause


def test_status_shows_why_a_container_is_down(pdctl, write_config, node, docker):
    prefill = docker[0].containers[1]
    prefill.state, prefill.health, prefill.restarts, prefill.exit_code = \
        "restarting", "starting", 3, 1
    prefill.log = ENGINE_DIED
    path = write_config(node.config_toml())
    res = pdctl("status", "--config", str(path), "--json", env={"DOCKER_HOST": docker[1]})
    got = {s["name"]: s for s in json.loads(res.stdout)["services"]}
    assert res.exit_code == 1
    assert got["prefill"]["cause"] == [
        "torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ compiler found "
        "in torch._inductor.config.cpp.cxx: (None, 'g++')"]
    assert got["decode"]["cause"] == []
    res = pdctl("status", "--config", str(path), env={"DOCKER_HOST": docker[1]})
    assert "prefill: torch._inductor.exc.InductorError: InvalidCxxCompiler" in res.stdout


def test_up_refuses_when_doctor_fails(pdctl, write_config, node, host, runner):
    host.no_peermem()
    res = pdctl("up", "--config", str(write_config(node.config_toml())))
    assert res.exit_code == 1
    assert "pdctl: error: doctor: GPUDirect RDMA: nvidia_peermem is not loaded" in res.stderr
    assert not [c for c in runner.calls if c[:3] == ["docker", "compose", "--project-directory"]]


def test_up_reports_a_compose_failure(pdctl, write_config, node, runner):
    runner.answer(["docker", "compose", "--project-directory"], "", 1,
                  "Error response from daemon: could not select device driver \"nvidia\"\n")
    res = pdctl("up", "--config", str(write_config(node.config_toml())))
    assert res.exit_code == 1
    assert res.stderr.startswith("pdctl: error: docker compose up failed: Error response from "
                                 "daemon: could not select device driver")


def test_up_names_the_dead_server_not_composes_dependency_error(pdctl, write_config, node,
                                                                docker, runner):
    """compose up fails too when a dependency exits; the container's own cause wins."""
    runner.answer(["docker", "compose", "--project-directory"], "", 1,
                  "dependency failed to start: container pd-prefill-1 exited (1)\n")
    prefill = docker[0].containers[1]
    prefill.state, prefill.health, prefill.restarts, prefill.exit_code = "exited", None, 0, 1
    prefill.log = ENGINE_DIED
    res = pdctl("up", "--config", str(write_config(node.config_toml())),
                env={"DOCKER_HOST": docker[1]})
    assert res.exit_code == 1
    assert res.stderr.splitlines()[:2] == [
        "pdctl: error: prefill failed: exited (exit code 1); see `pdctl logs prefill`",
        "  prefill: torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ "
        "compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')"]
