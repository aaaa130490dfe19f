"""Chart test fixtures: helm (fetched once, or the tests skip), and each values case rendered
once per session."""

from __future__ import annotations

import pytest

from tests.charts.cases import Rendered
from tests.charts.helmtool import Helm, cache_dir, find_helm


@pytest.fixture(scope="session")
def helm() -> Helm:
    binary, why = find_helm()
    if binary is None:
        pytest.skip(f"no helm: {why}")
    return Helm(binary, cache_dir() / "helm" / "home")


@pytest.fixture(scope="session")
def rendered(helm: Helm) -> Rendered:
    return Rendered(helm)
