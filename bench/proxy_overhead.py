"""What the proxy costs: the same load sent straight to D and through the proxy, in one run.

    python bench/proxy_overhead.py [--seconds 3] [--concurrency 1 64] [--auth] [--tracing]
        [--tracing-protocol grpc|http/protobuf] [--tracing-sample R] [--null]
        [--compare-ref GIT_REF] [--proxy-arg ARG ...]

Fake P (with its bootstrap) and fake D are aiohttp servers on loopback that answer at once
(D streams 16 SSE events when asked to; a stream goes P first, then D, the proxy's
first-token mode), each in its own process; proxies measured side by side (--tracing,
--auth, --compare-ref) meet lean fakes (llhttp, canned bytes) so that the proxy's core is
their limit, not the fakes' (every row shows how busy the other cores were). The proxy runs
in its own process, pinned to a core of its own when there are two or more (--no-pin: not);
the load generator is a small keep-alive HTTP/1.1 client on raw asyncio sockets, so that it
stays cheap. Direct and proxied load alternate in short slices, so that other work on a shared
machine weighs on both alike. Prints added latency (p50, p99), the proxy's requests per
second as a ratio of direct-to-D, and each server's CPU time per request.
Targets: <= 0.6 ms added at p50 at concurrency 1; >= 50% of direct throughput at 64.
--tracing: also a proxy exporting a trace per request (OTLP/HTTP or gRPC, to a receiver
process that answers at once) against itself with tracing paused (PUT /admin/tracing between
slices): >= 95% of its req/s at concurrency 64 and at most 0.1 ms more p50 at 1. It
switches every 0.1 s (--window) under one unbroken load and reads the median of paired
windows' ratios; both sides the same read within 1-2% this way. Its span exporter is a
process of its own (appliance.observability.exportproc); pinned, it shares the other cores,
as everything but the proxy does.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gitref  # bench/gitref.py, beside this script
from overhead_load import (
    CLIENT_KEY,
    KEYED_PORTS,
    Result,
    Switched,
    compare,
    compare_switched,
    cpu_seconds,
)
from overhead_servers import CHUNKS

ROOT = Path(__file__).resolve().parent.parent
SERVERS = str(Path(__file__).resolve().parent / "overhead_servers.py")


# ---- orchestration -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"127.0.0.1:{port}{path} did not answer 200 in {timeout:.0f} s")


def _spawn(args: list[str], cpus: set[int] | None, log: Path,
           cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
    with log.open("wb") as out:  # a file, not a pipe nobody drains
        return subprocess.Popen([sys.executable, *args], cwd=cwd, preexec_fn=pin,
                                stdout=out, stderr=subprocess.STDOUT)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Arm:
    """Another proxy measured against this one in alternating slices, or one proxy measured
    two ways (`switch(side)` before each slice changes it: side 1 is the arm's way)."""

    label: str  # its column name
    port: int
    proc: subprocess.Popen[bytes]
    title: str
    now_over_it: bool  # the ratio shown: this proxy's req/s over its (True), or its over ours
    min_ratio: float | None = 0.90  # None: shown, not judged
    max_added_p50_ms: float | None = None  # at concurrency 1, its p50 over this proxy's
    switch: Callable[[int], None] | None = None


def _set_tracing(port: int, enabled: bool) -> None:
    """PUT /admin/tracing on a proxy of this host (the admin API takes loopback callers
    when the node has no key)."""
    body = f'{{"enabled": {"true" if enabled else "false"}}}'.encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PUT /admin/tracing HTTP/1.0\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = b"".join(iter(lambda: s.recv(65536), b""))
    if answer.split(b"\r\n", 1)[0].split(b" ")[1:2] != [b"200"]:
        raise RuntimeError(f"PUT /admin/tracing: {answer[:300]!r}")


def _trace_spans(port: int) -> dict[str, float]:
    """The traced proxy's span counts by outcome (pd_proxy_trace_spans_total): a dropped
    span would make tracing look cheaper than it is."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    prefix = 'pd_proxy_trace_spans_total{outcome="'
    return {outcome: float(n) for outcome, _, n in (
        line[len(prefix):].partition('"} ') for line in text.splitlines()
        if line.startswith(prefix))}


def _busy(*results: Result) -> str:
    """How busy the cores other than the proxy's were in each side's slices."""
    if any(r.busy is None for r in results):
        return "-"
    return " / ".join(f"{r.busy:.0%}" for r in results)


_EXTRA: tuple[str, ...] = ()  # --proxy-arg: every proxy's


def _proxy_args(port: int, p_port: int, b_port: int, d_port: int, *extra: str) -> list[str]:
    return ["-m", "appliance.proxy", "--host", "127.0.0.1", "--port", str(port),
            "--prefill", f"http://127.0.0.1:{p_port},http://127.0.0.1:{b_port}",
            "--decode", f"http://127.0.0.1:{d_port}", "--health-interval", "1",
            "--no-log-requests", "--log-level", "WARNING", *_EXTRA, *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=4,
                    help="alternating direct/proxied slices per cell")
    ap.add_argument("--window", type=float, default=0.1, metavar="SECONDS",
                    help="a proxy measured two ways (--tracing) switches every WINDOW")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="give the proxy a core of its own, the rest the other cores (the "
                         "target's terms); --no-pin on a machine busy with other work")
    ap.add_argument("--auth", action="store_true",
                    help="also a keyed proxy (client key, key to P and D, bootstrap token) "
                         "against the open one, side by side")
    ap.add_argument("--tracing", action="store_true",
                    help="also a proxy exporting a trace per request (to a receiver process) "
                         "against the untraced one, side by side")
    ap.add_argument("--tracing-protocol", choices=("grpc", "http/protobuf"),
                    default="http/protobuf", help="how the traced proxy exports")
    ap.add_argument("--null", action="store_true",
                    help="with --tracing: also the traced proxy paused on both sides, "
                         "measured the same way (the measure's noise floor)")
    ap.add_argument("--tracing-sample", type=float, default=1.0, metavar="RATIO",
                    help="the traced proxy's --otlp-traces-sample-ratio (default 1)")
    ap.add_argument("--compare-ref", metavar="GIT_REF",
                    help="also the proxy as of another commit (a git worktree of it), side by "
                         "side: the before/after of a change")
    ap.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                    help="passed to every proxy measured (repeat it; for example "
                         "--proxy-arg=--split --proxy-arg=never: every request on D alone)")
    args = ap.parse_args()
    global _EXTRA
    _EXTRA = tuple(args.proxy_arg)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    cpus = sorted(os.sched_getaffinity(0))
    # The proxy gets a core of its own; everything else shares the rest.
    pin = args.pin and len(cpus) > 1
    proxy_cpus = {cpus[-1]} if pin else None
    other_cpus = set(cpus[:-1]) if pin else None
    p_port, b_port, d_port, x_port, k_port, r_port = (_free_port() for _ in range(6))
    logs = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    procs = [
        _spawn([SERVERS, "--fake", str(p_port), str(b_port)], other_cpus, logs / "p.log"),
        _spawn([SERVERS, "--fake", str(d_port), "0"], other_cpus, logs / "d.log"),
        _spawn(_proxy_args(x_port, p_port, b_port, d_port), proxy_cpus, logs / "proxy.log"),
    ]
    # Proxies side by side meet lean fakes (overhead_servers.run_lean_fake), and so does a
    # proxy of this commit's, untraced and open, that the keyed and the older one are held
    # against: then the proxy's core is the limit, not the other cores (Result.busy shows
    # how busy they were). The traced proxy is held against itself, paused.
    lp_port, lb_port, ld_port, lx_port = (_free_port() for _ in range(4))
    lean: subprocess.Popen[bytes] | None = None
    if args.auth or args.tracing or args.compare_ref:
        procs += [_spawn([SERVERS, "--fake", str(lp_port), str(lb_port), "--lean"],
                         other_cpus, logs / "lean-p.log"),
                  _spawn([SERVERS, "--fake", str(ld_port), "0", "--lean"], other_cpus,
                         logs / "lean-d.log")]
    if args.auth or args.compare_ref:
        lean = _spawn(_proxy_args(lx_port, lp_port, lb_port, ld_port), proxy_cpus,
                      logs / "lean-proxy.log")
        procs.append(lean)
    arms: list[Arm] = []
    if args.auth:
        KEYED_PORTS.add(k_port)
        proc = _spawn(_proxy_args(k_port, lp_port, lb_port, ld_port, "--api-key", CLIENT_KEY,
                                  "--backend-api-key", "bench-node-key"),
                      proxy_cpus, logs / "keyed.log")
        procs.append(proc)
        arms.append(Arm("keyed", k_port, proc, "keyed proxy (client key checked, node key "
                        "sent upstream) against the open one", now_over_it=False))
    traced_port: int | None = None
    traced: subprocess.Popen[bytes] | None = None
    if args.tracing:
        rx_port = _free_port()
        grpc = args.tracing_protocol == "grpc"
        procs.append(_spawn([SERVERS, "--otlp-receiver", str(rx_port), *["--grpc"] * grpc],
                            other_cpus, logs / "otlp.log"))
        endpoint = f"http://127.0.0.1:{rx_port}{'' if grpc else '/v1/traces'}"
        t_port = traced_port = _free_port()
        proc = _spawn(_proxy_args(t_port, lp_port, lb_port, ld_port, "--otlp-traces-endpoint",
                                  endpoint, "--otlp-traces-protocol", args.tracing_protocol,
                                  "--otlp-traces-sample-ratio", str(args.tracing_sample)),
                      proxy_cpus, logs / "traced.log")
        procs.append(proc)
        traced = proc
        # One process, tracing paused and resumed between slices (PUT /admin/tracing):
        # two processes, even identical ones, differ by up to 4% on this kind of machine.
        arms.append(Arm("traced", t_port, proc, f"traced proxy ({args.tracing_sample:.0%} of "
                        f"requests, exported over OTLP/{'gRPC' if grpc else 'HTTP'}) against "
                        "itself with tracing paused between slices",
                        now_over_it=False, min_ratio=0.95, max_added_p50_ms=0.1,
                        switch=lambda side, port=t_port: _set_tracing(port, bool(side))))
        if args.null:
            arms.append(Arm("paused", t_port, proc, "the traced proxy paused on both sides "
                            "(the measure's own noise)", now_over_it=False, min_ratio=None,
                            switch=lambda side, port=t_port: _set_tracing(port, False)))
    worktree: Path | None = None
    if args.compare_ref:
        worktree = gitref.checkout(args.compare_ref, logs / "ref")
        proc = _spawn(_proxy_args(r_port, lp_port, lb_port, ld_port), proxy_cpus,
                      logs / "ref.log", cwd=worktree)
        procs.append(proc)
        arms.append(Arm(args.compare_ref, r_port, proc, f"this proxy against itself as of "
                        f"{args.compare_ref}", now_over_it=True))
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    try:
        _wait_http(p_port, "/health")
        _wait_http(d_port, "/health")
        _wait_http(x_port, "/health")
        if arms:
            _wait_http(lp_port, "/health")
            _wait_http(ld_port, "/health")
        if lean is not None:
            _wait_http(lx_port, "/health")
        for arm in arms:
            _wait_http(arm.port, "/health")
        if other_cpus and traced is not None:
            # The traced proxy's span exporter (a process of its own) shares the other
            # cores, as everything but the proxy does.
            for pid in _children(traced.pid):
                os.sched_setaffinity(pid, other_cpus)
        rows = []
        against: list[tuple[Arm, bool, int, Result, Result, Switched | None]] = []
        started = time.monotonic()
        for stream in (False, True):
            for c in args.concurrency:
                direct, proxied = compare((d_port, procs[1].pid), (x_port, procs[2].pid),
                                          c, args.seconds, stream, args.rounds, other_cpus)
                rows.append((stream, c, direct, proxied))
                for arm in arms:
                    if arm.switch is None:  # against the lean proxy, in slices
                        assert lean is not None
                        against.append((arm, stream, c, *compare(
                            (lx_port, lean.pid), (arm.port, arm.proc.pid), c, args.seconds,
                            stream, args.rounds, other_cpus), None))
                    else:  # against itself, switched between windows of one load
                        sw = compare_switched(arm.port, arm.proc.pid, arm.switch, c,
                                              args.seconds, stream, args.window,
                                              watch=other_cpus)
                        against.append((arm, stream, c, *sw.sides, sw))
        wall = time.monotonic() - started
        spans = {} if traced_port is None else _trace_spans(traced_port)
        # The exporter's CPU (on the other cores), per request the traced proxy served.
        exporter_cpu = 0.0 if traced is None else sum(
            cpu_seconds(pid) for pid in _children(traced.pid))
    except BaseException:
        console.print(f"[red]bench failed; process logs in {logs}[/]")
        raise
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    table = Table(title=f"proxy overhead ({len(cpus)} CPUs; proxy pinned to "
                        f"{sorted(proxy_cpus) if proxy_cpus else 'any'}; "
                        f"{args.seconds:g} s per cell in {args.rounds} alternating slices)")
    for col in ("mode", "conc", "direct p50 ms", "proxy p50 ms", "added p50 ms",
                "added p99 ms", "direct req/s", "proxy req/s", "ratio", "target",
                "direct: D CPU µs/req", "proxy CPU µs/req", "other cores busy"):
        table.add_column(col, justify="right")
    verdicts = []
    for stream, c, direct, proxied in rows:
        added50 = (proxied.pct(0.5) - direct.pct(0.5)) * 1000
        added99 = (proxied.pct(0.99) - direct.pct(0.99)) * 1000
        ratio = proxied.rps / direct.rps
        if c == 1:
            ok, target = added50 <= 0.6, "<= 0.6 ms p50"
        elif c >= 64:
            ok, target = ratio >= 0.50, ">= 50%"
        else:
            ok, target = True, "-"
        verdicts.append(ok)
        table.add_row(
            f"stream ({CHUNKS} ev)" if stream else "json", str(c),
            f"{direct.pct(0.5) * 1000:.2f}", f"{proxied.pct(0.5) * 1000:.2f}",
            f"{added50:.2f}", f"{added99:.2f}", f"{direct.rps:,.0f}", f"{proxied.rps:,.0f}",
            f"{ratio:.0%}", f"[green]{target} ok[/]" if ok else f"[red]{target} MISSED[/]",
            f"{(direct.cpu_per_req or 0) * 1e6:.0f}", f"{(proxied.cpu_per_req or 0) * 1e6:.0f}",
            _busy(direct, proxied))
    console.print(table)
    for arm in arms:
        ratio_name = f"now/{arm.label}" if arm.now_over_it else f"{arm.label}/now"
        how = (f"the median of {args.window:g} s windows paired, pooled in brackets"
               if arm.switch else "alternating slices")
        t = Table(title=f"{arm.title}, {how}")
        for col in ("mode", "conc", "now p50 ms", f"{arm.label} p50 ms", "now req/s",
                    f"{arm.label} req/s", ratio_name, "target", "now CPU µs/req",
                    f"{arm.label} CPU µs/req", "other cores busy"):
            t.add_column(col, justify="right")
        for a_, stream, c, now, it, sw in against:
            if a_ is not arm:
                continue
            if sw is not None:  # the median of paired windows' ratios
                ratio = 1 / sw.rps_ratio if arm.now_over_it else sw.rps_ratio
            else:
                ratio = now.rps / it.rps if arm.now_over_it else it.rps / now.rps
            ok, target = ((True, "-") if arm.min_ratio is None
                          else (ratio >= arm.min_ratio, f">= {arm.min_ratio:.0%}"))
            if arm.max_added_p50_ms is not None and c == 1:  # judged on its latency alone
                added = (it.pct(0.5) - now.pct(0.5)) * 1000
                ok = added <= arm.max_added_p50_ms
                target = f"p50 +{added:.2f} <= {arm.max_added_p50_ms} ms"
            verdicts.append(ok)
            t.add_row(f"stream ({CHUNKS} ev)" if stream else "json", str(c),
                      f"{now.pct(0.5) * 1000:.2f}", f"{it.pct(0.5) * 1000:.2f}",
                      f"{now.rps:,.0f}", f"{it.rps:,.0f}",
                      f"{ratio:.0%}" + (f" ({it.rps / now.rps:.0%})" if sw else ""),
                      f"[green]{target} ok[/]" if ok else f"[red]{target} MISSED[/]",
                      f"{(now.cpu_per_req or 0) * 1e6:.0f}", f"{(it.cpu_per_req or 0) * 1e6:.0f}",
                      _busy(now, it))
        console.print(t)
    if spans:
        exported = spans.get("exported", 0)
        console.print(f"the traced proxy's spans: {exported:,.0f} exported, "
                      f"{spans.get('dropped', 0):,.0f} dropped; its span exporter took "
                      f"{exporter_cpu / max(1, exported) * 1e6:.1f} µs of CPU (on the other "
                      f"cores) per span, three per request")
    if worktree is not None:
        gitref.remove(worktree)
    console.print(f"load phase {wall:.0f} s; CPU per request is the server process's own "
                  f"(fake D direct, the proxy through it); the proxy makes two upstream "
                  f"requests per request. Load average now: "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sys.exit(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()
