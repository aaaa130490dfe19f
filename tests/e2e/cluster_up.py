"""A cluster brought up from its description, on the fabric's hosts, as processes.

`pdctl render --cluster` writes each host's config; `pdctl render` there writes its compose
files; a real Compose v2 resolves them; each resolved service then runs as a process inside
its host's namespace with the command, environment and CPUs compose would give its
container (no images: the same code from this checkout). So what starts is exactly what
the rendered files say, the proxy's backends and D's allowed sidecars included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from appliance.pdctl.cli import cli
from appliance.process import ServiceFailed, ServiceProcess
from tests.conftest import ROOT
from tests.e2e.fabric import Host
from tests.faults.launch import fault_env, faulty_config
from tests.pdctl.test_render import compose

# Shorter than the production defaults so a dead node is found (and its calls fail over)
# within seconds in tests.
TIMEOUTS = {"kv_recv_s": 30, "kv_send_s": 30, "startup_s": 600}


@dataclass
class RunningCluster:
    hosts: dict[str, Host]
    services: dict[str, ServiceProcess] = field(default_factory=dict)  # "<host>/<service>"
    log_dir: Path = Path()
    description: Path = Path()  # the cluster description it was rendered from

    def driver(self, host: str, args: dict, timeout: float = 600) -> dict:
        """tests.e2e.cluster_driver inside `host` (the addresses exist only there)."""
        res = subprocess.run(self.hosts[host].run([sys.executable, "-m",
                                                   "tests.e2e.cluster_driver",
                                                   json.dumps(args)]),
                             capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        assert res.returncode == 0, res.stderr[-3000:] + self.tails()
        return json.loads(res.stdout.strip().splitlines()[-1])

    def pdctl(self, host: str, *args: str) -> subprocess.CompletedProcess:
        """pdctl inside `host`."""
        return subprocess.run(self.hosts[host].run([sys.executable, "-m", "appliance.pdctl",
                                                    *args]),
                              capture_output=True, text=True, timeout=120, cwd=str(ROOT))

    def start_driver(self, host: str, args: dict) -> subprocess.Popen:
        return subprocess.Popen(self.hosts[host].run([sys.executable, "-m",
                                                      "tests.e2e.cluster_driver",
                                                      json.dumps(args)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=str(ROOT))

    def check_running(self) -> None:
        for name, svc in self.services.items():
            if not svc.running:
                raise ServiceFailed(f"{name} exited; last lines:\n{svc.log_tail(40)}")

    def kill(self, name: str) -> None:
        """SIGKILL a service's whole process group (a host losing the process)."""
        proc = self.services[name].proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def log(self, name: str) -> str:
        return self.services[name].log_path.read_text(errors="replace")

    def tails(self, lines: int = 15) -> str:
        return "".join(f"\n--- {n} ---\n{s.log_tail(lines)}" for n, s in self.services.items())


def render(description: str, out: Path) -> Path:
    """`pdctl render --cluster`, then `pdctl render` of each host's config (with this
    machine's host checks: the CPUs and the model are here)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cluster.toml"
    path.write_text(description)
    cli_runner = CliRunner()
    res = cli_runner.invoke(cli, ["render", "--cluster", str(path)])
    assert res.exit_code == 0, res.output
    for host_dir in sorted(p for p in (out / "cluster").iterdir() if p.name != "keys"):
        res = cli_runner.invoke(cli, ["render", "--config", str(host_dir / "host.toml")])
        assert res.exit_code == 0, res.output
    return out / "cluster"


def _resolved(host_dir: Path) -> dict:
    res = compose(host_dir, "config", "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["services"]


def _argv(command: list[str]) -> list[str]:
    # The images' interpreters are this checkout's venv here.
    return [sys.executable if command[0] in ("python", "python3") else command[0], *command[1:]]


# Sidecars first, then P and D, the proxy last (compose's depends_on order).
_ORDER = {"bootstrap": 0, "prefill": 1, "decode": 1, "proxy": 2}


def _with_faults(command: list[str], env: dict[str, str],
                 plan: str) -> tuple[list[str], dict[str, str]]:
    """A vLLM service's command and environment, its connector tests.faults' with `plan`."""
    at = command.index("--kv-transfer-config") + 1
    return ([*command[:at], faulty_config(command[at]), *command[at + 1:]],
            {**env, **fault_env(plan)})


@contextmanager
def bring_up(rendered: Path, hosts: dict[str, Host], log_dir: Path,
             faults: dict[str, str] | None = None) -> Iterator[RunningCluster]:
    """Every host's services as processes; all stopped (by process group) afterwards.
    `faults["<host>/<service>"]`: that vLLM service injects faults by this plan
    (tests.faults)."""
    cluster = RunningCluster(hosts, log_dir=log_dir,
                             description=rendered.parent / "cluster.toml")  # as render() wrote
    plan = []
    for name in hosts:
        for svc_name, svc in _resolved(rendered / name).items():
            plan.append((_ORDER[svc_name.split("-")[0]], name, svc_name, svc))
    try:
        for _, name, svc_name, svc in sorted(plan, key=lambda p: p[0]):
            key = f"{name}/{svc_name}"
            cpus = [int(c) for c in svc["cpuset"].split(",")] if svc.get("cpuset") else None
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
            command = _argv(svc["command"])
            if key in (faults or {}):
                command, env = _with_faults(command, env, (faults or {})[key])
            proc = ServiceProcess(key, hosts[name].run(command),
                                  log_dir / f"{name}-{svc_name}.log", env=env, cpus=cpus,
                                  cwd=ROOT)
            proc.start()
            cluster.services[key] = proc
        yield cluster
    finally:
        for svc in reversed(list(cluster.services.values())):
            svc.stop()


def wait_ready(cluster: RunningCluster, proxy_host: str, proxy: str, backends: int,
               timeout: float = 600) -> float:
    """Until the proxy has every backend in rotation; seconds waited. A service that dies
    meanwhile fails at once with its log."""
    start = time.monotonic()
    while True:
        cluster.check_running()
        status = cluster.driver(proxy_host, {"op": "ready", "proxy": proxy,
                                             "backends": backends, "wait_s": 5})
        if status["ready"]:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise ServiceFailed(f"not all in rotation after {timeout:.0f} s: "
                                f"{status['status']}{cluster.tails()}")
