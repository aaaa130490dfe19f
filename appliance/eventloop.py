"""The event loop the appliance's own servers run on: uvloop's (libuv) where it is installed,
as it is wherever the package is (Linux, macOS), else asyncio's.

The proxy's one core is its whole data path: under bench/proxy_overhead.py's load at
concurrency 64 it took about a fifth less CPU per request on uvloop than on asyncio's loop
(`--compare-ref` a commit before it, side by side), and the span exporter process about a
tenth less per span. Both loops run the same code; the tests of the proxy run it on
uvloop (tests/proxy/conftest.py), as it runs in production."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # a platform without it (Windows): asyncio's own loop
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the appliance's loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
