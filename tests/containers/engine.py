"""A private Docker Engine for the container tests, and the images built on it.

dockerd runs only with the host-safe flags (no bridge, no iptables, no forwarding or
masquerading) on its own socket, exec root and pidfile, and is stopped by its pid. Its data
root lives in a cache directory outside the checkout (PD_TEST_CACHE, default
~/.cache/pd-appliance-tests), so images and build layers survive between runs: a warm run
rebuilds only what changed. Nothing here is used by the appliance itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT

LOCAL_BASE = "pd-appliance/debian:bookworm"
SAFE_FLAGS = ("--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false")
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}


class EngineUnavailable(RuntimeError):
    """dockerd cannot run on this machine: the tests skip with this line."""


def cache_dir() -> Path:
    return Path(os.environ.get("PD_TEST_CACHE") or Path.home() / ".cache/pd-appliance-tests")


def ensure_packages(log: Path, packages: Mapping[str, str] = APT_PACKAGES) -> None:
    """docker.io and debootstrap (or `packages`: a tool or file -> the Debian package that
    has it) from apt when missing (root only)."""
    missing = sorted({pkg for tool, pkg in packages.items()
                      if not (Path(tool).exists() if Path(tool).is_absolute()
                              else shutil.which(tool))})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise EngineUnavailable(f"{', '.join(missing)} missing and cannot be installed here "
                                f"(needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # The packages' scripts must not start a dockerd (or containerd) with default settings,
    # which would rewrite the host's network: Debian's policy-rc.d says no to every start.
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\n# pd-appliance tests: no service starts while apt runs\n"
                          "exit 101\n")
        policy.chmod(0o755)
    try:
        with log.open("ab") as out:
            # dpkg's lock may be held by another apt meanwhile (.ci/run's background
            # build): wait for it rather than fail.
            wait = ["-o", "DPkg::Lock::Timeout=600"]
            for argv in (["apt-get", *wait, "update", "-qq"],
                         ["apt-get", *wait, "install", "-y", "-qq", "--no-install-recommends",
                          *missing]):
                if subprocess.run(argv, stdout=out, stderr=out, env=env,
                                  timeout=900).returncode:
                    raise EngineUnavailable(f"`{' '.join(argv)}` failed (see {log})")
    finally:
        if ours:
            policy.unlink(missing_ok=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line names `text` (our own dirs: a containerd or shim of ours)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and text in _cmdline(int(entry.name)):
            out.append(int(entry.name))
    return sorted(out)


def mounts_under(*dirs: Path) -> list[str]:
    prefixes = [str(d) for d in dirs]
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if any(target == p or target.startswith(p + "/") for p in prefixes):
            found.append(target)
    return found


@dataclass
class DockerEngine:
    data_root: Path
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdd-")))
    pid: int | None = None

    @property
    def exec_root(self) -> Path:
        return self.run_dir / "exec"

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def pidfile(self) -> Path:
        # Beside the data root: a dockerd left by a killed run is found (and stopped by its
        # pid) before a new one needs the same data root.
        return self.data_root.parent / "dockerd.pid"

    @property
    def log(self) -> Path:
        return self.data_root.parent / "dockerd.log"

    @property
    def env(self) -> dict[str, str]:
        # Only the engine's address: no Compose plugin is linked in, so pdctl finds Compose
        # as on a stock Debian host (the engine as docker.io installs it has none).
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def _stop_leftover(self) -> None:
        try:
            old = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        if _alive(old) and str(self.data_root) in _cmdline(old):
            self._terminate(old)
        self.pidfile.unlink(missing_ok=True)

    def start(self, timeout: float = 60.0) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._stop_leftover()
        argv = ["dockerd", *SAFE_FLAGS, "--data-root", str(self.data_root),
                "--exec-root", str(self.exec_root), "--pidfile", str(self.pidfile),
                "--host", f"unix://{self.socket}"]
        with self.log.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.pid = proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                raise EngineUnavailable(f"dockerd exited at start ({proc.returncode}): "
                                        f"{tail[0] if tail else 'no log'}")
            if self.socket.exists() and self.docker("version").returncode == 0:
                return
            time.sleep(0.5)
        self.stop()
        raise EngineUnavailable(f"dockerd did not answer within {timeout:.0f} s (log {self.log})")

    def docker(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout)

    def _terminate(self, pid: int, grace: float = 30.0) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            try:  # our child: reap it, or it stays a zombie that looks alive
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)

    def stop(self) -> list[str]:
        """Stop dockerd by its pid; returns what it left behind (processes, mounts), after
        clearing it, so a test can fail on it."""
        left: list[str] = []
        if self.pid is not None:
            self._terminate(self.pid)
            self.pid = None
        for pid in processes_mentioning(str(self.run_dir)):
            left.append(f"process {pid}: {_cmdline(pid)[:120]}")
            os.kill(pid, signal.SIGKILL)
        # dockerd keeps the host's own namespace bound at <exec root>/netns/default (for
        # host-network containers) and leaves that mount at exit: expected, cleared here.
        own = str(self.exec_root / "netns" / "default")
        for target in reversed(mounts_under(self.run_dir, self.data_root)):
            if target != own:
                left.append(f"mount {target}")
            subprocess.run(["umount", "-l", target], capture_output=True)
        netns = self.exec_root / "netns"
        if netns.is_dir():
            extra = sorted(p.name for p in netns.iterdir() if p.name != "default")
            if extra:
                left.append(f"network namespaces in {netns}: {extra}")
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return left


def torch_wheel(log: Path) -> None:
    """Put the CPU torch wheel the CPU image needs into images/wheels/ (the build context),
    fetched by this venv's pip as the host's pip configuration finds it."""
    wheels = ROOT / "images" / "wheels"
    pins = (ROOT / "config" / "constraints-cpu.txt").read_text().splitlines()
    torch = next(line.strip() for line in pins if line.startswith("torch=="))
    version = torch.split("==", 1)[1]
    if list(wheels.glob(f"torch-{version}-*.whl")):
        return
    with log.open("ab") as out:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "--disable-pip-version-check", "-d", str(wheels), torch],
                             stdout=out, stderr=out, timeout=900)
    if res.returncode:
        raise RuntimeError(f"pip download {torch} failed (see {log})")


Step = tuple[str, Callable[[], None] | list[str], float]


def _run_steps(steps: list[Step], env: dict[str, str], log: Path) -> dict[str, float]:
    """Each step (a command, or a function) in turn, its output to `log`; seconds per step.
    A failing command raises with the log's last lines."""
    times = {}
    for name, step, limit in steps:
        begin = time.monotonic()
        if callable(step):
            step()
        else:
            with log.open("ab") as out:
                res = subprocess.run(step, stdout=out, stderr=out, env=env, timeout=limit,
                                     cwd=ROOT)
            if res.returncode:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{' '.join(step)} failed: {' | '.join(tail)}")
        times[name] = time.monotonic() - begin
    return times


