"""End to end: `pdctl up --local` brings up bootstrap + vLLM P + vLLM D + proxy on this
machine; curl-style requests and the openai client through the proxy get a plain vLLM
server's greedy answers; `pdctl status` exits 0; `pdctl down --local` (or Ctrl-C) leaves no
process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests import netlisten
from tests.conftest import MODEL_CACHE, free_port

pytestmark = pytest.mark.slow

PDCTL = str(Path(sys.executable).parent / "pdctl")


def group_members(pgids: set[int]) -> list[int]:
    """Live (not zombie) processes in any of these process groups."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
            found.append(int(entry))
    return found


def port_free(port: int) -> bool:
    """Nothing listens there (TIME_WAIT leftovers do not count, as for the servers)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class UpLocal:
    """`pdctl up --local` in the foreground of a child process, as a user runs it."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.ports = {"--port": free_port(), "--prefill-port": free_port(),
                      "--decode-port": free_port(), "--bootstrap-port": free_port()}
        self.run_dir = tmp_path / "run"
        self.log_path = tmp_path / "up.log"
        args = [PDCTL, "up", "--local", "--run-dir", str(self.run_dir),
                "--cache-dir", str(MODEL_CACHE.parent), "--timeout", "600"]
        for flag, port in self.ports.items():
            args += [flag, str(port)]
        args += extra
        self.log = self.log_path.open("w")
        # As from a terminal: Ctrl-C reaches it even when this suite runs as a background
        # job (whose shell starts it with SIGINT ignored, which children inherit).
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['--port']}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, f"pdctl up --local exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} in time:\n{self.output()}"
            time.sleep(0.5)

    def state(self) -> dict:
        return json.loads((self.run_dir / "state.json").read_text())

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            subprocess.run([PDCTL, "down", "--local", "--run-dir", str(self.run_dir)],
                           capture_output=True, timeout=180)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.load(resp)


