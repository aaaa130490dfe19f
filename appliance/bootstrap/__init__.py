"""Bootstrap sidecar (aiohttp): engine id -> prefill workers' side-channel addresses."""

from appliance.bootstrap.app import build_app
from appliance.bootstrap.settings import BootstrapSettings

__all__ = ["BootstrapSettings", "build_app"]
