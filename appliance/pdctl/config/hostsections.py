"""The host config's host-facing sections: the host itself, its model, the devices P and D
run on (GPUs, or CPUs on stack "cpu"), and a cluster host's instance lists;
`appliance.pdctl.config.hostconfig` puts them together with the node-facing ones
(`appliance.pdctl.config.sections`)."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from appliance.pdctl.config.sections import NAME, Section, safe_path

# vLLM flags pdctl sets itself; in extra_args they would silently fight the config.
MANAGED_FLAGS = {
    "--host": "host.ip", "--port": "ports.prefill / ports.decode",
    "--api-key": "the node's keys (keys/api-key, pdctl init --rotate-keys)",
    "--kv-transfer-config": "transfer", "--tensor-parallel-size": "model.tp_size",
    "-tp": "model.tp_size", "--block-size": "model.block_size",
    "--served-model-name": "model.served_name", "--max-model-len": "model.max_model_len",
    "--gpu-memory-utilization": "model.gpu_memory_utilization",
    "--kv-cache-memory-bytes": "model.kv_cache_bytes",
    "--kv-events-config": "proxy.prefix_index (P and D always publish KV events)",
    "--prefix-caching-hash-algo": "proxy.prefix_index (sha256_cbor, the proxy's hashing)",
    "--long-prefill-token-threshold": "model.decode_prefill_chunk",
    "--max-num-batched-tokens": "model.max_num_batched_tokens",
}


class HostSection(Section):
    name: str = Field(default_factory=lambda: socket.gethostname().split(".")[0] or "node")
    # The internal address (the cluster network's): P, D, the bootstrap sidecar and the side
    # channels listen on it alone, and peers reach this host there. Only the proxy listens
    # on the client-facing address (compose.bind).
    ip: str
    # Networks (CIDRs) a decode node's Mooncake session may be on; empty: only the address
    # its side-channel request came from.
    internal_networks: list[str] = Field(default_factory=list)

    @field_validator("internal_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        out = []
        for net in v:
            try:
                out.append(str(ipaddress.ip_network(net, strict=False)))
            except ValueError:
                raise ValueError(f"{net!r} is not a network (e.g. 10.0.0.0/16)") from None
        return out

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError("must be letters, digits, '.', '_' or '-'")
        return v

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str) -> str:
        try:
            addr = ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None
        if addr.is_unspecified:
            raise ValueError("must be the address peers reach this host at, not 0.0.0.0")
        return str(addr)


class ModelSection(Section):
    path: str
    served_name: str | None = None
    tp_size: int = Field(1, ge=1, le=16)
    # P and D may differ in TP (each decode rank pulls its KV heads from the prefill ranks
    # holding them); unset, each is tp_size.
    prefill_tp_size: int | None = Field(None, ge=1, le=16)
    decode_tp_size: int | None = Field(None, ge=1, le=16)
    # Default: 16 on the GPU stack, 32 on the CPU stack.
    block_size: Literal[16, 32, 64, 128] | None = None
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # CPU stack: bytes of KV cache per server (default: sized from the model's config for a
    # few requests of max_model_len tokens; see appliance.kvbudget).
    kv_cache_bytes: int | None = Field(None, ge=1 << 20)
    # D's longest prefill chunk while other requests run (tokens; 0: no cap): a prompt that
    # split=auto has D compute itself stalls D's decodes a chunk per step, not its whole
    # prefill (README, bench/serve.py --decode-chunk). Default: 512 on the GPU stack, 128 on
    # the CPU stack.
    decode_prefill_chunk: int | None = Field(None, ge=0)
    # Each engine's token budget per step (vLLM's --max-num-batched-tokens; 0: vLLM's own):
    # prompts that arrive together are computed a budget at a time, the first answering
    # while the rest compute (README). Default: 256 on the CPU stack, vLLM's on the GPU
    # stack. vLLM wants at least its max_num_seqs (128 on CPU, 256-1024 on GPUs).
    max_num_batched_tokens: int | None = Field(None, ge=0)
    extra_args: list[str] = Field(default_factory=list)

    def tp(self, role: str) -> int:
        """TP size of "prefill" or "decode"."""
        own = self.prefill_tp_size if role == "prefill" else self.decode_tp_size
        return own or self.tp_size

    prefill_extra_args: list[str] = Field(default_factory=list)
    decode_extra_args: list[str] = Field(default_factory=list)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return safe_path(v, "the model directory")

    @field_validator("served_name")
    @classmethod
    def _served(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$", v):
            raise ValueError("must be letters, digits and . _ / : -")
        return v

    @field_validator("extra_args", "prefill_extra_args", "decode_extra_args")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for arg in v:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ValueError(f"{flag} is set by pdctl (use {MANAGED_FLAGS[flag]})")
        return v

    @property
    def name(self) -> str:
        return self.served_name or Path(self.path).name


def _once_each(values: list[int], what: str) -> list[int]:
    dup = sorted({i for i in values if values.count(i) > 1})
    if dup:
        raise ValueError(f"{what} {dup[0]} is listed twice")
    return values


class GpusSection(Section):
    prefill: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0], min_length=1)
    decode: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1], min_length=1)

    @field_validator("prefill", "decode")
    @classmethod
    def _unique(cls, v: list[int]) -> list[int]:
        return _once_each(v, "GPU")


class CpusSection(Section):
    # CPU stack: the CPUs P's and D's containers run on (`pdctl init` splits the host's in
    # two); required there.
    prefill: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    decode: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)

    @field_validator("prefill", "decode")
    @classmethod
    def _unique(cls, v: list[int]) -> list[int]:
        return sorted(_once_each(v, "CPU"))


Devices = list[Annotated[int, Field(ge=0)]]


class InstanceLists(Section):
    """A host's P and D instances: one device list (GPUs, or CPUs on stack "cpu") each.
    Instance i listens on ports.<role> + i and has engine id `<host>-<role>-<i>`; P
    instance i has its own bootstrap sidecar on ports.bootstrap + i."""

    prefill: list[Devices] = Field(default_factory=list)
    decode: list[Devices] = Field(default_factory=list)

    @field_validator("prefill", "decode")
    @classmethod
    def _nonempty(cls, v: list[Devices]) -> list[Devices]:
        if any(not devices for devices in v):
            raise ValueError("each instance needs at least one GPU (or CPU)")
        return v
