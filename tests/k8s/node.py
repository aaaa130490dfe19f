"""A real Kubernetes node for the chart tests: kubelet and kube-proxy (v1.20.2, built by
build-control-plane.sh) on Debian's containerd, runc and CNI plugins, joined to a
controlplane.py control plane.

Nothing may touch the host, so the node lives in namespaces of its own:
- a network namespace with a veth pair (both ends inside, no default route): the node's IP,
  the pod bridge, kube-proxy's and kubelet's iptables rules and every sysctl under
  /proc/sys/net stay in it. The API server (on the host's loopback) is reached through a
  socat bridge over a UNIX socket, at the node's IP inside, which is also the address the
  API server advertises: pods find it through the `kubernetes` Service and kube-proxy.
- a private mount namespace (a holder process; every daemon joins it with nsenter): tmpfs
  over /var/lib and /run/containerd, the pod logs in the work folder, containerd's root in
  the test cache (images loaded once are reused by later runs), and stand-in files
  bind-mounted over the global /proc/sys files kubelet writes.
- cgroups under a cgroupRoot of its own (cgroupfs driver), removed afterwards.
kube-proxy leaves conntrack alone (its conntrack flags 0); containerd restricts
oom_score_adj (where the capability bounding set lacks CAP_SYS_RESOURCE, runc cannot set
the pause container's otherwise). Everything is
stopped by process group, cgroup or mount namespace, never by name; `stop` lists whatever
was left so a test can fail on it, and a node a killed run left is cleared first (its
pids, namespace and cgroup are recorded beside containerd's root). Nothing here is used
by the appliance itself."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port
from tests.containers.engine import DockerEngine, cache_dir, ensure_packages, mounts_under
from tests.k8s import nodeconfig, nodehost
from tests.k8s.controlplane import SERVICE_CIDR, ControlPlane, binaries, until
from tests.k8s.nodehost import Traces

NODE_NAME = "pd-node"
NODE_IP, PEER_IP = "10.201.0.1", "10.201.0.2"  # the veth pair, both ends in the namespace
POD_CIDR = "10.202.0.0/24"
PAUSE_IMAGE = "localhost/pd-pause:3.4.1"
APT = {"containerd": "containerd", "runc": "runc", "socat": "socat",
       "iptables": "iptables", "/usr/lib/cni/bridge": "containernetworking-plugins"}


class NodeUnavailable(RuntimeError):
    """A node cannot run here: the tests skip with this line."""


@dataclass
class Node:
    work: Path  # pod logs, configs, daemon logs
    run: Path  # short: UNIX sockets
    store: Path  # containerd's root (cached)
    traces: Traces
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    holder: subprocess.Popen | None = None
    forwards: dict[tuple[str, int], int] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)  # what stop() found left behind

    @property
    def socket(self) -> Path:
        return self.run / "containerd.sock"

    def inside(self) -> list[str]:
        """argv prefix: run in the node's network and mount namespaces."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--"]

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        log.close()
        if name == "containerd":
            self.traces.containerd = self.procs[name].pid
        else:
            self.traces.pids.insert(0, self.procs[name].pid)
        self.traces.save(_traces_file(self.store))

    def alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")

    def ctr(self, *args: str, stdin: int | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "-a", str(self.socket), "-n", "k8s.io", *args],
                              stdin=stdin, capture_output=True, text=True, timeout=timeout)

    def image_id(self, ref: str) -> str | None:
        """The config digest (docker's image ID) of the image `ref` names here."""
        rows = self.ctr("images", "ls", f"name=={ref}").stdout.splitlines()[1:]
        if not rows:
            return None
        manifest = self.ctr("content", "get", rows[0].split()[2]).stdout
        return json.loads(manifest)["config"]["digest"] if manifest else None

    def load_image(self, engine: DockerEngine, image: str) -> bool:
        """`docker save | ctr import`, unless the same image is here from an earlier run;
        True when it was loaded. kubelet finds it as docker.io/<image> (IfNotPresent or
        Never: there is no registry)."""
        want = engine.docker("image", "inspect", "-f", "{{.Id}}", image).stdout.strip()
        if want and self.image_id(f"docker.io/{image}") == want:
            return False
        why = self._import(engine, image)
        if why:
            # A run killed mid-import can leave the cached store inconsistent ("parent
            # snapshot ... does not exist"): drop our images, let containerd collect what
            # they held, and import once more.
            for ref in self.ctr("images", "ls", "-q").stdout.split():
                if ref != PAUSE_IMAGE:
                    self.ctr("images", "rm", "--sync", ref)
            why = self._import(engine, image)
        if why:
            _broken_file(self.store).touch()  # the next node starts from an empty store
            raise RuntimeError(f"loading {image}: {why}")
        return True

    def _import(self, engine: DockerEngine, image: str) -> str:
        """`docker save | ctr images import`; what went wrong, or "" ."""
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE,
                                env=engine.env)
        assert save.stdout is not None
        res = self.ctr("images", "import", "-", stdin=save.stdout.fileno(), timeout=1200)
        save.stdout.close()
        if save.wait(60) != 0 or res.returncode != 0:
            return res.stderr.strip()[-500:] or f"docker save exited {save.returncode}"
        return ""

    def keep_only(self, refs: list[str]) -> None:
        """Drop every other image (and its ID reference), so the cache does not grow."""
        ids = {self.image_id(ref) for ref in refs}
        for ref in self.ctr("images", "ls", "-q").stdout.split():
            if ref not in refs and ref not in ids:
                self.ctr("images", "rm", ref)

    def forward(self, host: str, port: int) -> int:
        """A port on the host's 127.0.0.1 that reaches host:port as seen inside the node (a
        ClusterIP through kube-proxy, a pod IP): a socat pair over a UNIX socket."""
        if (host, port) in self.forwards:
            return self.forwards[host, port]
        local, sock = free_port(), self.run / f"fwd-{host}-{port}.sock"
        self.start(f"fwd-in-{host}-{port}", [
            "nsenter", f"--net=/run/netns/{self.traces.netns}", "socat",
            f"UNIX-LISTEN:{sock},fork,unlink-early", f"TCP:{host}:{port}"])
        self.start(f"fwd-out-{host}-{port}", [
            "socat", f"TCP-LISTEN:{local},bind=127.0.0.1,fork,reuseaddr",
            f"UNIX-CONNECT:{sock}"])
        until(f"the bridge to {host}:{port}", sock.exists, 10)
        self.forwards[host, port] = local
        return local

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        """A container's log as kubelet wrote it (the API server never dials the node)."""
        out = []
        for path in sorted((self.work / "log/pods").glob(f"{namespace}_{pod}_*/{container}/*")):
            out.append(path.read_text(errors="replace"))
        return "".join(out)


