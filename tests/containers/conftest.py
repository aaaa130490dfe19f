"""The private Docker Engine every container test module runs on (tests/containers/engine.py):
started once per module on the cached data root, stopped by its pid after the module, and
nothing may be left behind."""

from __future__ import annotations

import pytest

from tests.containers.engine import DockerEngine, EngineUnavailable, cache_dir, ensure_packages


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine")
    try:
        ensure_packages(logs / "apt.log")
        eng = DockerEngine(cache_dir() / "docker")
        eng.start()
    except EngineUnavailable as exc:
        pytest.skip(f"no Docker Engine here: {exc}")
    try:
        yield eng
    finally:
        left = eng.stop()
        assert not left, f"the engine left behind: {left}"
