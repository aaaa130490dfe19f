#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler (v1.20.2) from Debian
# bookworm's `kubernetes` source package, offline from Debian's own archive, into
#   ${PD_TEST_CACHE:-~/.cache/pd-appliance-tests}/kubernetes-1.20.2/bin/
# Reused when all three are there; about 8 minutes cold on 2 cores, 1.4 GB of RAM, 2 GB of
# scratch (removed afterwards). Used only by the tests that run the chart on a real API
# server; the appliance never needs it.
set -euo pipefail

VERSION=1.20.2
cache="${PD_TEST_CACHE:-$HOME/.cache/pd-appliance-tests}/kubernetes-$VERSION"
bin="$cache/bin"
components=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() {
  local c
  for c in "${components[@]}"; do [ -x "$bin/$c" ] || return 1; done
}

if have_all; then
  echo "build-control-plane: cached in $bin"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "build-control-plane: needs root (apt-get)" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
need=()
command -v go >/dev/null || need+=(golang-go)
command -v dpkg-source >/dev/null || need+=(dpkg-dev)
command -v make >/dev/null || need+=(make)
command -v rsync >/dev/null || need+=(rsync)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/pd-k8s-build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# A private apt configuration with the deb-src line of the archive the host already uses:
# the host's own sources stay as they are.
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null ||
      true)
[ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$uri" ] || { echo "build-control-plane: no Debian archive URI in apt's sources" >&2; exit 1; }
mkdir -p "$scratch/lists/partial" "$scratch/src"
echo "deb-src $uri bookworm main" > "$scratch/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$scratch/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$scratch/lists" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -qq
# bookworm's package is "1.20.5+really1.20.2": v1.20.2's sources.
version=$(apt-cache "${apt_opts[@]}" showsrc kubernetes | awk '/^Version:/ {print $2; exit}')
case "$version" in
  *"$VERSION"*) ;;
  *) echo "build-control-plane: Debian's kubernetes source is $version, not $VERSION" >&2
     exit 1 ;;
esac
(cd "$scratch/src" && apt-get "${apt_opts[@]}" source -qq "kubernetes=$version" >/dev/null)
tree=$(find "$scratch/src" -maxdepth 1 -type d -name "kubernetes-*" | head -n 1)
[ -n "$tree" ] || { echo "build-control-plane: no kubernetes source tree" >&2; exit 1; }

echo "build-control-plane: building ${components[*]} in $tree (several minutes)"
targets=$(printf 'cmd/%s ' "${components[@]}")
(cd "$tree" && GOFLAGS=-mod=vendor GOCACHE="$scratch/gocache" GOPATH="$scratch/gopath" \
  KUBE_GIT_VERSION="v$VERSION" make WHAT="$targets" >"$scratch/build.log" 2>&1) || {
  tail -n 30 "$scratch/build.log" >&2
  echo "build-control-plane: make failed" >&2
  exit 1
}
mkdir -p "$bin.partial"
for c in "${components[@]}"; do
  built=$(find "$tree/_output" -type f -name "$c" -perm -u+x | head -n 1)
  [ -n "$built" ] || { echo "build-control-plane: $c not built" >&2; exit 1; }
  cp "$built" "$bin.partial/$c"
done
rm -rf "$bin"
mv "$bin.partial" "$bin"
echo "build-control-plane: built into $bin"