def _broken_file(store: Path) -> Path:
    return store.parent / f"{store.name}.broken"


def _traces_file(store: Path) -> Path:
    return store.parent / f"{store.name}.node.json"


def _run(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if res.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


def _network(netns: str) -> None:
    _run("ip", "netns", "add", netns)
    _run("ip", "-n", netns, "link", "add", "pd0", "type", "veth", "peer", "name", "pd1")
    for dev, addr in (("pd0", NODE_IP), ("pd1", PEER_IP)):
        _run("ip", "-n", netns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", netns, "link", "set", dev, "up")
    _run("ip", "-n", netns, "link", "set", "lo", "up")
    # Service IPs need a route for kube-proxy's DNAT to see them; it ends inside.
    _run("ip", "-n", netns, "route", "add", SERVICE_CIDR, "dev", "pd0", "src", NODE_IP)


def _mount_namespace(node: Node) -> None:
    """The holder: a process in the node's network namespace and a private mount namespace
    set up as the node needs it."""
    sysctl = node.work / "sysctl"
    for d in ("log", "sysctl"):
        (node.work / d).mkdir(exist_ok=True)
    lines = ["set -e",
             "mount -t tmpfs -o mode=755 pd-node /var/lib",
             "mkdir -p /var/lib/containerd /var/lib/kubelet",
             f"mount --bind {node.store} /var/lib/containerd",
             "mkdir -p /run/containerd", "mount -t tmpfs -o mode=711 pd-node /run/containerd",
             f"mount --bind {node.work / 'log'} /var/log"]
    for name in nodehost.SYSCTLS:
        stand_in = sysctl / name.replace("/", ".")
        stand_in.write_text(Path("/proc/sys", name).read_text())
        lines.append(f"mount --bind {stand_in} /proc/sys/{name}")
    lines += [f"touch {node.run / 'holder.ready'}", "exec sleep infinity"]
    log = open(node.work / "holder.log", "ab")  # noqa: SIM115 - handed to the child
    holder = node.holder = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{node.traces.netns}", "unshare", "--mount",
         "--propagation", "private", "sh", "-c", "\n".join(lines)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    node.traces.holder = holder.pid
    node.traces.save(_traces_file(node.store))
    until("the node's mount namespace",
           lambda: (node.run / "holder.ready").exists() or holder.poll() is not None, 10)
    if holder.poll() is not None:
        raise RuntimeError("setting up the mount namespace failed: "
                           + (node.work / "holder.log").read_text(errors="replace")[-800:])


def _forget_containers(socket: Path) -> None:
    """containerd keeps no container of a node that is gone (its root is reused)."""
    def ctr(*args: str) -> list[str]:
        res = subprocess.run(["ctr", "-a", str(socket), "-n", "k8s.io", *args],
                             capture_output=True, text=True, timeout=60)
        return res.stdout.split()

    for task in ctr("tasks", "ls", "-q"):
        ctr("tasks", "delete", "--force", task)
    ids = ctr("containers", "ls", "-q")
    if ids:
        ctr("containers", "rm", *ids)


def _clear(traces: Traces) -> list[str]:
    """Stop what `traces` names: kubelet, kube-proxy and the bridges, the containers (by
    their cgroup), containerd, the shims (by the holder's mount namespace), the holder;
    then remove its network namespace, cgroups and sockets. Returns what could not be."""
    left: list[str] = []
    try:
        mnt = os.readlink(f"/proc/{traces.holder}/ns/mnt") if traces.ours(traces.holder) \
            else None
    except OSError:
        mnt = None
    for pid in traces.pids:
        if traces.ours(pid):
            nodehost.kill_group(pid)
    for pid in nodehost.cgroup_pids(traces.cgroup_root):  # the containers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if traces.containerd is not None and traces.ours(traces.containerd):
        _forget_containers(Path(traces.run) / "containerd.sock")
        nodehost.kill_group(traces.containerd)
    if mnt is not None and traces.holder is not None:
        for pid in nodehost.in_mount_ns(mnt):  # the shims
            if pid != traces.holder:
                os.kill(pid, signal.SIGKILL)
        nodehost.kill_group(traces.holder)
        deadline = time.monotonic() + 10
        while nodehost.in_mount_ns(mnt) and time.monotonic() < deadline:
            time.sleep(0.2)
        if nodehost.in_mount_ns(mnt):
            left.append(f"processes in the node's mount namespace: {nodehost.in_mount_ns(mnt)}")
    subprocess.run(["ip", "netns", "del", traces.netns], capture_output=True)
    if (Path("/run/netns") / traces.netns).exists():
        left.append(f"network namespace {traces.netns}")
    left += nodehost.remove_cgroups(traces.cgroup_root)
    left += [f"mount {m}" for m in mounts_under(Path(traces.run))]
    shutil.rmtree(traces.run, ignore_errors=True)
    return left


def stop(node: Node) -> list[str]:
    """Stop everything the node started; returns what was left behind, after clearing it."""
    left = _clear(node.traces)
    for proc in [*node.procs.values(), *([node.holder] if node.holder else [])]:
        try:
            proc.wait(5)  # reaped
        except subprocess.TimeoutExpired:
            left.append(f"process {proc.pid}: {proc.args}")
    left += [f"mount {m}" for m in mounts_under(node.work, node.store)]
    _traces_file(node.store).unlink(missing_ok=True)
    return left


@contextmanager
def real_node(cp: ControlPlane, work: Path, timeout: float = 120) -> Iterator[Node]:
    """A node Ready in `cp` (started with advertise=NODE_IP and real_nodes=True). Raises
    NodeUnavailable where packages or namespaces cannot be had."""
    if os.geteuid() != 0:
        raise NodeUnavailable("a node needs root")
    work.mkdir(parents=True, exist_ok=True)
    try:
        ensure_packages(work / "apt.log", APT)
    except RuntimeError as exc:
        raise NodeUnavailable(str(exc)) from None
    bins = binaries()
    store = cache_dir() / "node-containerd"
    store.mkdir(parents=True, exist_ok=True)
    if _traces_file(store).exists():  # a killed run's node
        _clear(Traces(**json.loads(_traces_file(store).read_text())))
    if _broken_file(store).exists():  # an import failed even on a cleaned store
        shutil.rmtree(store)
        store.mkdir()
        _broken_file(store).unlink()
    tag = secrets.token_hex(4)
    run = Path(tempfile.mkdtemp(prefix="pdn-"))
    node = Node(work, run, store,
                Traces(f"pd-node-{tag}", f"/pd-node-{tag}", str(run), str(work)))
    node.traces.save(_traces_file(store))
    try:
        _network(node.traces.netns)
        _mount_namespace(node)
        nodehost.make_cgroup_root(node.traces.cgroup_root)
        nodeconfig.cni_config(work / "cni", POD_CIDR)
        (work / "containerd.toml").write_text(nodeconfig.containerd_config(
            node.socket, run / "containerd.ttrpc.sock", work / "cni", PAUSE_IMAGE))

        def containerd() -> None:
            node.start("containerd", [*node.inside(), "containerd", "--config",
                                      str(work / "containerd.toml")])

            def answering() -> bool:
                node.alive()
                return node.socket.exists() and node.ctr("version").returncode == 0

            until("containerd", answering, 60)

        containerd()
        if node.ctr("containers", "ls", "-q").stdout.split():  # a killed run's
            _forget_containers(node.socket)
            nodehost.kill_group(node.procs.pop("containerd").pid)
            containerd()
        nodeconfig.pause_tarball(bins / "pause", work / "pause.tar", PAUSE_IMAGE)
        res = node.ctr("images", "import", str(work / "pause.tar"))
        if res.returncode:
            raise RuntimeError(f"importing the pause image: {res.stderr.strip()}")
        port = int(cp.url.rsplit(":", 1)[1])
        api_sock = run / "api.sock"
        node.start("api-out", ["socat", f"UNIX-LISTEN:{api_sock},fork,unlink-early",
                               f"TCP:127.0.0.1:{port}"])
        node.start("api-in", ["nsenter", f"--net=/run/netns/{node.traces.netns}", "socat",
                              f"TCP-LISTEN:{port},bind={NODE_IP},fork,reuseaddr",
                              f"UNIX-CONNECT:{api_sock}"])
        kubeconfig = nodeconfig.kubeconfig(work / "kubeconfig", f"https://{NODE_IP}:{port}",
                                           cp.ca_file, cp.admin_token)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
               "AWS_EC2_METADATA_DISABLED": "true"}
        node.start("kubelet", [
            *node.inside(), str(bins / "kubelet"), "--config", str(nodeconfig.kubelet_config(
                work / "kubelet.json", NODE_IP, node.traces.cgroup_root)),
            "--kubeconfig", str(kubeconfig), "--hostname-override", NODE_NAME,
            "--node-ip", NODE_IP, "--container-runtime", "remote",
            "--container-runtime-endpoint", f"unix://{node.socket}",
            "--pod-infra-container-image", PAUSE_IMAGE,
            "--volume-plugin-dir", "/var/lib/kubelet/volume-plugins", "--v", "1"], env)
        node.start("kube-proxy", [
            *node.inside(), str(bins / "kube-proxy"), "--kubeconfig", str(kubeconfig),
            "--hostname-override", NODE_NAME, "--bind-address", NODE_IP,
            "--cluster-cidr", POD_CIDR, "--proxy-mode", "iptables",
            "--conntrack-max-per-core", "0", "--conntrack-min", "0",
            "--conntrack-tcp-timeout-established", "0",
            "--conntrack-tcp-timeout-close-wait", "0", "--oom-score-adj", "0",
            "--metrics-bind-address", "127.0.0.1:10249",
            "--healthz-bind-address", "127.0.0.1:10256"], env)

        def ready() -> bool:
            node.alive()
            cp.alive()
            try:
                got = cp.request("GET", f"/api/v1/nodes/{NODE_NAME}")
            except OSError:
                return False
            return any(c["type"] == "Ready" and c["status"] == "True"
                       for c in got["status"].get("conditions") or [])

        until("the node Ready", ready, timeout, 0.5)
        yield node
    finally:
        node.left = stop(node)
