"""config/constraints-gpu.txt is a full freeze of the GPU stack (images/freeze-gpu.sh writes
it): one exact pin per package, FlashInfer, Triton and torch's CUDA libraries included, and
the same versions install.sh, the vLLM image and pyproject.toml name. Offline and fast."""

from __future__ import annotations

import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT
from tests.pdctl.test_images import _arg, _sh_var

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

FREEZE = ROOT / "config/constraints-gpu.txt"
SCRIPT = ROOT / "images/freeze-gpu.sh"
PIN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[0-9][0-9A-Za-z.!+-]*)")


def _lines() -> list[str]:
    return [line.strip() for line in FREEZE.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _pins() -> dict[str, str]:
    return {canonicalize_name(m["name"]): m["version"]
            for m in (PIN.fullmatch(line) for line in _lines()) if m}


def _dockerfile_arg(name: str) -> str:
    return _arg("images/vllm/Dockerfile", name)


def test_every_line_is_an_exact_pin_or_a_comment_and_none_twice():
    lines = _lines()
    bad = [line for line in lines if not PIN.fullmatch(line)]
    assert not bad, f"not name==version: {bad}"
    names = [canonicalize_name(PIN.fullmatch(line)["name"]) for line in lines]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"pinned more than once: {twice}"
    assert len(names) >= 100, "a full freeze, not a handful of pins"
    assert names == sorted(names), "the freeze is sorted by name"


def test_the_gpu_stack_is_pinned_flashinfer_triton_and_the_cuda_libraries_included():
    pins = _pins()
    for name in ("vllm", "torch", "torchaudio", "torchvision", "flashinfer-python", "triton",
                 "mooncake-transfer-engine-cuda13", "cuda-toolkit"):
        assert name in pins, f"{name} is not pinned"
    # torch's CUDA libraries: cuBLAS (nvidia-cublas from CUDA 13 on, nvidia-cublas-cuXX
    # before), cuDNN and NCCL, of the CUDA major that Mooncake's build is for.
    cuda = _sh_var("MOONCAKE_GPU").split("==")[0].rsplit("-cuda", 1)[1]
    assert pins["cuda-toolkit"].split(".")[0] == cuda
    for lib in ("nvidia-cublas", "nvidia-cudnn", "nvidia-nccl"):
        found = [n for n in pins if n == lib or n.startswith(f"{lib}-cu")]
        assert found, f"{lib} is not pinned"
        assert all(n == lib or n == f"{lib}-cu{cuda}" for n in found), found


def test_the_freeze_agrees_with_install_sh_and_the_vllm_image():
    pins = _pins()
    vllm = _sh_var("VLLM_VERSION")
    assert pins["vllm"] == vllm == _dockerfile_arg("VLLM_VERSION")
    package, version = _sh_var("MOONCAKE_GPU").split("==")
    assert package == _dockerfile_arg("MOONCAKE_PACKAGE")
    assert pins[canonicalize_name(package)] == version == _dockerfile_arg("MOONCAKE_VERSION")
    text = FREEZE.read_text()
    assert f"vLLM {vllm} pins torch {pins['torch']}" in text, "the header names the stack"
    assert "images/freeze-gpu.sh" in text, "the header says how to regenerate it"


def test_the_freeze_satisfies_pyproject_toml_and_covers_what_install_sh_installs():
    """install.sh --gpu installs the package with the model, host and dev extras under these
    constraints (the image, the package alone): each of them is pinned, within its range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = _pins()
    for spec in project["dependencies"] + extras["model"] + extras["host"] + extras["dev"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not pinned"
        assert req.specifier.contains(pins[name], prereleases=True), (spec, pins[name])


def test_the_regeneration_script_is_there_and_reads_the_stack_from_install_sh():
    text = SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK)
    for needle in ("VLLM_VERSION", "MOONCAKE_GPU", "--dry-run", "--report",
                   "config/constraints-gpu.txt"):
        assert needle in text, needle


OLD_FIVE_PINS = """\
# Not a full freeze: the five pins this file had before, which float FlashInfer and CUDA.
vllm==0.32.0
torch==2.13.0
torchaudio==2.11.0
torchvision==0.28.0
mooncake-transfer-engine-cuda13==0.3.14
"""


def test_the_checks_refuse_the_old_five_pin_file(tmp_path, monkeypatch):
    path = tmp_path / "constraints-gpu.txt"
    path.write_text(OLD_FIVE_PINS)
    monkeypatch.setattr(f"{__name__}.FREEZE", path)
    with pytest.raises(AssertionError, match="a full freeze"):
        test_every_line_is_an_exact_pin_or_a_comment_and_none_twice()
    with pytest.raises(AssertionError, match="flashinfer-python is not pinned"):
        test_the_gpu_stack_is_pinned_flashinfer_triton_and_the_cuda_libraries_included()
