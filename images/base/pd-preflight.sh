#!/bin/sh
# pd-preflight: fail fast, with the reason and the fix, when this container cannot move KV
# over RDMA; otherwise print one line saying what it found.
#
#   PD_PROTOCOL        rdma | tcp (tcp: nothing to check)
#   PD_RDMA_DEVICE     e.g. mlx5_0 (default: the first device)
#   PD_GPUDIRECT       peermem | dmabuf | auto: how the NIC reaches GPU memory
#   PD_PREFLIGHT_ROOT  a tree standing in for / (tests)
set -eu

root="${PD_PREFLIGHT_ROOT:-}"
protocol="${PD_PROTOCOL:-tcp}"
device="${PD_RDMA_DEVICE:-}"
gpudirect="${PD_GPUDIRECT:-peermem}"

fail() {
  echo "pd-preflight: error: $*" >&2
  exit 1
}

case "${protocol}" in
  tcp) echo "pd-preflight: protocol tcp: no RDMA checks"; exit 0 ;;
  rdma) ;;
  *) fail "PD_PROTOCOL must be rdma or tcp, not '${protocol}'" ;;
esac
case "${gpudirect}" in
  peermem|dmabuf|auto) ;;
  *) fail "PD_GPUDIRECT must be peermem, dmabuf or auto, not '${gpudirect}'" ;;
esac

# --- RDMA device and port -----------------------------------------------------------------
ib="${root}/sys/class/infiniband"
devices=""
for d in "${ib}"/*; do
  [ -e "${d}" ] && devices="${devices} ${d##*/}"
done
devices="${devices# }"
[ -n "${devices}" ] || fail "protocol is rdma but no RDMA device is visible" \
  "(/sys/class/infiniband is empty): run on a host with an RDMA NIC and host networking," \
  "or set transfer.protocol = \"tcp\""
[ -n "${device}" ] || device="${devices%% *}"
[ -d "${ib}/${device}" ] || fail "RDMA device ${device} not found (visible: ${devices});" \
  "set transfer.device to one of them"

port=""
for p in "${ib}/${device}"/ports/*; do
  [ -f "${p}/state" ] || continue
  case "$(cat "${p}/state")" in
    *ACTIVE*) port="${p##*/}"; break ;;
  esac
done
[ -n "${port}" ] || fail "RDMA device ${device} has no ACTIVE port: check the cable, the" \
  "switch and the subnet manager (ibstat ${device})"
rate="$(cat "${ib}/${device}/ports/${port}/rate" 2>/dev/null || echo "rate unknown")"

uverbs=""
for u in "${root}/dev/infiniband"/uverbs*; do
  if [ -e "${u}" ]; then uverbs="${u##*/}"; break; fi
done
[ -n "${uverbs}" ] || fail "/dev/infiniband/uverbs* is not in the container: pass the device" \
  "(compose.yaml: devices: [/dev/infiniband])"

# --- memlock ------------------------------------------------------------------------------
# RDMA pins (registers) the KV cache. With CAP_IPC_LOCK effective, locking memory is not
# bounded by RLIMIT_MEMLOCK: enough on its own, as on Kubernetes, where a pod spec cannot
# raise that ulimit (the runtime's default is 8 MiB) but can add the capability.
memlock="$(awk '/^Max locked memory/ { print $4 }' "${root}/proc/self/limits" 2>/dev/null || true)"
capeff="$(awk '/^CapEff:/ { print $2 }' "${root}/proc/self/status" 2>/dev/null || true)"
ipc_lock=""
case "${capeff}" in
  ""|*[!0-9a-fA-F]*) ;;
  *)
    low="${capeff}"
    [ "${#low}" -le 4 ] || low="${low#"${low%????}"}"  # bits 0-15: CAP_IPC_LOCK is bit 14
    if [ $(( (0x${low} >> 14) & 1 )) -eq 1 ]; then ipc_lock="yes"; fi
    ;;
esac
if [ "${memlock}" = "unlimited" ]; then
  locked="memlock unlimited"
elif [ -n "${ipc_lock}" ]; then
  locked="memlock ${memlock:-unknown} bytes with CAP_IPC_LOCK"
else
  fail "memlock is ${memlock:-unknown} bytes, not unlimited, and CAP_IPC_LOCK is not" \
    "effective: RDMA pins the KV cache (compose.yaml: ulimits memlock -1 and cap_add" \
    "IPC_LOCK; Kubernetes: securityContext.capabilities.add [IPC_LOCK])"
fi

# --- GPUDirect ----------------------------------------------------------------------------
peermem_ok() { [ -d "${root}/sys/module/nvidia_peermem" ]; }

dmabuf_ok() {
  grep -q "Open Kernel Module" "${root}/proc/driver/nvidia/version" 2>/dev/null || return 1
  release="$(cat "${root}/proc/sys/kernel/osrelease" 2>/dev/null || echo 0.0)"
  major="${release%%.*}"
  rest="${release#*.}"
  minor="${rest%%[!0-9]*}"
  [ "${major:-0}" -gt 5 ] || { [ "${major:-0}" -eq 5 ] && [ "${minor:-0}" -ge 12 ]; }
}

via=""
case "${gpudirect}" in
  peermem|auto) peermem_ok && via="nvidia_peermem" ;;
esac
if [ -z "${via}" ]; then
  case "${gpudirect}" in
    dmabuf|auto) dmabuf_ok && via="DMA-BUF" ;;
  esac
fi
if [ -z "${via}" ]; then
  case "${gpudirect}" in
    dmabuf) fail "GPUDirect RDMA: DMA-BUF is not usable (it needs NVIDIA's open kernel" \
      "modules and Linux >= 5.12); load nvidia_peermem on the host and set" \
      "transfer.gpudirect = \"peermem\"" ;;
    *) fail "GPUDirect RDMA: nvidia_peermem is not loaded on the host, so registering GPU" \
      "memory fails with \"Bad address\": run 'modprobe nvidia_peermem' on the host" \
      "(install.sh --gpu --systemd makes it permanent) or use DMA-BUF" ;;
  esac
fi

echo "pd-preflight: ok: ${device} port ${port} ACTIVE (${rate}), ${uverbs}, ${locked}," \
  "GPUDirect via ${via}"
