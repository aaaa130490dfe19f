"""P and D on two "hosts": network namespaces joined by a veth pair, KV over Mooncake TCP
between them. The driver runs inside D's namespace (those addresses exist only there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

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

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                 reason="needs root and iproute2")]


async def test_two_hosts_equal_plain_server(tiny_model, plain_server, tmp_path):
    prompts = [token_prompt(n, seed=50 + n) for n in (20, 64, 300)]
    expected = []
    for prompt in prompts:
        result = await plain_request(plain_server, "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        expected.append(result["choices"][0]["token_ids"])

    with two_namespaces() as (ns_p, ns_d, ip_p, ip_d):
        def in_ns(ns: str, argv: list[str]) -> list[str]:
            return ["ip", "netns", "exec", ns, *argv]

        # Each side's connector names P's bootstrap sidecar. Secure as pdctl runs it: the
        # hosts share one set of keys; D pulls only through P's sidecar, over CURVE, and P
        # writes only into the Mooncake session at the address D's request came from.
        node_keys = keys.ensure(tmp_path / "keys")
        secure = {"secure": True, "keys_dir": node_keys.dir,
                  "connector_extra": dict(TEST_CONNECTOR)}
        spec_p = NodeSpec(model=tiny_model, host=ip_p, **secure)
        spec_d = NodeSpec(model=tiny_model, host=ip_d, bootstrap_port=8998, **secure)
        bootstrap = f"http://{ip_p}:8998"
        def vllm(name: str, ns: str, ip: str, port: int, spec: NodeSpec, role: str,
                 cpu: int) -> ServiceProcess:
            config = spec.kv_transfer_config(role).replace(spec.bootstrap_url, bootstrap)
            guard = ("--middleware", GUARD) if role == "kv_consumer" else ()
            argv = vllm_serve_argv(tiny_model, port, host=ip, served_model_name="tiny",
                                   block_size=CPU_BLOCK_SIZE, max_model_len=2048,
                                   extra=(*CPU_SERVE_FLAGS, *guard), kv_transfer_config=config)
            return ServiceProcess(name, in_ns(ns, argv), tmp_path / f"{name}.log",
                                  env={**cpu_env(str(cpu), ip),
                                       API_KEY_FILE_ENV: str(node_keys.api_key)}, cpus=[cpu])

        services = [
            ServiceProcess("bootstrap", in_ns(ns_p, [sys.executable, "-m", "appliance.bootstrap",
                                                     "--host", ip_p, "--port", "8998",
                                                     "--token-file",
                                                     str(node_keys.bootstrap_token)]),
                           tmp_path / "bootstrap.log"),
            vllm("prefill", ns_p, ip_p, 8010, spec_p, "kv_producer", 0),
            vllm("decode", ns_d, ip_d, 8020, spec_d, "kv_consumer", 1),
        ]
        for svc in services:
            svc.start()
        try:
            args = {"prefill": f"http://{ip_p}:8010", "decode": f"http://{ip_d}:8020",
                    "bootstrap": bootstrap, "prompts": prompts, "timeout": 300,
                    "api_key": keys.read(node_keys.api_key)}
            res = subprocess.run(in_ns(ns_d, [sys.executable, "-m",
                                              "tests.e2e.two_host_driver", json.dumps(args)]),
                                 capture_output=True, text=True, timeout=600,
                                 cwd=str(ROOT))
            assert res.returncode == 0, res.stderr[-3000:] + "\n".join(
                s.log_tail(30) for s in services)
            assert json.loads(res.stdout.strip().splitlines()[-1]) == expected
            sent = (tmp_path / "prefill.log").read_text()
            assert sent.count("sent p_req=") == len(prompts)
            assert f"session {ip_p}:" in sent  # P's Mooncake engine lives on P's host
            assert "rejected side-channel message" not in sent
        finally:
            for svc in reversed(services):
                svc.stop()
