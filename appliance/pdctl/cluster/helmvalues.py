"""A cluster description as values for the Helm chart (charts/pd-appliance).

On Kubernetes the scheduler, not the description, places pods: what carries over is how many
P and D instances there are, their TP (GPUs per pod) or CPUs, the model, the ports, the
proxy's settings, the transfer (each role's NICs, GPUDirect), the timeouts, the images and
/dev/shm's size. The model's path becomes a hostPath volume (the description says every
host has the model there). The pod network comes from the description's `[kubernetes]
pod_network_cidrs` (required: D accepts bootstrap addresses only there). The keys stay out
of the values: the chart reads them from a Secret made from `pdctl init`'s keys/:

    kubectl create secret generic pd-appliance-keys --from-file=keys/
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from appliance.pdctl.cluster.description import ROLES, ClusterDescription
from appliance.pdctl.errors import ConfigError

KEYS_SECRET = "pd-appliance-keys"
_SHM_UNITS = {"b": "", "k": "Ki", "m": "Mi", "g": "Gi"}


def _image(ref: str) -> dict[str, str]:
    """An image reference as the chart's repository and tag (a digest goes in the tag)."""
    if "@" in ref:
        repo, digest = ref.split("@", 1)
        return {"repository": repo, "tag": digest}
    repo, sep, tag = ref.rpartition(":")
    if sep and "/" not in tag:  # not a registry's port
        return {"repository": repo, "tag": tag}
    return {"repository": ref, "tag": ""}


def _quantity(size: str) -> str:
    """docker's 16g as Kubernetes' 16Gi."""
    unit = size[-1] if size[-1] in _SHM_UNITS else "b"
    return size.rstrip("bkmg") + _SHM_UNITS[unit]


def _model(desc: ClusterDescription) -> dict[str, Any]:
    m = desc.model
    out: dict[str, Any] = {
        "path": m.path,
        "servedName": m.name,
        "tpSize": m.tp_size,
        "prefillTpSize": m.tp("prefill"),
        "decodeTpSize": m.tp("decode"),
        "gpuMemoryUtilization": m.gpu_memory_utilization,
        "extraArgs": list(m.extra_args),
        "prefillExtraArgs": list(m.prefill_extra_args),
        "decodeExtraArgs": list(m.decode_extra_args),
        "volume": {"type": "hostPath", "hostPath": m.path},
    }
    for key, value in (("blockSize", m.block_size), ("maxModelLen", m.max_model_len),
                       ("kvCacheBytes", m.kv_cache_bytes),
                       ("decodePrefillChunk", m.decode_prefill_chunk),
                       ("maxNumBatchedTokens", m.max_num_batched_tokens)):
        if value is not None:
            out[key] = value
    return out


def _role(desc: ClusterDescription, role: str) -> dict[str, Any]:
    instances = desc.plan().of(role)  # type: ignore[arg-type]
    out: dict[str, Any] = {"replicas": len(instances),
                           "shmSize": _quantity(desc.compose.shm_size)}
    if desc.stack == "cpu" and instances:
        # The pod asks for as many CPUs as the largest instance of the role was given.
        out["cpus"] = max(len(i.devices) for i in instances)
    return out


NO_POD_NETWORK = ("kubernetes.pod_network_cidrs: --kubernetes needs the pod network's CIDRs "
                  "(D accepts bootstrap addresses only there), e.g. [kubernetes] "
                  "pod_network_cidrs = [\"10.244.0.0/16\"]")


def helm_values(desc: ClusterDescription) -> dict[str, Any]:
    """The chart's values for `desc` (GPUs per pod = the role's TP, set by the chart);
    ConfigError (one line) when it does not say the pod network."""
    if not desc.kubernetes.pod_network_cidrs:
        raise ConfigError(NO_POD_NETWORK)
    t = desc.transfer
    values: dict[str, Any] = {
        "stack": desc.stack,
        "model": _model(desc),
        **{role: _role(desc, role) for role in ROLES},
        "ports": {"prefill": desc.ports.prefill, "decode": desc.ports.decode,
                  "bootstrap": desc.ports.bootstrap, "proxy": desc.ports.proxy},
        # The proxy's own settings, as the description gives them (the chart derives the
        # rest from its other values, as pdctl does from the other sections).
        "proxy": {"settings": desc.proxy.model_dump(exclude_none=True, exclude={"host"})},
        "transfer": {
            # The CPU images move KV over TCP only.
            "protocol": "tcp" if desc.stack == "cpu" else t.protocol,
            # Per role its own NICs, else `device` (the chart resolves them as
            # TransferSection.devices does).
            "device": t.device,
            "prefillDevices": list(t.prefill_devices),
            "decodeDevices": list(t.decode_devices),
            "gpudirect": t.gpudirect,
            "portRange": list(t.port_range),
        },
        "timeouts": {
            "startupS": max(10, math.ceil(desc.timeouts.startup_s)),
            "kvSendS": desc.timeouts.send_s,
            "kvRecvS": desc.timeouts.recv_s,
            "prefillS": desc.timeouts.prefill_s,
            "kvTransferS": desc.timeouts.kv_transfer_s,
            "decodeReadS": desc.timeouts.decode_read_s,
        },
        "bootstrap": {"ttlS": math.ceil(desc.timeouts.bootstrap_ttl_s)},
        "tracing": {"otlpEndpoint": desc.tracing.otlp_endpoint or "",
                    "protocol": desc.tracing.protocol,
                    "sampleRatio": desc.tracing.sample_ratio},
        "images": {"slim": _image(desc.images.slim)},
        "keys": {"existingSecret": KEYS_SECRET},
        "podNetworkCidrs": list(desc.kubernetes.pod_network_cidrs),
    }
    if desc.images.vllm:  # else the chart's, by stack
        values["images"]["vllm"] = _image(desc.images.vllm)
    return values


def values_yaml(desc: ClusterDescription, source: str = "") -> str:
    """helm_values() as the values file `pdctl render --cluster --kubernetes` writes."""
    head = (f"# The Helm chart's values for the cluster {source} (charts/pd-appliance).\n"
            f"# Written by `pdctl render --cluster --kubernetes`: edit the description and "
            f"render again.\n# The keys: kubectl create secret generic {KEYS_SECRET} "
            f"--from-file=keys/\n# Then: helm install pd charts/pd-appliance -f values.yaml\n")
    return head + yaml.safe_dump(helm_values(desc), sort_keys=False)
