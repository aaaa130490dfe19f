#!/usr/bin/env bash
# Make a Debian base image locally, for hosts that cannot pull from a registry.
#
#   images/local-base.sh [NAME]     (default name: pd-appliance/debian:bookworm)
#
# debootstrap builds a minimal Debian from this host's own apt mirror (the first URIs line
# of its sources, or DEBIAN_MIRROR), the host's CA bundle is copied in (so builds on top of
# it reach the package indexes the host reaches), and `docker import` loads it. Then:
#   CPU_BASE_IMAGE=pd-appliance/debian:bookworm SLIM_BASE_IMAGE=pd-appliance/debian:bookworm \
#     images/build.sh --stack cpu
# An image of that name that already exists is kept (FORCE=1 rebuilds it). Needs root.
set -euo pipefail

NAME="${1:-pd-appliance/debian:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
die() { echo "local-base.sh: error: $*" >&2; exit 1; }

[[ ${EUID} -eq 0 ]] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "${NAME}" >/dev/null 2>&1; then
  echo "local-base.sh: ${NAME} exists (FORCE=1 rebuilds it)"
  exit 0
fi

mirror="${DEBIAN_MIRROR:-}"
if [[ -z "${mirror}" ]]; then
  mirror="$(grep -hoE '^URIs: *[^ ]+' /etc/apt/sources.list.d/*.sources 2>/dev/null \
              | head -1 | awk '{print $2}')" || true
fi
if [[ -z "${mirror}" ]]; then
  mirror="$(grep -hoE '^deb +(\[[^]]*\] +)?[a-z]+://[^ ]+' /etc/apt/sources.list 2>/dev/null \
              | head -1 | awk '{print $NF}')" || true
fi
mirror="${mirror:-http://deb.debian.org/debian}"

rootfs="$(mktemp -d)"
trap 'rm -rf "${rootfs}"' EXIT
echo "local-base.sh: debootstrap ${SUITE} from ${mirror}"
debootstrap --variant=minbase "${SUITE}" "${rootfs}" "${mirror}" >"${rootfs}.log" 2>&1 \
  || die "debootstrap failed: $(tail -1 "${rootfs}.log")"
rm -f "${rootfs}.log"
# The host's CA bundle, where tools read it and where Debian's ca-certificates package
# (installed by the images) keeps it when it rebuilds the bundle.
bundle="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
if [[ -f "${bundle}" ]]; then
  install -D -m 0644 "${bundle}" "${rootfs}/etc/ssl/certs/ca-certificates.crt"
  install -D -m 0644 "${bundle}" "${rootfs}/usr/local/share/ca-certificates/host-bundle.crt"
fi
rm -rf "${rootfs}/var/cache/apt/archives/"*.deb "${rootfs}/var/lib/apt/lists/"*
tar -C "${rootfs}" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "${NAME}" >/dev/null
echo "local-base.sh: imported ${NAME}"
