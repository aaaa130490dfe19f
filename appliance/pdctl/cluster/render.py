"""`pdctl render --cluster FILE --out DIR`: one directory per host with its host config and
the cluster's keys (the same on every host: D and the proxy prove them to every P), and,
with `--kubernetes`, the Helm chart's values for the same cluster.

Copy `DIR/<host>/` to the host's config directory (/etc/pd-appliance) and run `pdctl up`
there: it renders that host's compose files and starts its part."""

from __future__ import annotations

import shutil
from pathlib import Path

from appliance import keys
from appliance.pdctl.cluster.description import ClusterDescription
from appliance.pdctl.cluster.helmvalues import values_yaml
from appliance.pdctl.config.toml import to_toml
from appliance.pdctl.errors import PdctlError
from appliance.pdctl.node.render import DEFAULT_DIR, keys_dir, write_file

HOST_FILE = "host.toml"
VALUES_FILE = "values.yaml"


def _header(source: Path, host: str) -> str:
    return (f"# pd-appliance host config of {host}: its part of the cluster {source}.\n"
            f"# Written by `pdctl render --cluster`: edit the cluster description and render "
            f"again.\n# On {host}: copy this directory to {DEFAULT_DIR}, then `pdctl up`.\n")


def render_cluster(desc: ClusterDescription, source: Path, out_dir: Path,
                   kubernetes: bool = False) -> list[Path]:
    """Write every host's directory (and values.yaml); returns the files written."""
    out_dir = out_dir.resolve()
    written: list[Path] = []
    values = None
    if kubernetes:  # first: a description the chart cannot take writes nothing

        values = values_yaml(desc, str(source))
    try:
        shared = keys.ensure(keys_dir(out_dir))  # made once, kept on later renders
        for h in desc.hosts:
            host_dir = out_dir / h.name
            cfg = desc.host_config(h.name, str(source))
            (host_dir / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
            for name in keys.NAMES:
                shutil.copy2(shared.dir / name, host_dir / "keys" / name)
            write_file(host_dir / HOST_FILE, to_toml(cfg, _header(source, h.name)))
            written.append(host_dir / HOST_FILE)
        if values is not None:
            write_file(out_dir / VALUES_FILE, values)
            written.append(out_dir / VALUES_FILE)
    except OSError as exc:
        raise PdctlError(f"cannot write to {out_dir}: {exc.strerror or exc}") from None
    return written
