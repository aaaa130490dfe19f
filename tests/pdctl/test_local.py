"""`pdctl up/down/status/logs --local` without starting vLLM: flag checks, and `down --local`
stopping exactly the processes a state file names (by their run id), nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from appliance.pdctl.node.localstate import RUN_ID_ENV, STATE_FILE, marked_processes
from tests.conftest import free_port
from tests.pdctl.conftest import error_lines

SLEEPER = ("import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
           "time.sleep(120)")


def ports_args() -> list[str]:
    return ["--port", str(free_port()), "--prefill-port", str(free_port()),
            "--decode-port", str(free_port()), "--bootstrap-port", str(free_port())]


def test_port_clash_is_a_usage_error(pdctl, tmp_path):
    res = pdctl("up", "--local", "--run-dir", str(tmp_path), "--port", "9100",
                "--decode-port", "9100")
    assert res.exit_code == 2
    assert error_lines(res) == ["pdctl: error: the decode port 9100 is also the proxy port"]


def test_port_in_use_fails_before_starting_anything(pdctl, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ports_args()
        args[args.index("--decode-port") + 1] = str(port)
        res = pdctl("up", "--local", "--run-dir", str(tmp_path), *args)
    assert res.exit_code == 1
    assert error_lines(res)[0] == f"pdctl: error: port {port} (decode) on 127.0.0.1 is in use"
    assert not (tmp_path / STATE_FILE).exists() and not (tmp_path / "logs").exists()


def test_bad_model_dir(pdctl, tmp_path):
    res = pdctl("up", "--local", "--run-dir", str(tmp_path), "--model", str(tmp_path),
                *ports_args())
    assert res.exit_code == 2 and "not a model directory (no config.json)" in res.stderr


def test_down_without_a_node(pdctl, tmp_path):
    res = pdctl("down", "--local", "--run-dir", str(tmp_path))
    assert res.exit_code == 0 and "no local node is running" in res.stdout


def test_status_without_a_node(pdctl, tmp_path):
    res = pdctl("status", "--local", "--run-dir", str(tmp_path))
    assert res.exit_code == 1
    assert error_lines(res) == [f"pdctl: error: no local node is running (no state in "
                                f"{tmp_path})"]


@pytest.fixture
def fake_run(tmp_path):
    """A state file naming two process groups (each a leader with a child) of one run."""
    run_id = uuid.uuid4().hex
    env = {**os.environ, RUN_ID_ENV: run_id}
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER], env=env,
                              start_new_session=True) for _ in range(2)]
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                start_new_session=True)
    (tmp_path / "logs").mkdir()
    services = []
    for name, proc in zip(("bootstrap", "prefill"), procs, strict=True):
        log = tmp_path / "logs" / f"{name}.log"
        log.write_text(f"{name} started\n{name} ready\n")
        services.append({"name": name, "pid": proc.pid, "url": "http://127.0.0.1:9/health",
                         "log": str(log)})
    state = {"run_id": run_id, "supervisor_pid": None, "started_at": time.time(),
             "model": "/m", "endpoints": {"bootstrap": "http://127.0.0.1:9",
                                          "prefill": "http://127.0.0.1:9",
                                          "decode": "http://127.0.0.1:9",
                                          "proxy": "http://127.0.0.1:9"},
             "services": services}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    deadline = time.monotonic() + 10
    while len(marked_processes(run_id)) < 4:  # both leaders and both children
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield run_id, procs
    for p in [*procs, outsider]:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert outsider.returncode == -9, "down --local touched a process it does not own"


def test_up_refuses_while_a_node_runs(pdctl, tmp_path, fake_run):
    res = pdctl("up", "--local", "--run-dir", str(tmp_path), *ports_args())
    assert res.exit_code == 1
    assert "a local node is already running" in res.stderr


def test_status_of_a_local_node_without_answers(pdctl, tmp_path, fake_run):
    res = pdctl("status", "--run-dir", str(tmp_path), "--json",
                env={"PDCTL_CONFIG": str(tmp_path / "none.toml")})
    assert res.exit_code == 1
    body = json.loads(res.stdout)
    assert body["mode"] == "local"
    states = {s["name"]: s for s in body["services"]}
    assert states["bootstrap"]["state"].startswith("running (pid ")
    assert states["bootstrap"]["running"] and not states["bootstrap"]["healthy"]
    assert states["decode"]["state"] == "unknown"


def test_logs_local(pdctl, tmp_path, fake_run):
    res = pdctl("logs", "prefill", "--local", "--run-dir", str(tmp_path), "--tail", "1")
    assert res.exit_code == 0 and res.stdout == "prefill ready\n"
    res = pdctl("logs", "decode", "--local", "--run-dir", str(tmp_path))
    assert res.exit_code == 1 and "no log for decode" in res.stderr


def test_down_local_stops_every_process_of_the_run_and_nothing_else(pdctl, tmp_path,
                                                                    fake_run):
    run_id, procs = fake_run
    res = pdctl("down", "--local", "--run-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "stopped bootstrap, prefill" in res.stdout
    assert marked_processes(run_id) == {}
    for p in procs:
        p.wait(10)
    assert not (tmp_path / STATE_FILE).exists()
    assert Path(tmp_path / "logs" / "prefill.log").exists()  # logs stay for a post-mortem
