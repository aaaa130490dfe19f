"""What adaptive placement adds to each request in the proxy: `Placement.choose` (sizing
the prompt, the estimates, the rule, the ticket) plus what the request's end teaches
(`Ticket.close`, `Placement.learned`), in microseconds per request, for `split=always`
(sizing and a ticket only) and `split=auto`, alternating in one run. Pure Python, no
servers: the proxy's event loop runs exactly this per request.

    .venv/bin/python bench/placement_cost.py [--requests 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from appliance.proxy.nodes.backends import Backend  # noqa: E402
from appliance.proxy.openai_api import CHAT, COMPLETIONS  # noqa: E402
from appliance.proxy.placement import Placement  # noqa: E402

BODIES = {
    "chat, 6 messages, 4,000 chars": (CHAT, {"messages": [
        {"role": "user" if i % 2 else "assistant", "content": "x" * 666} for i in range(6)]}),
    "completion, 2,000 token ids": (COMPLETIONS, {"prompt": list(range(2000))}),
    "completion, 500-char text": (COMPLETIONS, {"prompt": "y" * 500}),
}


def per_request_us(split: str, route: str, body: dict, n: int) -> float:
    place = Placement(split, itl_slo_ms=None)  # type: ignore[arg-type]
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    d.in_flight = 3
    started = time.perf_counter()
    for i in range(n):
        decision, ticket, chars = place.choose(body, route, p, d)
        now = time.monotonic()
        ticket.close(now, learn=True, tokens=400 + i % 7)
        place.learned(route, chars, 400 + i % 7, None if decision.local else (400, 0.02),
                      0.01)
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    table = Table(title=f"placement per request (µs, median of {args.rounds} rounds of "
                        f"{args.requests})")
    for col in ("prompt", "always", "auto", "auto - always"):
        table.add_column(col, justify="right")
    for name, (route, body) in BODIES.items():
        got: dict[str, list[float]] = {"always": [], "auto": []}
        for _ in range(args.rounds):
            for split in ("always", "auto"):
                got[split].append(per_request_us(split, route, body, args.requests))
        a, b = statistics.median(got["always"]), statistics.median(got["auto"])
        table.add_row(name, f"{a:.1f}", f"{b:.1f}", f"{b - a:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
