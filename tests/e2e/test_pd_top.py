"""What an SRE sees of a loaded node: the proxy's client-side histograms counted right
against real vLLM streams, and `pdctl top` as a person sees it in a terminal (tmux)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from appliance.pdctl.node.status import metric_samples, sum_samples
from tests.e2e.observe import stream_load

PDCTL = str(Path(sys.executable).parent / "pdctl")


def _proxy_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    import urllib.request

    return metric_samples(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_client_histograms_count_every_streamed_token(pd_node, route: str) -> None:
    """16 tokens asked (EOS ignored): the output-token histogram counts 16 per stream, the
    ITL one 15 gaps, whichever path the stream took (P's token first, or D's alone)."""
    url = pd_node.spec.proxy_url
    before = _proxy_samples(url)
    body = ({"messages": [{"role": "user", "content": "count with me"}]}
            if route.endswith("chat/completions") else {"prompt": "count with me"})
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(url + route, json={
                    "model": "tiny", **body, "max_tokens": 16, "ignore_eos": True,
                    "stream": True}) as r:
                assert r.status == 200
                await r.read()
    after = _proxy_samples(url)

    def grew(name: str) -> float:
        return (sum_samples(after, name) or 0.0) - (sum_samples(before, name) or 0.0)

    assert grew("pd_proxy_output_tokens_sum") == 48
    assert grew("pd_proxy_output_tokens_count") == 3
    assert grew("pd_proxy_client_itl_seconds_count") == 45
    assert grew("pd_proxy_client_ttft_seconds_count") == 3
    assert grew("pd_proxy_client_e2e_seconds_count") == 3
    assert grew("pd_proxy_decode_leg_seconds_count") == 3


def _rate(screen: str) -> float:
    """The frame's requests per second (the row under the header with req/s); 0 if none."""
    lines = screen.splitlines()
    at = next((n for n, line in enumerate(lines) if "req/s" in line), None)
    if at is None or at + 1 >= len(lines) or not lines[at + 1].split():
        return 0.0
    try:
        return float(lines[at + 1].split()[0])
    except ValueError:
        return 0.0


def _tmux(server: str, *args: str) -> subprocess.CompletedProcess[str]:
    # A tmux server of the test's own (-L: its socket name; no config), never the user's.
    return subprocess.run(["tmux", "-L", server, "-f", "/dev/null", *args],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux not installed (install.sh --dev installs it as root)")
async def test_pdctl_top_shows_a_loaded_node_and_quits_on_ctrl_c(pd_node) -> None:
    url = pd_node.spec.proxy_url
    server = f"pdtop-{os.getpid()}"
    stop = asyncio.Event()
    load = asyncio.create_task(stream_load(url, stop))
    try:
        await asyncio.sleep(2)  # the load runs: the first window sees it
        res = await asyncio.to_thread(_tmux, server, "new-session", "-d", "-x", "180", "-y",
                                      "30",
                                      # the pane's size, not one this process inherited
                                      f"env -u COLUMNS -u LINES {PDCTL} top --proxy {url}")
        assert res.returncode == 0, res.stderr
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            await asyncio.sleep(1)
            screen = (await asyncio.to_thread(_tmux, server, "capture-pane", "-p")).stdout
            # a frame over a window that saw requests end (one window of about a second
            # can fall where none did, on a machine this busy)
            if "window 1." in screen and "decode" in screen and _rate(screen) > 0:
                break
        assert "req/s" in screen and "TTFT p50/p99 ms" in screen, screen
        assert pd_node.spec.prefill_url in screen and pd_node.spec.decode_url in screen, screen
        assert "split" in screen and "window 1." in screen, screen
        assert _rate(screen) > 0, screen  # requests per second, under load
        frame = await asyncio.to_thread(subprocess.run, [PDCTL, "top", "--proxy", url, "--json"],
                                        capture_output=True, text=True, timeout=60)
        assert frame.returncode == 0, frame.stderr
        numbers = json.loads(frame.stdout)
        assert numbers["requests_per_s"] > 0 and numbers["ttft_p50_ms"] > 0, numbers
        assert numbers["errors_per_s"] == 0, numbers
        nodes = {n["role"]: n for n in numbers["nodes"]}
        assert nodes["prefill"]["up"] and nodes["decode"]["up"], numbers
        assert "kv_usage" in nodes["decode"] and "transfers_per_s" in nodes["prefill"], numbers
        # Ctrl-C ends the view: its pane, and so the session, go away.
        await asyncio.to_thread(_tmux, server, "send-keys", "C-c")
        deadline = time.monotonic() + 15
        while (await asyncio.to_thread(_tmux, server, "has-session")).returncode == 0:
            assert time.monotonic() < deadline, "pdctl top did not quit on Ctrl-C"
            await asyncio.sleep(0.3)
    finally:
        stop.set()
        await load
        await asyncio.to_thread(_tmux, server, "kill-server")
