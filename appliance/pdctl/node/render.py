"""What compose and systemd read: the `.env` file and compose.yaml (plus, for the CPU stack,
compose.override.yaml) in one directory, the unit, the proxy's config file where the proxy
runs (appliance.pdctl.node.proxyfile), and the node's own keys (keys/, created when
missing; see appliance.keys).

docker compose reads `.env` and compose.override.yaml beside compose.yaml by itself, so in
that directory a plain `docker compose up -d` starts the node as `pdctl up` does."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import appliance
from appliance import keys, kvbudget
from appliance.netaddr import host_port
from appliance.pdctl.cluster import compose as clustercompose
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.errors import ConfigError, PdctlError
from appliance.pdctl.node import observability, proxyfile
from appliance.process import decode_chunk_flags, step_tokens_flags

DEFAULT_DIR = Path("/etc/pd-appliance")
ENV_FILE = ".env"
COMPOSE_FILE = "compose.yaml"
OVERRIDE_FILE = "compose.override.yaml"
CPU_COMPOSE_FILE = "compose.cpu.yaml"  # in the source tree; rendered as OVERRIDE_FILE
UNIT_FILE = "pd-appliance.service"
PDCTL_BIN = "/usr/local/bin/pdctl"  # install.sh --systemd links the venv's pdctl here


def repo_file(name: str) -> Path:
    """A file shipped at the top of the source tree (compose.yaml, config/...)."""
    path = Path(appliance.__file__).resolve().parent.parent / name
    if not path.exists():
        raise PdctlError(f"{name} not found at {path} (pdctl runs from the source checkout "
                         f"install.sh set up)")
    return path


def local_addr(cfg: HostConfig) -> str:
    """Where the proxy is reached from this host (its health check, pdctl status)."""
    return "127.0.0.1" if cfg.compose.bind == "0.0.0.0" else cfg.compose.bind


def keys_dir(out_dir: Path) -> Path:
    """The node's secrets, beside the rendered files (mounted read-only into every
    container)."""
    return out_dir / "keys"


def bootstrap_token_file(cfg: HostConfig, out_dir: Path) -> str:
    return cfg.auth.bootstrap_token_file or str(keys.NodeKeys(keys_dir(out_dir)).bootstrap_token)


def allowed_bootstraps(cfg: HostConfig) -> list[str]:
    """The sidecars D accepts bootstraps from: its own node's, or every one of a cluster's."""
    if cfg.cluster is not None:
        return list(cfg.cluster.sidecars)
    return [f"http://{host_port(cfg.host.ip, cfg.ports.bootstrap)}"]


def kv_cache_bytes(cfg: HostConfig) -> int:
    """CPU stack: the KV budget per server, from the config or sized from the model."""
    try:
        return kvbudget.budget(cfg.model.kv_cache_bytes, cfg.model.path,
                               cfg.model.max_model_len, cfg.block_size)
    except kvbudget.ModelShapeError as exc:
        raise ConfigError(f"model.kv_cache_bytes: cannot size the KV cache from the model "
                          f"({exc}); set it in the host config") from None


def env_values(cfg: HostConfig, out_dir: Path) -> dict[str, str]:
    m, p, t = cfg.model, cfg.ports, cfg.timeouts
    common = [*step_tokens_flags(cfg.max_num_batched_tokens), *cfg.tracing.vllm_args(),
              *m.extra_args]
    if cfg.stack == "cpu":
        common = ["--kv-cache-memory-bytes", str(kv_cache_bytes(cfg)), *common]
    if m.max_model_len:
        common = ["--max-model-len", str(m.max_model_len), *common]
    token = bootstrap_token_file(cfg, out_dir)
    k = keys.NodeKeys(keys_dir(out_dir))
    return {
        "PD_PROJECT": cfg.compose.project,
        "PD_VLLM_IMAGE": cfg.vllm_image,
        "PD_SLIM_IMAGE": cfg.images.slim,
        "PD_RESTART": cfg.compose.restart,
        "PD_SHM_SIZE": cfg.compose.shm_size,
        "PD_CONFIG_DIR": str(out_dir),
        "PD_HOST_IP": cfg.host.ip,
        "PD_LOCAL_ADDR": local_addr(cfg),
        "PD_PROXY_SCHEME": "https" if cfg.tls.cert_file else "http",
        "PD_KEYS_DIR": str(k.dir),
        "PD_API_KEY_FILE": str(k.api_key),
        "PD_SIDE_CHANNEL_KEY_FILE": str(k.side_channel_key),
        "PD_INTERNAL_NETWORKS": json.dumps(cfg.host.internal_networks),
        "PD_MC_MIN_PORT": str(cfg.transfer.port_range[0]),
        "PD_MC_MAX_PORT": str(cfg.transfer.port_range[1]),
        "PD_MODEL": m.path,
        "PD_SERVED_MODEL_NAME": m.name,
        "PD_PREFILL_TP_SIZE": str(m.tp("prefill")),
        "PD_DECODE_TP_SIZE": str(m.tp("decode")),
        "PD_BLOCK_SIZE": str(cfg.block_size),
        "PD_GPU_MEMORY_UTILIZATION": str(m.gpu_memory_utilization),
        "PD_PREFILL_GPUS": ",".join(map(str, cfg.gpus.prefill)),
        "PD_DECODE_GPUS": ",".join(map(str, cfg.gpus.decode)),
        "PD_PREFILL_CPUS": ",".join(map(str, cfg.cpus.prefill)),
        "PD_DECODE_CPUS": ",".join(map(str, cfg.cpus.decode)),
        "PD_PROXY_PORT": str(p.proxy),
        "PD_PREFILL_PORT": str(p.prefill),
        "PD_DECODE_PORT": str(p.decode),
        "PD_BOOTSTRAP_PORT": str(p.bootstrap),
        "PD_PREFILL_ENGINE_ID": cfg.prefill_engine_id,
        "PD_DECODE_ENGINE_ID": cfg.decode_engine_id,
        "PD_PROTOCOL": cfg.transfer.protocol,
        "PD_PREFILL_RDMA_DEVICE": cfg.transfer.device_name("prefill"),
        "PD_DECODE_RDMA_DEVICE": cfg.transfer.device_name("decode"),
        "PD_GPUDIRECT": cfg.transfer.gpudirect,
        "PD_INFINIBAND": "/dev/infiniband" if cfg.transfer.protocol == "rdma" else "/dev/null",
        "PD_KV_SEND_TIMEOUT": _num(t.send_s),
        "PD_KV_RECV_TIMEOUT": _num(t.recv_s),
        "PD_BOOTSTRAP_TTL": _num(t.bootstrap_ttl_s),
        "PD_BOOTSTRAP_TOKEN_FILE": token,
        "PD_BOOTSTRAP_ARGS": shlex.join(["--token-file", token]),
        "PD_VLLM_START_PERIOD": f"{int(t.startup_s)}s",
        "PD_OTLP_TRACES_ENDPOINT": cfg.tracing.otlp_endpoint or "",
        "PD_OTLP_TRACES_PROTOCOL": cfg.tracing.protocol,
        **(observability.env(cfg) if cfg.cluster is None else {}),
        "PD_PREFILL_ARGS": shlex.join([*common, *m.prefill_extra_args]),
        "PD_DECODE_ARGS": shlex.join([*common, *decode_chunk_flags(cfg.decode_prefill_chunk),
                                      *m.decode_extra_args]),
        "PD_ALLOWED_BOOTSTRAPS": json.dumps(allowed_bootstraps(cfg)),
        **clustercompose.instance_env(cfg),
    }


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _env_quote(value: str) -> str:
    """Compose's dotenv: single quotes are literal; double quotes take \\ escapes."""
    if "'" not in value and "\n" not in value:
        return f"'{value}'"
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'"{escaped}"'


