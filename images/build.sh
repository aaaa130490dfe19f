#!/usr/bin/env bash
# Build the appliance's images from the repository root, base first.
#
#   images/build.sh [--stack gpu|cpu] [TAG]      (default: --stack gpu, tag 0.1.0)
#
#   gpu: pd-appliance/base (CUDA runtime, RDMA userspace), pd-appliance/vllm, pd-appliance/slim
#   cpu: pd-appliance/base-cpu (Debian or Ubuntu), pd-appliance/vllm-cpu, pd-appliance/slim
#
# CUDA_BASE_IMAGE / CPU_BASE_IMAGE / SLIM_BASE_IMAGE override the bases (every Dockerfile
# takes BASE_IMAGE; images/local-base.sh makes a Debian base on hosts without a registry).
# TORCH_INDEX_URL: where the CPU image finds torch's +cpu build when images/wheels/ has no
# wheel for it. DOCKER_BUILD_FLAGS is passed to every build (e.g. "--network host" where
# builds have no bridge network). The Dockerfiles build with the legacy builder and with
# BuildKit alike; unchanged layers come from the build cache, so a rebuild after a code
# change redoes only the last layer of each image.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
die() { echo "build.sh: error: $*" >&2; exit 2; }

STACK=gpu
TAG=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --stack) [[ $# -ge 2 ]] || die "--stack needs gpu or cpu"; STACK="$2"; shift ;;
    --stack=*) STACK="${1#--stack=}" ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) [[ -z "${TAG}" ]] || die "one TAG only"; TAG="$1" ;;
  esac
  shift
done
TAG="${TAG:-0.1.0}"
[[ "${STACK}" == gpu || "${STACK}" == cpu ]] || die "--stack must be gpu or cpu, not '${STACK}'"

read -r -a flags <<<"${DOCKER_BUILD_FLAGS:-}"
build() {  # NAME DOCKERFILE [build args...]
  local name="$1" file="$2"
  shift 2
  local begin=${SECONDS}
  echo "build.sh: building ${name} (${file})"
  docker build "${flags[@]}" -f "${file}" "$@" -t "${name}" . \
    || die "building ${name} failed (see the output above)"
  echo "build.sh: built ${name} in $((SECONDS - begin)) s"
}
base_arg() {  # VALUE: a --build-arg BASE_IMAGE=VALUE when VALUE is set
  [[ -n "$1" ]] && printf -- '--build-arg\nBASE_IMAGE=%s\n' "$1"
  return 0
}

if [[ ${STACK} == gpu ]]; then
  mapfile -t base < <(base_arg "${CUDA_BASE_IMAGE:-}")
  build "pd-appliance/base:${TAG}" images/base/Dockerfile "${base[@]}"
  build "pd-appliance/vllm:${TAG}" images/vllm/Dockerfile \
    --build-arg "BASE_IMAGE=pd-appliance/base:${TAG}"
else
  build "pd-appliance/base-cpu:${TAG}" images/base/Dockerfile \
    --build-arg "BASE_IMAGE=${CPU_BASE_IMAGE:-debian:bookworm-slim}"
  torch_arg=()
  [[ -n "${TORCH_INDEX_URL:-}" ]] && torch_arg=(--build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL}")
  build "pd-appliance/vllm-cpu:${TAG}" images/vllm-cpu/Dockerfile \
    --build-arg "BASE_IMAGE=pd-appliance/base-cpu:${TAG}" "${torch_arg[@]}"
fi
mapfile -t slim < <(base_arg "${SLIM_BASE_IMAGE:-}")
build "pd-appliance/slim:${TAG}" images/slim/Dockerfile "${slim[@]}"
echo "build.sh: built the ${STACK} stack's images, tag ${TAG}"
