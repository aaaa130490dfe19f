"""pdctl: per-host config, rendering, host checks, status, and local/compose runs of a node.

Grouped by what each part acts on: `node/` (the node on this host: its rendered files,
Compose or `--local` processes, status, logs, the proxy's admin commands), `host/` (the
machine itself: probe, doctor, init), `cluster/` (cluster descriptions and every host's
part), `config/` (the per-host config file) and `top/` (the live view of a proxy). Shared by
all: `cli` (the entry point), `clibase`, `errors`, `runner`.

Kept import-light: `appliance.pdctl.healthcheck` runs inside the slim containers.
"""