def env_file_text(cfg: HostConfig, out_dir: Path, source: Path | None = None) -> str:
    head = [f"# Written by `pdctl render`{f' from {source}' if source else ''}: edit the host "
            f"config, not this file.",
            f"# docker compose reads it by itself: cd {out_dir} && docker compose up -d (or, with "
            f"no Compose plugin, pdctl compose up -d)"]
    body = [f"{k}={_env_quote(v)}" for k, v in env_values(cfg, out_dir).items()]
    return "\n".join(head + body) + "\n"


def compose_argv(cfg: HostConfig, out_dir: Path, compose: Sequence[str]) -> list[str]:
    """Compose (`compose`: appliance.pdctl.host.composebin's choice) on the rendered directory:
    it finds compose.yaml, the override and .env there, as a plain `docker compose` run in that
    directory does."""
    return [*compose, "--project-directory", str(out_dir), "--project-name", cfg.compose.project]


def unit_text(cfg: HostConfig, out_dir: Path, config_path: Path) -> str:
    # `pdctl compose` picks the engine's plugin or the bundled Compose when the unit runs.
    compose = f"{PDCTL_BIN} compose --config {config_path} --"
    startup = int(cfg.timeouts.startup_s)
    return f"""\
# pd-appliance: this host's 1P1D node (bootstrap, vLLM P and D, proxy) through docker compose.
# Written by `pdctl render`; install.sh --systemd installs it with the nvidia_peermem
# modules-load entry. Start: systemctl enable --now pd-appliance
[Unit]
Description=pd-appliance 1P1D vLLM node (docker compose)
Requires=docker.service
After=docker.service network-online.target
Wants=network-online.target
ConditionPathExists={out_dir / ENV_FILE}

[Service]
Type=oneshot
RemainAfterExit=yes
WorkingDirectory={out_dir}
# Host preflight (GPUs, GPUDirect, RDMA port, memlock, NVIDIA runtime): fail here, with the
# reason in the journal, rather than at the first request. Not the ports: after a reboot
# dockerd may already have restarted the node's containers (restart: unless-stopped).
ExecStartPre={PDCTL_BIN} doctor --config {config_path} --skip ports
ExecStart={compose} up --detach --wait --wait-timeout {startup} --remove-orphans
ExecStop={compose} down
TimeoutStartSec={startup + 120}
TimeoutStopSec=180

[Install]
WantedBy=multi-user.target
"""


