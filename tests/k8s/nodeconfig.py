"""The files a test node (node.py) runs on: containerd's, kubelet's and the CNI's
configuration, its kubeconfig and the pod sandbox's image."""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path


def pause_tarball(binary: Path, dest: Path, name: str) -> None:
    """A one-layer image of the static pause binary, in `docker save` format (there is no
    registry to pull one from)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tf:
        info = tarfile.TarInfo("pause")
        info.size, info.mode = binary.stat().st_size, 0o755
        with binary.open("rb") as fh:
            tf.addfile(info, fh)
    diff = hashlib.sha256(layer.getvalue()).hexdigest()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    config = json.dumps({"architecture": arch, "os": "linux",
                         "config": {"Entrypoint": ["/pause"]},
                         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff}"]}}).encode()
    digest = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{digest}.json", "RepoTags": [name],
                            "Layers": [f"{diff}/layer.tar"]}]).encode()
    with tarfile.open(dest, "w") as tf:
        for member, data in ((f"{diff}/layer.tar", layer.getvalue()),
                             (f"{digest}.json", config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def containerd_config(socket: Path, ttrpc: Path, cni_dir: Path, pause: str) -> str:
    """Root and state where the node's mount namespace has its own tmpfs and folders;
    restrict_oom_score_adj since runc cannot raise a score without CAP_SYS_RESOURCE; pod
    network namespaces under the state folder, not the host's /run/netns."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{ttrpc}"
[{cri}]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{cni_dir}"
"""


def kubeconfig(path: Path, server: str, ca: Path, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "n",
        "clusters": [{"name": "n", "cluster": {"server": server,
                                               "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "n", "context": {"cluster": "n", "user": "u"}}]}))
    path.chmod(0o600)
    return path


def kubelet_config(path: Path, address: str, cgroup_root: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": address, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        # Nothing outside the node's network namespace can reach its API.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs", "cgroupRoot": cgroup_root, "cgroupsPerQOS": True,
        "failSwapOn": False, "protectKernelDefaults": False, "resolvConf": "",
        "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE
        "maxPods": 20, "serializeImagePulls": False, "runtimeRequestTimeout": "15m",
        # The images were loaded by hand: never collected, nor evicted for a full disk.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "nodeStatusUpdateFrequency": "2s", "syncFrequency": "10s"}))
    return path


def cni_config(conf_dir: Path, pod_cidr: str) -> None:
    """One bridge (the node is its gateway), host-local addresses; no masquerading: all
    traffic stays inside the node's namespace."""
    conf_dir.mkdir()
    (conf_dir / "10-pd.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0", "name": "pd", "plugins": [{
            "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                     "routes": [{"dst": "0.0.0.0/0"}]}}]}))
