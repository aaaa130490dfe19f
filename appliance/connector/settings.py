"""The connector's settings, in one typed place.

They come from vLLM's `--kv-transfer-config`: `engine_id`, `kv_role`, and
`kv_connector_extra_config`, e.g.

    {"kv_connector": "PDConnector", "kv_connector_module_path": "appliance.connector.facade",
     "kv_role": "kv_producer", "engine_id": "prefill-0",
     "kv_connector_extra_config": {"bootstrap_addr": "http://10.0.0.1:8998",
                                   "protocol": "rdma", "device_name": "mlx5_0"}}
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from appliance.deadlines import Deadlines
from appliance.netaddr import host_port

_DEADLINES = Deadlines()

Role = Literal["producer", "consumer"]
# Which pulls D checks against P's digest (appliance.connector.transfers.digest).
VerifyKv = Literal["off", "sample", "all"]


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: str = Field(min_length=1)
    role: Role
    # Producer: the bootstrap sidecar its workers register with (docs/protocol.md step 4).
    bootstrap_addr: str = "http://127.0.0.1:8998"
    # Producer, instead of bootstrap_addr: the sidecar listens on this port at `host` (a
    # pod IP known only at run time; an IPv6 one must go in brackets in the URL).
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_token: str | None = None
    # How often a producer worker refreshes its registration; keep it well under the
    # sidecar's TTL (default 30 s).
    register_interval_s: float = Field(10.0, gt=0)
    # Transport: "rdma" in production, "tcp" on machines without RDMA NICs. Set it
    # explicitly; never rely on a default when GPUDirect is involved.
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    # Address this worker's side channel and Mooncake session listen on; default
    # VLLM_HOST_IP, else the host's primary address.
    host: str | None = None
    # Producer: threads that run blocking batch writes, off vLLM's forward path.
    num_workers: int = Field(4, ge=1, le=64)
    # Producer: how long computed KV is held for a decode node that never asks for it, and
    # how long a decode node's request waits for its prefill to finish (at least as long
    # as that request's own deadline). Defaults: appliance.deadlines, from the proxy's wait.
    send_timeout_s: float = Field(_DEADLINES.send_s, gt=0)
    # Consumer: the receive deadline of a request that does not carry its own
    # (`recv_timeout_ms`, which the proxy sends); when it passes the request is handed to
    # vLLM's load-failure policy (recompute locally by default) instead of waiting forever.
    recv_timeout_s: float = Field(_DEADLINES.recv_s, gt=0)
    # Consumer: a side-channel socket to a producer worker closes after this long unused,
    # and past max_peers open ones the least recently used close
    # (appliance.connector.sidechannel.peers).
    peer_idle_s: float = Field(300.0, gt=0)
    max_peers: int = Field(256, ge=1)
    # Consumer: a step that computes nothing (the engine only waits for KV) waits up to this
    # long for a pull to end, instead of vLLM stepping again after 1 ms: a D that only waits
    # sleeps rather than spinning a core. A pull's end wakes it at once; a new request that
    # arrives meanwhile waits at most this long. 0: no wait.
    idle_wait_ms: float = Field(20.0, ge=0, le=1000)
    # Consumer: how long an aborted request's blocks stay held while the producer confirms
    # it will not write into them any more.
    cancel_grace_s: float = Field(5.0, gt=0)
    # Producer: push right after the forward pass that computes a prompt's last KV
    # (wait_for_save), one scheduler step earlier than the reference, which waits for the
    # request to finish (protocol step 26). False reproduces the reference's timing.
    early_push: bool = True
    # Producer, KV in CPU memory only: with early_push, wait at most this long after the
    # forward (the next scheduler step starts the push sooner when the engine is idle), so
    # the push's copies do not compete with the step's own sampling and output on the same
    # cores. 0 pushes at once. KV in GPU memory always goes at once (DMA, no CPU copies).
    cpu_push_delay_ms: float = Field(20.0, ge=0)
    # Both roles: a prompt whose next blocks another request of the engine is computing
    # waits for them instead of computing the shared prefix again
    # (appliance.connector.prefixwait). False: vLLM's own behaviour.
    shared_prefix_wait: bool = True
    # Consumer: which pulls D checks before a step reads their KV (transfers/digest.py): P
    # sends a digest of what it wrote, D sums what landed, a mismatch is recomputed here
    # (vLLM's load-failure policy), counted. "sample": one pull in 16.
    verify_kv: VerifyKv = "sample"
    # Descriptors per batch write to one peer (Mooncake TCP rejects very large batches).
    max_batch_descs: int = Field(1024, ge=1)
    # Consumer: if set, only these bootstrap addresses may be named by a request.
    allowed_bootstrap_addrs: tuple[str, ...] | None = None
    # Consumer: CIDRs whose IP hosts a request may name as its bootstrap address too (any
    # port). On Kubernetes P pods get a new IP on every restart: D is given the pod network.
    allowed_bootstrap_networks: tuple[str, ...] | None = None
    # Side channel: a file holding the cluster's Z85 CURVE secret key on one line (one key
    # for every P and D worker and the proxy; `curve.generate_secret()` makes one). Set: P's
    # ROUTER admits only clients proving they hold it, D connects with it. Read when the
    # worker starts. None: no authentication.
    side_channel_key_file: str | None = None
    # Producer: side-channel messages over this many bytes are refused before decoding (a
    # real request is a few KiB: one request's block ids, the layout on first contact).
    max_message_bytes: int = Field(16 << 20, ge=1 << 10, le=1 << 30)
    # Producer: requests or cancellations per message (D sends one; the proxy one release).
    max_message_entries: int = Field(512, ge=1, le=1 << 20)
    # Producer: CIDRs a request's Mooncake session may name besides the address the request
    # came from (D's KV NIC differs from the one its side channel uses). None: only that.
    internal_networks: tuple[str, ...] | None = None

    @field_validator("internal_networks", "allowed_bootstrap_networks")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        try:
            return tuple(str(ipaddress.ip_network(c, strict=False)) for c in value)
        except ValueError as exc:
            raise ValueError(f"not a CIDR: {exc}") from None

    @model_validator(mode="after")
    def _bootstrap_at_port(self) -> ConnectorSettings:
        if self.bootstrap_port is None:
            return self
        if "bootstrap_addr" in self.model_fields_set:
            raise ValueError("give bootstrap_addr or bootstrap_port, not both")
        url = f"http://{host_port(self.resolved_host(), self.bootstrap_port)}"
        object.__setattr__(self, "bootstrap_addr", url)  # frozen: set once, while built
        return self

    @property
    def guards_bootstrap(self) -> bool:
        """Whether requests' bootstrap addresses are checked at all (else: any goes)."""
        return (self.allowed_bootstrap_addrs is not None
                or self.allowed_bootstrap_networks is not None)

    def bootstrap_allowed(self, addr: str) -> bool:
        """Whether a request may make this decode node contact P through `addr`: one of
        the allowed addresses, or an IP inside an allowed network (a hostname never is:
        what it resolves to is not ours to trust)."""
        if not self.guards_bootstrap:
            return True
        if addr.rstrip("/") in {a.rstrip("/") for a in self.allowed_bootstrap_addrs or ()}:
            return True
        if not self.allowed_bootstrap_networks:
            return False
        try:
            parts = urlsplit(addr.strip())
            ip = ipaddress.ip_address(parts.hostname or "")
        except ValueError:  # a hostname, or not a URL at all
            return False
        if parts.scheme not in ("http", "https"):
            return False
        return any(ip in ipaddress.ip_network(net) for net in self.allowed_bootstrap_networks)

    @property
    def is_producer(self) -> bool:
        return self.role == "producer"

    def resolved_host(self) -> str:
        if self.host:
            return self.host
        if os.environ.get("VLLM_HOST_IP"):
            return os.environ["VLLM_HOST_IP"]
        from vllm.utils.network_utils import get_ip

        return get_ip()

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config: Any) -> ConnectorSettings:
        role_map = {"kv_producer": "producer", "kv_consumer": "consumer"}
        role = role_map.get(kv_transfer_config.kv_role)
        if role is None:
            raise ValueError(f"PDConnector needs kv_role kv_producer or kv_consumer, got "
                             f"{kv_transfer_config.kv_role!r}")
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        token_file = extra.pop("bootstrap_token_file", None)
        if token_file and "bootstrap_token" not in extra:
            with open(token_file) as fh:
                extra["bootstrap_token"] = fh.read().strip()
        try:
            return cls(engine_id=kv_transfer_config.engine_id or "", role=role, **extra)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"invalid PDConnector settings: {problems}") from None
