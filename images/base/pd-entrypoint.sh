#!/bin/sh
# pd-entrypoint: run the preflight, then the container's command, telling Mooncake which
# GPUDirect path the preflight checked (WITH_NVIDIA_PEERMEM, unless set by the user).
# PD_PREFLIGHT=0 skips the preflight (e.g. to debug a host that fails it); an explicit
# PD_GPUDIRECT (peermem or dmabuf) still reaches Mooncake then.
set -eu
mode=""
if [ "${PD_PREFLIGHT:-1}" != "0" ]; then
  rc=0
  out="$("${PD_PREFLIGHT_BIN:-/usr/local/bin/pd-preflight}" --print-mode)" || rc=$?
  [ -z "${out}" ] || printf '%s\n' "${out}" | sed '/^PD_GPUDIRECT_MODE=/d'
  [ "${rc}" -eq 0 ] || exit "${rc}"
  mode="$(printf '%s\n' "${out}" | sed -n 's/^PD_GPUDIRECT_MODE=//p')"
elif [ "${PD_PROTOCOL:-tcp}" = "rdma" ]; then
  mode="${PD_GPUDIRECT:-}"
fi

# Mooncake's CUDA build registers GPU memory with plain ibv_reg_mr (needs nvidia_peermem)
# when WITH_NVIDIA_PEERMEM is true or unset, and through DMA-BUF (ibv_reg_dmabuf_mr) when
# it is 0.
case "${mode}" in
  peermem) want="1" ;;
  dmabuf) want="0" ;;
  *) want="" ;;
esac
if [ -n "${want}" ]; then
  if [ -z "${WITH_NVIDIA_PEERMEM:-}" ]; then
    WITH_NVIDIA_PEERMEM="${want}"
    export WITH_NVIDIA_PEERMEM
    echo "pd-entrypoint: GPUDirect ${mode}: WITH_NVIDIA_PEERMEM=${want}"
  elif [ "${WITH_NVIDIA_PEERMEM}" != "${want}" ]; then
    echo "pd-entrypoint: WITH_NVIDIA_PEERMEM=${WITH_NVIDIA_PEERMEM} set by the user, kept" \
      "(the preflight checked GPUDirect ${mode})"
  fi
fi
exec "$@"
