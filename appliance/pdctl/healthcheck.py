"""`python -m appliance.pdctl.healthcheck URL`: exit 0 when URL answers 200, else 1.

The containers' healthcheck: stdlib only, so it runs in every image without curl.
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request


def check(url: str, timeout: float = 4.0) -> tuple[bool, str]:
    # A liveness probe of this host's own proxy (https when it serves TLS): its certificate
    # names the client-facing host, not the loopback address probed, so it is not verified.
    ctx = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return resp.status == 200, f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"{url}: {reason}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m appliance.pdctl.healthcheck URL", file=sys.stderr)
        return 2
    ok, detail = check(args[0])
    print(detail, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
