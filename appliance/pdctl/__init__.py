"""pdctl: per-host config, rendering, host checks, status, and local/compose runs of a node.

Kept import-light: `appliance.pdctl.healthcheck` runs inside the slim containers.
"""
