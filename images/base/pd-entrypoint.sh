#!/bin/sh
# pd-entrypoint: run the preflight, then the container's command.
# PD_PREFLIGHT=0 skips the preflight (e.g. to debug a host that fails it).
set -eu
if [ "${PD_PREFLIGHT:-1}" != "0" ]; then
  "${PD_PREFLIGHT_BIN:-/usr/local/bin/pd-preflight}"
fi
exec "$@"
