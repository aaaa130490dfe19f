#!/usr/bin/env bash
# Builds Kubernetes v1.20.2 from Debian bookworm's `kubernetes` source package, offline from
# Debian's own archive, into
#   ${PD_TEST_CACHE:-~/.cache/pd-appliance-tests}/kubernetes-1.20.2/bin/
# the control plane (kube-apiserver, kube-controller-manager, kube-scheduler) and a node's
# kubelet, kube-proxy and pause (the pod sandbox's process, static, from the tree's
# build/pause/linux/pause.c), in one build of one source tree. Reused when all are there
# and bin/RECIPE says they were built the way this script builds them; about 10 minutes
# cold on 2 cores, 1.4 GB of RAM, 2 GB of scratch (removed afterwards). Used only by the
# tests that run the chart on a real API server or node; the appliance never needs it.
#
# The tree vendors modern-go/reflect2 1.0.1, which does not work with Go 1.18 and later
# (Debian's Go is 1.19): json-iterator crashes the API server when it encodes a map into
# JSON (a custom resource, for one: reflect2.(*UnsafeMapType).UnsafeIterate). Debian's own
# golang-github-modern-go-reflect2-dev (1.0.2, fixed for Go 1.18) replaces it before the
# build; RECIPE names that, so binaries built before the fix are rebuilt.
set -euo pipefail

VERSION=1.20.2
RECIPE="kubernetes v$VERSION; vendor/github.com/modern-go/reflect2 from Debian's golang-github-modern-go-reflect2-dev 1.0.2"
cache="${PD_TEST_CACHE:-$HOME/.cache/pd-appliance-tests}/kubernetes-$VERSION"
bin="$cache/bin"
components=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
PAUSE_VERSION=3.4.1  # the tree's build/pause TAG

have_all() {
  local c
  for c in "${components[@]}" pause; do [ -x "$bin/$c" ] || return 1; done
  [ "$(cat "$bin/RECIPE" 2>/dev/null)" = "$RECIPE" ]
}

# One build at a time: a second caller (a test while .ci/run's background build runs)
# waits here, then finds the cache.
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9

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
command -v gcc >/dev/null && [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(gcc libc6-dev)
command -v rsync >/dev/null || need+=(rsync)
if [ ${#need[@]} -gt 0 ]; then
  # Another apt (install.sh, a test's) may hold dpkg's lock meanwhile: wait for it.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" \
    >/dev/null
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

# reflect2 1.0.2 (see above), unpacked from Debian's package without installing it.
reflect2_deb() {
  (cd "$scratch" && apt-get -o APT::Sandbox::User=root download -qq \
    "golang-github-modern-go-reflect2-dev=1.0.2*" >/dev/null 2>&1)
}
reflect2_deb || { apt-get -o DPkg::Lock::Timeout=600 update -qq && reflect2_deb; } ||
  { echo "build-control-plane: cannot download golang-github-modern-go-reflect2-dev 1.0.2" >&2
    exit 1; }
dpkg-deb -x "$scratch"/golang-github-modern-go-reflect2-dev_1.0.2*.deb "$scratch/reflect2"
fixed="$scratch/reflect2/usr/share/gocode/src/github.com/modern-go/reflect2"
[ -f "$fixed/go_above_118.go" ] || { echo "build-control-plane: no reflect2 1.0.2 in $fixed" >&2
                                     exit 1; }
vendored="$tree/vendor/github.com/modern-go/reflect2"
rm -f "$vendored"/*.go "$vendored"/*.s
cp "$fixed"/*.go "$fixed"/*.s "$vendored"/

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
gcc -Os -Wall -static -DVERSION="v$PAUSE_VERSION" -o "$bin.partial/pause" \
  "$tree/build/pause/linux/pause.c"
echo "$RECIPE" > "$bin.partial/RECIPE"
rm -rf "$bin"
mv "$bin.partial" "$bin"
echo "build-control-plane: built into $bin"
