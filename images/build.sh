#!/usr/bin/env bash
# Build the appliance's images from the repository root, base first.
#
#   images/build.sh [TAG]          (default tag: 0.1.0)
#
# CUDA_BASE_IMAGE / SLIM_BASE_IMAGE override the bases (every Dockerfile takes BASE_IMAGE).
# DOCKER_BUILD_FLAGS is passed to every build (e.g. "--network host" where builds have no
# bridge network). The Dockerfiles build with the legacy builder and with BuildKit alike.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
TAG="${1:-0.1.0}"

read -r -a flags <<<"${DOCKER_BUILD_FLAGS:-}"
base_args=()
[[ -n "${CUDA_BASE_IMAGE:-}" ]] && base_args+=(--build-arg "BASE_IMAGE=${CUDA_BASE_IMAGE}")
slim_args=()
[[ -n "${SLIM_BASE_IMAGE:-}" ]] && slim_args+=(--build-arg "BASE_IMAGE=${SLIM_BASE_IMAGE}")

docker build "${flags[@]}" -f images/base/Dockerfile "${base_args[@]}" \
  -t "pd-appliance/base:${TAG}" .
docker build "${flags[@]}" -f images/vllm/Dockerfile \
  --build-arg "BASE_IMAGE=pd-appliance/base:${TAG}" -t "pd-appliance/vllm:${TAG}" .
docker build "${flags[@]}" -f images/slim/Dockerfile "${slim_args[@]}" \
  -t "pd-appliance/slim:${TAG}" .
echo "built pd-appliance/{base,vllm,slim}:${TAG}"
