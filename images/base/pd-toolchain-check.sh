#!/bin/sh
# pd-toolchain-check [PYTHON]: prove that this image can build what vLLM compiles at run
# time: Triton's CUDA launcher (a C extension module, GPU stack) and torch inductor's C++
# kernels (CPU stack, unless --enforce-eager). Builds a tiny C extension module against
# PYTHON's headers (default python3), imports it and calls it, and compiles and runs a C++
# program. Exits non-zero, with the compiler's own error, when either fails.
set -eu
py="${1:-python3}"
dir="$(mktemp -d)"
trap 'rm -rf "${dir}"' EXIT

cat >"${dir}/pdprobe.c" <<'C'
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdprobe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_pdprobe(void) { return PyModule_Create(&module); }
C
include="$("${py}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("${py}" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
# Triton asks for `cc` (or $CC); inductor for `g++` (or $CXX).
"${CC:-cc}" -shared -fPIC -O1 -I"${include}" "${dir}/pdprobe.c" -o "${dir}/pdprobe${suffix}"
PYTHONPATH="${dir}" "${py}" -c 'import pdprobe; assert pdprobe.answer() == 42'

printf '#include <vector>\nint main() { std::vector<int> v{1}; return v[0] - 1; }\n' \
  >"${dir}/probe.cpp"
"${CXX:-g++}" -O1 "${dir}/probe.cpp" -o "${dir}/probe"
"${dir}/probe"
echo "pd-toolchain-check: ok: a C extension module for $("${py}" -c 'import sys; print(sys.version.split()[0])') and a C++ program built and run ($("${CC:-cc}" --version | head -n 1))"
