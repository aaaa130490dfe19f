"""Spans sent by a process of their own: an OTLP exporter behind a pipe.

A busy single-threaded server (the proxy) hands its finished requests' trace records (ids,
clock readings, a few strings) down a pipe, in msgpack frames of up to a few hundred records.
Each record is encoded as its request ends, while its objects are still in the CPU's cache,
and is not kept: held for a frame and encoded with it, the records made tracing cost the
proxy 8-12% of its CPU per request under sustained load at concurrency 64, against 0-6%
(bench/proxy_overhead.py --tracing's setup, 3 s slices).
The exporter process writes them as OTLP spans with the writer it is named (for the proxy,
appliance.proxy.spanwriter.SpanWriter), sends them in batches (otlpexport), and reports back
on its stdout how many it exported or dropped. Writing and sending the spans in the proxy's
own loop cost its one core a tenth to a fifth of its rate at concurrency 64 (gRPC, the
default, the most); a pipe write per frame costs it almost nothing, and a slow collector,
gzip or gRPC never touch its loop (bench/proxy_overhead.py --tracing).

Nothing is ever waited on: a pipe the exporter does not drain, or an exporter that is gone,
drops records (counted), and the exporter is started again a few seconds later. It exits
when the pipe closes, with the server, however the server ends, once it has sent what it
was given.

    python -m appliance.observability.exportproc ENDPOINT PROTOCOL MODULE:WRITER
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import struct
import sys
import time
from typing import Any

import msgspec

log = logging.getLogger("appliance.observability.exportproc")

FRAME = struct.Struct("<I")  # a frame's length, then that many bytes: a msgpack array
FRAME_RECORDS = 256  # records per frame, at most
FRAME_BYTES = 32 << 10  # a frame goes at this size: half a pipe's default capacity
FRAME_WAIT_S = 0.05  # how long a record waits for others before its frame goes
MAX_UNREAD = 8 << 20  # bytes the pipe may hold unread before records are dropped
RESTART_AFTER_S = 5.0
CLOSE_TIMEOUT_S = 8.0  # the exporter's own flush gets 5 s (SpanExport.close)
REPORT_EVERY_S = 0.1


def _array_head(n: int) -> bytes:
    """The msgpack header of an array of `n` items (fixarray, array 16 or array 32), which
    the records encoded after it complete."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


class ExportProcess:
    """The server's side: records queued, framed and written down the exporter's pipe;
    `counts` (exported, dropped spans) as the exporter reports them, plus what was dropped
    here. `writer`: "module:Class" of the exporter's SpanWriter (its `resource`, `scope`,
    `spans(record)` and `encode(record) -> bytes`)."""

    def __init__(self, endpoint: str, protocol: str, writer: str) -> None:
        self.endpoint, self.protocol, self.writer = endpoint, protocol, writer
        self.counts = {"exported": 0, "dropped": 0}
        self._records = bytearray()  # encoded records, after each other
        self._count = 0  # records in self._records
        self._spans = 0  # in self._records
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._started_at = -RESTART_AFTER_S
        self._closing = False
        self._encode_into = msgspec.msgpack.Encoder().encode_into

    async def start(self) -> None:
        await self._spawn()

    async def _spawn(self) -> None:
        self._started_at = time.monotonic()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "appliance.observability.exportproc", self.endpoint,
                self.protocol, self.writer,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        except OSError as exc:
            log.warning("cannot start the trace exporter (%s): spans dropped", exc)
            return
        self._reader = asyncio.create_task(self._read(self._proc), name="trace-export-counts")

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """The exporter's reports ("exported N", "dropped N") until it exits."""
        assert proc.stdout is not None
        async for line in proc.stdout:
            outcome, _, n = line.decode().partition(" ")
            if outcome in self.counts and n.strip().isdigit():
                self.counts[outcome] += int(n)
        code = await proc.wait()
        if self._proc is proc:
            self._proc = None
        if not self._closing:
            log.warning("the trace exporter exited (code %s): spans are dropped until it "
                        "starts again", code)

    def add(self, record: tuple, n: int) -> None:
        """One request's record (as the writer reads it), `n` spans."""
        self._encode_into(record, self._records, -1)
        self._count += 1
        self._spans += n
        if self._count >= FRAME_RECORDS or len(self._records) >= FRAME_BYTES:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FRAME_WAIT_S, self._send)

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        records, count, spans = self._records, self._count, self._spans
        self._records, self._count, self._spans = bytearray(), 0, 0
        proc = self._proc
        pipe = proc.stdin if proc is not None else None
        if pipe is None or pipe.is_closing() or \
                pipe.transport.get_write_buffer_size() > MAX_UNREAD:
            self.counts["dropped"] += spans
            if proc is None and not self._closing and self._starting is None and \
                    time.monotonic() - self._started_at >= RESTART_AFTER_S:
                self._starting = asyncio.create_task(self._restart())
            return
        head = _array_head(count)
        pipe.write(FRAME.pack(len(head) + len(records)) + head + records)

    async def _restart(self) -> None:
        try:
            await self._spawn()
        finally:
            self._starting = None

    async def close(self) -> None:
        """What is queued goes down the pipe; the exporter sends it and exits."""
        self._closing = True  # first: a last frame with no exporter starts none
        if self._records:
            self._send()
        if self._starting is not None:
            await self._starting
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        proc.stdin.close()
        try:
            if self._reader is not None:
                await asyncio.wait_for(asyncio.shield(self._reader), CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the trace exporter did not finish in %.0f s; stopped", CLOSE_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


# ---- the exporter process -------------------------------------------------------------------

async def _serve(endpoint: str, protocol: str, writer_name: str) -> None:
    from appliance.observability.otlpexport import SpanExport

    module, _, name = writer_name.partition(":")
    writer_cls = getattr(importlib.import_module(module), name)
    writer = writer_cls()
    export = SpanExport(endpoint, protocol, writer_cls.resource, writer_cls.scope,
                        encode=writer.encode)
    spans = writer_cls.spans
    export.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    told = dict(export.counts)

    def report() -> None:
        lines = [f"{k} {v - told[k]}\n" for k, v in export.counts.items() if v != told[k]]
        if lines:
            with contextlib.suppress(OSError):  # the proxy is gone: nobody to tell
                out.write("".join(lines).encode())
                out.flush()
            told.update(export.counts)

    async def reporting() -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            report()

    reporter = asyncio.create_task(reporting())
    decode = msgspec.msgpack.Decoder(list[Any]).decode
    try:
        while True:
            try:
                head = await reader.readexactly(FRAME.size)
                body = await reader.readexactly(FRAME.unpack(head)[0])
            except asyncio.IncompleteReadError:
                break  # the proxy closed the pipe, or is gone
            for record in decode(body):
                export.add(record, spans(record))
    finally:
        reporter.cancel()
        await export.close()
        report()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit("usage: python -m appliance.observability.exportproc ENDPOINT "
                         "PROTOCOL MODULE:WRITER")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                                                      "%(message)s")
    # A Ctrl-C or a service manager's SIGTERM reaches the proxy's whole group: this process
    # ends when the proxy does, as its pipe closes, once it has sent what the proxy gave it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_serve(*args))


if __name__ == "__main__":
    main()
