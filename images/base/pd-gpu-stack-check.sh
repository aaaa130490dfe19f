#!/bin/sh
# pd-gpu-stack-check [PYTHON]: prove at build, without a GPU, what the GPU image needs at
# start. PYTHON is the venv's python (default python3). Checks:
#   (a) every ELF shared object of torch, the nvidia-* CUDA wheels, cuda-python, vLLM (and
#       its CUTLASS DSL), FlashInfer (and its TVM FFI runtime), Triton and Mooncake finds
#       each library it needs (ldd: RPATH, RUNPATH, the system's paths) and each symbol
#       version it asks of the system's (glibc, libstdc++). Allowed missing: the driver's
#       own libraries (DRIVER_LIBS), which the NVIDIA container runtime mounts from the host,
#       and the cluster libraries of NVSHMEM's optional plugins (MPI, PMIx and OpenSHMEM
#       bootstraps, libfabric and UCX transports: dlopened only when NVSHMEM_BOOTSTRAP or
#       NVSHMEM_REMOTE_TRANSPORT names them, against the host's own MPI or UCX). A library
#       ldd does not find counts as found when importing torch, vllm, triton and flashinfer
#       has loaded one of that name: extension modules that link libtorch, the CUDA runtime
#       or libtriton without a path to them are only ever loaded after those imports;
#   (b) torch, vllm, triton and flashinfer import; torch is a CUDA 13 build;
#   (c) Triton's launcher: a C compiler and the venv's Python.h (pd-toolchain-check builds
#       and runs one);
#   (d) FlashInfer: its sampler is off (VLLM_USE_FLASHINFER_SAMPLER=0) and an H100 (SM 9.0)
#       takes vLLM's FLASH_ATTN backend first, whose FA3 kernels ship prebuilt in the vLLM
#       wheel: nothing of FlashInfer is JIT-compiled at start;
#   (e) Mooncake's engine module resolves its libraries (its import needs the driver's
#       libcuda, so (a) covers it and the import itself is expected to fail here).
# Ends with one summary line; exits non-zero with the reason when a check fails.
set -eu
py="${1:-python3}"
# The driver's libraries: the container runtime mounts them from the host (compute:
# libcuda, the PTX JIT compiler; utility: NVML), they are in no wheel.
DRIVER_LIBS="${PD_DRIVER_LIBS:-libcuda.so.1 libnvidia-ml.so.1}"

fail() {
  echo "pd-gpu-stack-check: error: $*" >&2
  exit 1
}

command -v ldd >/dev/null || fail "ldd not found"
site="$("${py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  || fail "${py} does not run"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
# What the imports write (FlashInfer's and CUTLASS's caches, inductor's temp files) stays out
# of the image.
mkdir "${work}/home"
HOME="${work}/home" TMPDIR="${work}" XDG_CACHE_HOME="${work}/home/.cache"
export HOME TMPDIR XDG_CACHE_HOME

# --- (b) the imports, and what they load ---------------------------------------------------
"${py}" - "${work}" <<'PY' || fail "the imports failed (above)"
import os
import sys

work = sys.argv[1]
import torch  # noqa: E402

cuda = torch.version.cuda or ""
assert cuda.startswith("13."), f"torch {torch.__version__} is not a CUDA 13 build ({cuda!r})"
import flashinfer  # noqa: E402
import triton  # noqa: E402
import vllm  # noqa: E402

loaded = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        fields = line.split()
        if len(fields) >= 6 and ".so" in fields[5]:
            loaded.add(os.path.basename(fields[5]))
with open(os.path.join(work, "loaded"), "w") as out:
    out.write("\n".join(sorted(loaded)) + "\n")
with open(os.path.join(work, "versions"), "w") as out:
    out.write(f"torch {torch.__version__} (CUDA {cuda}), vllm {vllm.__version__}, "
              f"triton {triton.__version__}, flashinfer {flashinfer.__version__}")
PY

# --- (a) shared objects ----------------------------------------------------------------------
dirs=""
for d in torch torch.libs nvidia cuda vllm vllm.libs nvidia_cutlass_dsl flashinfer flashinfer_cubin tvm_ffi \
         flashinfer_jit_cache triton mooncake mooncake_transfer_engine_cuda13.libs; do
  [ -d "${site}/${d}" ] && dirs="${dirs} ${site}/${d}"
done
# shellcheck disable=SC2086  # word splitting of the directory list is wanted
find ${dirs} -type f \( -name '*.so' -o -name '*.so.*' \) >"${work}/candidates"
: >"${work}/objects"
while IFS= read -r f; do
  # ELF only (some .so files are linker scripts)
  [ "$(head -c 4 "${f}" | od -An -c | tr -d ' \n')" = '177ELF' ] && echo "${f}" >>"${work}/objects"
done <"${work}/candidates"
count="$(wc -l <"${work}/objects" | tr -d ' ')"
[ "${count}" -gt 0 ] || fail "no shared objects found under ${site}"

: >"${work}/missing"  # FILE<TAB>LIBRARY
: >"${work}/versions-missing"
while IFS= read -r f; do
  out="$(ldd "${f}" 2>&1)" || true
  printf '%s\n' "${out}" | awk -v f="${f}" '/=> not found/ { print f "\t" $1 }' >>"${work}/missing"
  printf '%s\n' "${out}" | grep "version \`.*' not found" >>"${work}/versions-missing" || true
done <"${work}/objects"

[ ! -s "${work}/versions-missing" ] || fail "symbol versions this system's libraries lack:" \
  "$(sort -u "${work}/versions-missing" | head -n 20)"

driver=0
via_imports=0
plugins=0
: >"${work}/unresolved"
while IFS="$(printf '\t')" read -r f lib; do
  case " ${DRIVER_LIBS} " in
    *" ${lib} "*) driver=$((driver + 1)); continue ;;
  esac
  case "${f}:${lib}" in
    */nvidia/nvshmem/lib/nvshmem_bootstrap_*:libmpi.so.*|*/nvidia/nvshmem/lib/nvshmem_bootstrap_*:libpmix.so.*|\
    */nvidia/nvshmem/lib/nvshmem_bootstrap_*:liboshmem.so.*|\
    */nvidia/nvshmem/lib/nvshmem_transport_*:libfabric.so.*|*/nvidia/nvshmem/lib/nvshmem_transport_*:libuc[pstm].so.*)
      plugins=$((plugins + 1)); continue ;;
  esac
  if grep -qxF "${lib}" "${work}/loaded"; then
    via_imports=$((via_imports + 1))
    continue
  fi
  echo "${f#"${site}/"} needs ${lib}" >>"${work}/unresolved"