def test_up_local_serves_like_a_plain_server_and_down_leaves_nothing(plain_server, tmp_path,
                                                                     tiny_model):
    node = UpLocal(tmp_path)
    try:
        node.wait_for("node healthy in", timeout=620)
        out = node.output()
        for step in ("bootstrap", "prefill", "decode", "registered", "proxy"):
            assert f"│ {step}" in out, out  # the time-to-healthy breakdown
        groups = {s["pid"] for s in node.state()["services"]}
        assert len(groups) == 4

        # curl-equivalent: a raw HTTP POST
        body = {"model": "tiny", "prompt": "The quick brown fox jumps over", "max_tokens": 24,
                "temperature": 0, "return_token_ids": True}
        expected = post(f"{plain_server}/v1/completions", body)
        got = post(f"{node.url}/v1/completions", body)
        assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]

        # the openai client: completions, chat, and both streamed
        ours = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0)
        ref = openai.OpenAI(base_url=f"{plain_server}/v1", api_key="unused", max_retries=0)
        prompt = "Seven red rivers run to the city at night, and"
        kw = {"model": "tiny", "max_tokens": 20, "temperature": 0}
        want = ref.completions.create(prompt=prompt, **kw).choices[0].text
        assert want and ours.completions.create(prompt=prompt, **kw).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in
                           ours.completions.create(prompt=prompt, stream=True, **kw)
                           if c.choices)
        assert streamed == want

        messages = [{"role": "system", "content": "You answer in one line."},
                    {"role": "user", "content": "Name three rivers and a mountain."}]
        want = ref.chat.completions.create(messages=messages, **kw).choices[0].message.content
        got_chat = ours.chat.completions.create(messages=messages, **kw)
        assert want and got_chat.choices[0].message.content == want
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           ours.chat.completions.create(messages=messages, stream=True, **kw)
                           if c.choices)
        assert streamed == want

        # status: every service healthy, exit 0; P's KV really moved for what was placed
        # remote (the default split is auto, timed on P at start: an idle node is answered
        # mostly by D alone)
        res = subprocess.run([PDCTL, "status", "--run-dir", str(node.run_dir), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        status = json.loads(res.stdout)
        assert status["healthy"] and status["mode"] == "local"
        assert [s["name"] for s in status["services"] if s["running"] and s["healthy"]] == \
            ["bootstrap", "prefill", "decode", "proxy"]
        assert status["engine_ids"] == ["prefill-0"]
        split = status["split"]
        # auto, timed at start through the whole split (P's prefills, each pulled by D: KV
        # moved before any client asked), then every request placed by measurement; on
        # this idle node that is mostly D alone.
        assert split["policy"] == "auto" and sum(split["last_minute"].values()) >= 5, split
        assert status["counters"].get("decode.received", 0) >= 4, status["counters"]
        assert status["counters"].get("prefill.transfers", 0) >= \
            split["last_minute"]["remote"], (status["counters"], split)
        # Five requests went through; a stream whose client hangs up right after [DONE] may
        # be counted as 499: cancelled, no failure.
        counters = status["counters"]
        assert counters["requests_ok"] >= 3 and counters["requests_failed"] == 0, counters
        assert counters["requests_ok"] + counters["requests_cancelled"] >= 5

        # secure by default: keys, and nothing on a wildcard address but Mooncake's ports
        for name in ("api-key", "bootstrap-token", "side-channel.key"):
            assert (node.run_dir / "keys" / name).stat().st_mode & 0o777 == 0o600
        found = netlisten.listeners(set(group_members(groups)))
        assert {a for a, _, _ in found} - netlisten.WILDCARDS == {"127.0.0.1"}
        for addr, port, _pid in found:
            if addr in netlisten.WILDCARDS:
                assert 17000 <= port <= 17199, f"{addr}:{port} listens on every address"
        for service in ("prefill", "decode"):
            url = node.state()["endpoints"][service] + "/v1/completions"
            req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 401, service

        # down from another shell: everything stops, the foreground `up` exits cleanly
        res = subprocess.run([PDCTL, "down", "--local", "--run-dir", str(node.run_dir)],
                             capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        assert node.proc.wait(60) == 0, node.output()
        assert group_members(groups) == []
        assert all(port_free(p) for p in node.ports.values())
        assert not (node.run_dir / "state.json").exists()
    finally:
        node.cleanup()


def test_ctrl_c_while_starting_leaves_nothing(tmp_path, tiny_model):
    node = UpLocal(tmp_path)
    try:
        node.wait_for("bootstrap healthy", timeout=120)
        groups = {s["pid"] for s in node.state()["services"]}
        node.proc.send_signal(signal.SIGINT)
        assert node.proc.wait(120) == 130, node.output()
        assert "interrupted; stopping the local node" in node.output()
        assert group_members(groups) == []
        assert not (node.run_dir / "state.json").exists()
    finally:
        node.cleanup()


def test_up_local_sizes_the_kv_cache_for_a_larger_model(tmp_path):
    """The kvbench model needs 96 MiB of KV for one 2,048-token request: a fixed 64 MiB made
    vLLM refuse to start ("... KV cache is needed, which is larger than the available KV
    cache memory"). Sized from its config.json, the node starts and serves."""
    from appliance import tinymodel

    model = tinymodel.build(MODEL_CACHE / "kvbench", "kvbench")
    node = UpLocal(tmp_path, "--model", str(model))
    try:
        node.wait_for("node healthy in", timeout=620)
        assert "KV cache 384 MiB per server (4 requests of 2048 tokens)" in node.output()
        got = post(f"{node.url}/v1/completions", {"model": "kvbench", "prompt": "A " * 600,
                                                 "max_tokens": 4, "temperature": 0})
        assert got["usage"]["completion_tokens"] == 4
        res = subprocess.run([PDCTL, "status", "--run-dir", str(node.run_dir), "--json"],
                             capture_output=True, text=True, timeout=60)
        # auto's calibration at start moved P's KV to D five times (a warm-up and four
        # timed prompts), then the request was placed by measurement.
        assert json.loads(res.stdout)["counters"]["decode.received"] >= 5
    finally:
        node.cleanup()
