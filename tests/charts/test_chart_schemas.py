"""Every rendered object against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict:
unknown and version-specific fields fail), for each version from 1.29 it knows."""

from __future__ import annotations

import functools

import pytest

from tests.charts.cases import CASES, Rendered

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def _versions() -> list[str]:
    known = {v for v in kv.utils.all_versions()
             if tuple(map(int, v.split(".")[:2])) >= (1, 29)}
    return sorted(known, key=lambda v: tuple(map(int, v.split("."))))


VERSIONS = _versions()


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> object:
    """kubernetes-validate reads and parses a schema file on every call: keep them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv.utils, "schema_contents", functools.cache(kv.utils.schema_contents))
        yield


def test_versions_cover_129_to_137() -> None:
    assert VERSIONS[0].startswith("1.29") and VERSIONS[-1].startswith("1.37")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", CASES)
def test_objects_valid(rendered: Rendered, name: str, version: str) -> None:
    problems = []
    for doc in rendered(name):
        try:
            kv.validate(doc, version, strict=True)
        except (kv.ValidationError, kv.SchemaNotFoundError) as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")
    assert not problems, "\n".join(problems)


def test_validator_is_not_vacuous(rendered: Rendered) -> None:
    """A misspelt field in a pod template fails, so a pass above means something."""
    import copy

    doc = copy.deepcopy(next(d for d in rendered("defaults") if d["kind"] == "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSIONS[-1], strict=True)
