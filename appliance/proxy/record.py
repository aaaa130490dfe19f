"""What the access log line and the metrics say about one request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from appliance.proxy.ownership import PrefillKV

access_log = logging.getLogger("appliance.proxy.access")


@dataclass(slots=True)
class Record:
    route: str
    request_id: str
    started: float
    own_request_id: bool = False
    transfer_id: str = "-"
    prefill: str = "-"
    decode: str = "-"
    status: int = 0
    prefill_s: float | None = None
    ttfb_s: float | None = None
    fallback: str | None = None
    error: str | None = None
    kv: PrefillKV | None = None  # set once P is asked to keep KV for a transfer

    def log(self) -> None:
        total = time.monotonic() - self.started
        access_log.info(
            "%s %s xfer=%s p=%s d=%s status=%d prefill_ms=%s ttfb_ms=%s total_ms=%.1f%s%s",
            self.route, self.request_id, self.transfer_id, self.prefill, self.decode,
            self.status, _ms(self.prefill_s), _ms(self.ttfb_s), total * 1000,
            f" fallback={self.fallback}" if self.fallback else "",
            f" error={self.error!r}" if self.error else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