done <"${work}/missing"
[ ! -s "${work}/unresolved" ] || fail "libraries not found:" \
  "$(sort -u "${work}/unresolved" | head -n 40)"
needs_driver="$(cut -f2 "${work}/missing" | sort -u | while read -r lib; do
  case " ${DRIVER_LIBS} " in *" ${lib} "*) printf '%s ' "${lib}" ;; esac; done)"

# --- (c) Triton's launcher compiler ----------------------------------------------------------
pd-toolchain-check "${py}" >/dev/null || fail "pd-toolchain-check failed (above)"

# --- (d) FlashInfer at start, (e) Mooncake's import --------------------------------------------
"${py}" - "${work}" <<'PY' || fail "the attention backend check failed (above)"
import __future__
import ast
import importlib.util
import os
import shutil
import sys

import vllm.envs as envs
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum

work = sys.argv[1]
assert envs.VLLM_USE_FLASHINFER_SAMPLER is False, "VLLM_USE_FLASHINFER_SAMPLER does not read as off"
# vllm.platforms.cuda loads vLLM's kernels, which need the driver's libcuda: its backend
# priorities are read from the installed source and run alone.
source = importlib.util.find_spec("vllm.platforms.cuda").origin
with open(source) as f:
    tree = ast.parse(f.read())
fn = next(n for n in tree.body
          if isinstance(n, ast.FunctionDef) and n.name == "_get_backend_priorities")
fn.decorator_list = []
scope = {"AttentionBackendEnum": AttentionBackendEnum}
exec(compile(ast.Module(body=[fn], type_ignores=[]), source, "exec",  # noqa: S102
             flags=__future__.annotations.compiler_flag, dont_inherit=True), scope)
order = scope["_get_backend_priorities"](use_mla=False, device_capability=DeviceCapability(9, 0))
assert order[0].name == "FLASH_ATTN", f"an H100 takes {order[0].name} first, not FLASH_ATTN"
fa_dir = os.path.join(os.path.dirname(importlib.util.find_spec("vllm").origin), "vllm_flash_attn")
fa3 = sorted(n for n in os.listdir(fa_dir) if n.startswith("_vllm_fa3_C") and ".so" in n)
assert fa3, f"no prebuilt FA3 kernels in {fa_dir}"
nvcc = shutil.which("nvcc") or "none on PATH"
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    mooncake = "imports"
except ImportError as exc:
    if "libcuda.so.1" not in str(exc):
        raise
    mooncake = "import needs the driver (libcuda.so.1)"
with open(os.path.join(work, "attention"), "w") as out:
    out.write(f"H100 attention FLASH_ATTN ({fa3[0]} prebuilt, FlashInfer sampler off, "
              f"nvcc {nvcc}); mooncake engine {mooncake}")
PY

echo "pd-gpu-stack-check: ok: ${count} shared objects resolve (${via_imports} needs met by" \
  "the imports' libraries, ${plugins} by none: NVSHMEM's MPI/UCX plugins; ${driver} need only" \
  "the driver's ${needs_driver% }); $(cat "${work}/versions");" \
  "cc + Python.h; $(cat "${work}/attention")"
