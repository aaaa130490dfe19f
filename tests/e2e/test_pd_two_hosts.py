"""P and D on two "hosts": network namespaces joined by a veth pair, KV over Mooncake TCP
between them. The drivers (and the proxy) run inside D's namespace (those addresses exist
only there). The link is then cut while transfers run, and restored."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance import keys
from appliance.keys import API_KEY_FILE_ENV
from appliance.localnode import GUARD, NodeSpec
from appliance.process import (
    CPU_BLOCK_SIZE,
    CPU_SERVE_FLAGS,
    ServiceProcess,
    cpu_env,
    vllm_serve_argv,
)
from tests.conftest import ROOT
from tests.connector.test_transport import two_namespaces
from tests.e2e.conftest import TEST_CONNECTOR, plain_request, token_prompt
from tests.faults.launch import fault_env, faulty_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                 reason="needs root and iproute2")]


DELAY_MS = 1500  # P's writes start this late (tests.faults): a cut lands mid-transfer
BOUND_S = 15  # D's recv_timeout_s is 30 here


@dataclass
class TwoHosts:
    ns_p: str
    ns_d: str
    ip_p: str
    ip_d: str
    keys: keys.NodeKeys
    log_dir: Path
    services: list[ServiceProcess]

    @property
    def bootstrap(self) -> str:
        return f"http://{self.ip_p}:8998"

    def run_driver(self, module: str, args: dict) -> dict | list:
        res = subprocess.run(["ip", "netns", "exec", self.ns_d, sys.executable, "-m", module,
                              json.dumps(args)],
                             capture_output=True, text=True, timeout=600, cwd=str(ROOT))
        assert res.returncode == 0, res.stderr[-3000:] + "\n".join(
            s.log_tail(30) for s in self.services)
        return json.loads(res.stdout.strip().splitlines()[-1])


def _in_ns(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


@pytest.fixture(scope="module")
def two_hosts(tiny_model, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("two-hosts")
    with two_namespaces() as (ns_p, ns_d, ip_p, ip_d):
        # Each side's connector names P's bootstrap sidecar. Secure as pdctl runs it: the
        # hosts share one set of keys; D pulls only through P's sidecar, over CURVE, and P
        # writes only into the Mooncake session at the address D's request came from.
        node_keys = keys.ensure(tmp_path / "keys")
        connector = {**TEST_CONNECTOR, "recv_timeout_s": 30}
        secure = {"secure": True, "keys_dir": node_keys.dir, "connector_extra": connector}
        spec_p = NodeSpec(model=tiny_model, host=ip_p, **secure)
        spec_d = NodeSpec(model=tiny_model, host=ip_d, bootstrap_port=8998, **secure)
        bootstrap = f"http://{ip_p}:8998"

        def vllm(name: str, ns: str, ip: str, port: int, spec: NodeSpec, role: str,
                 cpu: int, faults: str = "") -> ServiceProcess:
            config = spec.kv_transfer_config(role).replace(spec.bootstrap_url, bootstrap)
            env: dict[str, str] = {}
            if faults:  # tests.faults' connector, with this plan
                config, env = faulty_config(config), fault_env(faults)
            guard = ("--middleware", GUARD) if role == "kv_consumer" else ()
            argv = vllm_serve_argv(tiny_model, port, host=ip, served_model_name="tiny",
                                   block_size=CPU_BLOCK_SIZE, max_model_len=2048,
                                   extra=(*CPU_SERVE_FLAGS, *guard), kv_transfer_config=config)
            return ServiceProcess(name, _in_ns(ns, argv), tmp_path / f"{name}.log",
                                  env={**cpu_env(str(cpu), ip),
                                       API_KEY_FILE_ENV: str(node_keys.api_key), **env},
                                  cpus=[cpu])

        proxy = [sys.executable, "-m", "appliance.proxy", "--host", ip_d, "--port", "8000",
                 "--prefill", f"http://{ip_p}:8010,{bootstrap}",
                 "--decode", f"http://{ip_d}:8020", "--health-interval", "0.5",
                 "--split", "always",  # every request's KV crosses the link
                 "--backend-api-key-file", str(node_keys.api_key), "--bootstrap-token-file",
                 str(node_keys.bootstrap_token), "--side-channel-key-file",
                 str(node_keys.side_channel_key)]
        services = [
            ServiceProcess("bootstrap", _in_ns(ns_p, [sys.executable, "-m",
                                                      "appliance.bootstrap", "--host", ip_p,
                                                      "--port", "8998", "--token-file",
                                                      str(node_keys.bootstrap_token)]),
                           tmp_path / "bootstrap.log"),
            vllm("prefill", ns_p, ip_p, 8010, spec_p, "kv_producer", 0,
                 f"write_delay_ms={DELAY_MS}"),
            vllm("decode", ns_d, ip_d, 8020, spec_d, "kv_consumer", 1),
            ServiceProcess("proxy", _in_ns(ns_d, proxy), tmp_path / "proxy.log"),
        ]
        for svc in services:
            svc.start()
        try:
            yield TwoHosts(ns_p, ns_d, ip_p, ip_d, node_keys, tmp_path, services)
        finally:
            for svc in reversed(services):
                svc.stop()


async def test_two_hosts_equal_plain_server(two_hosts, plain_server):
    h = two_hosts
    prompts = [token_prompt(n, seed=50 + n) for n in (20, 64, 300)]
    expected = []
    for prompt in prompts:
        result = await plain_request(plain_server, "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        expected.append(result["choices"][0]["token_ids"])
    args = {"prefill": f"http://{h.ip_p}:8010", "decode": f"http://{h.ip_d}:8020",
            "bootstrap": h.bootstrap, "prompts": prompts, "timeout": 300,
            "api_key": keys.read(h.keys.api_key)}
    assert h.run_driver("tests.e2e.two_host_driver", args) == expected
    sent = (h.log_dir / "prefill.log").read_text()
    assert sent.count("sent p_req=") == len(prompts)
    assert f"session {h.ip_p}:" in sent  # P's Mooncake engine lives on P's host
    assert "rejected side-channel message" not in sent


async def test_link_cut_while_transfers_run_and_restored(two_hosts, plain_server):
    """The proxy (on D's host) loses P with the link: D's calls waiting on P's KV are asked
    again alone, each with a plain server's output; restored, P serves again."""
    h = two_hosts
    prompts = [token_prompt(30 + 13 * i, seed=1300 + i) for i in range(6)]
    expected = [(await plain_request(plain_server, "/v1/completions", {
        "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}))["choices"][0]["text"]
        for p in prompts]
    dev = "v" + h.ns_d.split("-")[1] + "b"  # D's end of the veth pair
    out = h.run_driver("tests.e2e.link_cut_driver", {
        "proxy": f"http://{h.ip_d}:8000", "dev": dev, "prompts": prompts, "timeout": 300,
        "prefill": f"http://{h.ip_p}:8010", "decode": f"http://{h.ip_d}:8020"})
    assert isinstance(out, dict)
    print(f"link cut: answered in {out['cut_s']:.1f} s, {out['moved']:.0f} asked again alone;"
          f" restored: P in rotation after {out['recovered_s']:.1f} s, blocks free after "
          f"{out['freed_s']:.1f} s more")
    for (status, text, took), want in zip(out["answers"], expected, strict=True):
        assert (status, text) == (200, want)
        assert took < BOUND_S
    assert out["moved"] >= 1
    assert out["after"][:2] == [200, expected[0]] and out["after_from_p"]