def build_images(engine: DockerEngine, log: Path) -> dict[str, float]:
    """The local Debian base and every CPU-stack image; seconds per step."""
    env = {**engine.env, "DOCKER_BUILD_FLAGS": "--network host",
           "CPU_BASE_IMAGE": LOCAL_BASE, "SLIM_BASE_IMAGE": LOCAL_BASE}
    return _run_steps([("base", [str(ROOT / "images/local-base.sh"), LOCAL_BASE], 1800),
                       ("wheel", lambda: torch_wheel(log), 0),
                       ("images", [str(ROOT / "images/build.sh"), "--stack", "cpu"], 1800)],
                      env, log)


GPU_TAG = "0.1.0"


def build_gpu_images(engine: DockerEngine, log: Path, timeout: float = 3600) -> dict[str, float]:
    """The local Debian base and every GPU-stack image, as a host without NVIDIA's registry
    builds them (the CUDA libraries from the torch and nvidia-* wheels); seconds per step.
    The vLLM image's build proves what its start needs (pd-gpu-stack-check)."""
    # --force-rm: a failed step's container (holding a 9 GB layer) goes too.
    env = {**engine.env, "DOCKER_BUILD_FLAGS": "--network host --force-rm",
           "CUDA_BASE_IMAGE": LOCAL_BASE, "SLIM_BASE_IMAGE": LOCAL_BASE}
    return _run_steps([("base", [str(ROOT / "images/local-base.sh"), LOCAL_BASE], 900),
                       ("images", [str(ROOT / "images/build.sh"), "--stack", "gpu", GPU_TAG],
                        timeout)], env, log)