def compose_text(cfg: HostConfig) -> str:
    """compose.yaml as shipped for a 1P1D node; a cluster host's services from it."""
    text = repo_file(COMPOSE_FILE).read_text()
    return text if cfg.cluster is None else clustercompose.host_compose(cfg, text)


def override_text(cfg: HostConfig) -> str:
    text = repo_file(CPU_COMPOSE_FILE).read_text()
    return text if cfg.cluster is None else clustercompose.host_override(cfg, text)


def read_api_keys(path: Path) -> list[str]:
    keys = [line.strip() for line in path.read_text().splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


def placement_problems(cfg: HostConfig, out_dir: Path) -> list[str]:
    """Files the containers read must be inside the directory mounted into them."""
    out = []
    for section, key in (("auth", "api_keys_file"), ("auth", "bootstrap_token_file"),
                         ("tls", "cert_file"), ("tls", "key_file")):
        value = getattr(getattr(cfg, section), key)
        if value and not Path(value).is_relative_to(out_dir):
            out.append(f"{section}.{key}: {value} must be inside {out_dir} (the directory "
                       f"mounted into the containers)")
    return out


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def render(cfg: HostConfig, config_path: Path, out_dir: Path) -> list[Path]:
    """Write every file into out_dir; returns their paths."""
    out_dir = out_dir.resolve()
    problems = placement_problems(cfg, out_dir)
    if problems:
        raise ConfigError(problems)
    client_keys: list[str] = []
    if cfg.auth.api_keys_file:
        try:
            client_keys = read_api_keys(Path(cfg.auth.api_keys_file))
        except OSError as exc:
            raise ConfigError(f"auth.api_keys_file: {cfg.auth.api_keys_file}: "
                              f"{exc.strerror or exc}") from None
        if not client_keys:
            raise ConfigError(f"auth.api_keys_file: {cfg.auth.api_keys_file} has no keys")
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        keys.ensure(keys_dir(out_dir))  # the ones `pdctl init` wrote stay as they are
        if cfg.cluster is None or cfg.cluster.proxy:
            settings = proxyfile.proxy_settings(cfg, keys.NodeKeys(keys_dir(out_dir)),
                                                bootstrap_token_file(cfg, out_dir), client_keys)
            write_file(out_dir / proxyfile.FILE, proxyfile.file_text(settings, config_path),
                       0o600)
            written.append(out_dir / proxyfile.FILE)
        write_file(out_dir / ENV_FILE, env_file_text(cfg, out_dir, config_path))
        write_file(out_dir / COMPOSE_FILE, compose_text(cfg))
        written += [out_dir / ENV_FILE, out_dir / COMPOSE_FILE]
        if cfg.stack == "cpu":
            write_file(out_dir / OVERRIDE_FILE, override_text(cfg))
            written.append(out_dir / OVERRIDE_FILE)
        else:  # compose would read one left from a CPU-stack render
            (out_dir / OVERRIDE_FILE).unlink(missing_ok=True)
        write_file(out_dir / UNIT_FILE, unit_text(cfg, out_dir, config_path.resolve()))
        written.append(out_dir / UNIT_FILE)
        if cfg.cluster is None:  # the observability profile's files (its containers read them)
            shipped = {f: repo_file(f) for f in (observability.RULES, observability.DASHBOARD)}
            for rel, text in observability.files(cfg, local_addr(cfg), shipped).items():
                path = out_dir / observability.DIR / rel
                path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                write_file(path, text)
                written.append(path)
    except OSError as exc:
        raise PdctlError(f"cannot write to {out_dir}: {exc.strerror or exc}") from None
    return written
