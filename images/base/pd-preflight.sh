#!/bin/sh
# pd-preflight [--print-mode]: fail fast, with the reason and the fix, when this container
# cannot run: the GPU image's NVIDIA driver is missing or too old, or KV cannot move over
# RDMA. Otherwise print what it found.
#
#   PD_PROTOCOL        rdma | tcp (tcp: no RDMA or GPUDirect checks)
#   PD_RDMA_DEVICE     e.g. mlx5_0, or a comma-separated list (default: the first device)
#   PD_GPUDIRECT       auto | peermem | dmabuf: how the NIC reaches GPU memory; auto takes
#                      nvidia_peermem when it is loaded, else DMA-BUF when it is usable
#   PD_MIN_DRIVER      the oldest NVIDIA driver the image's CUDA build runs on; set by the
#                      GPU image only (unset: no driver check, as on the CPU images)
#   PD_NVIDIA_SMI      the nvidia-smi asked when /proc has no driver version (tests)
#   PD_PREFLIGHT_ROOT  a tree standing in for / (tests)
#
# --print-mode ends stdout, on protocol rdma, with a line PD_GPUDIRECT_MODE=peermem|dmabuf:
# the path it checked, which pd-entrypoint hands to Mooncake.
set -eu

root="${PD_PREFLIGHT_ROOT:-}"
protocol="${PD_PROTOCOL:-tcp}"
device="${PD_RDMA_DEVICE:-}"
gpudirect="${PD_GPUDIRECT:-auto}"
min_driver="${PD_MIN_DRIVER:-}"
print_mode=""

fail() {
  echo "pd-preflight: error: $*" >&2
  exit 1
}

for arg in "$@"; do
  case "${arg}" in
    --print-mode) print_mode="yes" ;;
    *) fail "unknown argument '${arg}' (usage: pd-preflight [--print-mode])" ;;
  esac
done

case "${protocol}" in
  tcp|rdma) ;;
  *) fail "PD_PROTOCOL must be rdma or tcp, not '${protocol}'" ;;
esac

# --- NVIDIA driver (GPU image) ------------------------------------------------------------
# On an older driver the CUDA 13 build (torch, Mooncake) fails at its first CUDA call, deep
# in vLLM's start-up log and naming a CUDA version, not the driver to install: say that
# first, whatever the protocol.
driver_version() {
  v="$(awk '/^NVRM version:/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+(\.[0-9]+)?$/) {
         print $i; exit } }' "${root}/proc/driver/nvidia/version" 2>/dev/null || true)"
  if [ -z "${v}" ] && command -v "${PD_NVIDIA_SMI:-nvidia-smi}" >/dev/null 2>&1; then
    v="$("${PD_NVIDIA_SMI:-nvidia-smi}" --query-gpu=driver_version --format=csv,noheader \
         2>/dev/null | head -n 1 | tr -d ' ' || true)"
  fi
  case "${v}" in
    [0-9]*.[0-9]*) echo "${v}" ;;
  esac
}

version_ge() {  # A B: dotted version A >= B
  awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, "."); m = split(b, y, ".")
    for (i = 1; i <= (n > m ? n : m); i++) if (x[i] + 0 != y[i] + 0) exit !(x[i] + 0 > y[i] + 0)
    exit 0 }'
}

if [ -n "${min_driver}" ]; then
  branch="R${min_driver%%.*}"
  found="$(driver_version)"
  [ -n "${found}" ] || fail "no NVIDIA driver found (no /proc/driver/nvidia/version, no" \
    "nvidia-smi): this GPU image (CUDA 13) needs NVIDIA driver ${min_driver} or later; install" \
    "the ${branch} driver or newer on the host and run the container with the NVIDIA runtime" \
    "(a GPU device reservation), or run the CPU stack (pdctl init --stack cpu)"
  version_ge "${found}" "${min_driver}" || fail "NVIDIA driver ${found} is too old: this" \
    "GPU image (CUDA 13) needs ${min_driver} or later; install the ${branch} driver or newer" \
    "on the host (its open kernel modules also give DMA-BUF) and reboot"
  echo "pd-preflight: ok: NVIDIA driver ${found} (${min_driver} or later)"
fi

if [ "${protocol}" = "tcp" ]; then
  echo "pd-preflight: protocol tcp: no RDMA checks"
  exit 0
fi
case "${gpudirect}" in
  peermem|dmabuf|auto) ;;
  *) fail "PD_GPUDIRECT must be peermem, dmabuf or auto, not '${gpudirect}'" ;;
esac

# --- RDMA devices and ports ---------------------------------------------------------------
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

nics=""
for dev in $(echo "${device}" | tr ',' ' '); do
  [ -d "${ib}/${dev}" ] || fail "RDMA device ${dev} not found (visible: ${devices});" \
    "set transfer.device to one of them"
  port=""
  for p in "${ib}/${dev}"/ports/*; do
    [ -f "${p}/state" ] || continue
    case "$(cat "${p}/state")" in
      *ACTIVE*) port="${p##*/}"; break ;;
    esac
  done
  [ -n "${port}" ] || fail "RDMA device ${dev} has no ACTIVE port: check the cable, the" \
    "switch and the subnet manager (ibstat ${dev})"
  rate="$(cat "${ib}/${dev}/ports/${port}/rate" 2>/dev/null || echo "rate unknown")"
  nics="${nics}${nics:+, }${dev} port ${port} ACTIVE (${rate})"
done

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

mode=""
case "${gpudirect}" in
  peermem|auto) peermem_ok && mode="peermem" ;;
esac
if [ -z "${mode}" ]; then
  case "${gpudirect}" in
    dmabuf|auto) dmabuf_ok && mode="dmabuf" ;;
  esac
fi
bad_address="so registering GPU memory fails with \"Bad address\""
modprobe="run 'modprobe nvidia_peermem' on the host (install.sh --gpu --systemd makes it permanent)"
case "${mode}:${gpudirect}" in
  :peermem) fail "GPUDirect RDMA: nvidia_peermem is not loaded on the host, ${bad_address}:" \
    "${modprobe}, or set transfer.gpudirect = \"auto\" to take DMA-BUF where it is usable" ;;
  :dmabuf) fail "GPUDirect RDMA: DMA-BUF is not usable (it needs NVIDIA's open kernel" \
    "modules and Linux >= 5.12); load nvidia_peermem on the host and set" \
    "transfer.gpudirect = \"peermem\" or \"auto\"" ;;
  :auto) fail "GPUDirect RDMA: nvidia_peermem is not loaded on the host and DMA-BUF is not" \
    "usable (it needs NVIDIA's open kernel modules and Linux >= 5.12), ${bad_address}:" \
    "${modprobe}, or install the driver's open kernel modules" ;;
esac
via="nvidia_peermem"
[ "${mode}" = "peermem" ] || via="DMA-BUF"

echo "pd-preflight: ok: ${nics}, ${uverbs}, ${locked}, GPUDirect via ${via}"
if [ -n "${print_mode}" ]; then echo "PD_GPUDIRECT_MODE=${mode}"; fi
