"""One trace per request across proxy -> P -> transfer -> D, with real vLLM P and D
exporting to a real OTLP/HTTP receiver (pd_node's): the proxy's request span, its calls to P
and D, vLLM's own `llm_request` span under each call, P's KV write and D's pull under theirs
(bytes, GB/s), every span parented as the request ran, and the request's span within 5% of
what the client measured."""

from __future__ import annotations

import time

import aiohttp
import pytest

from tests.e2e.conftest import plain_request, text_of, token_prompt
from tests.otlp import Collector, Span

pytestmark = pytest.mark.slow

# Each span once, but vLLM's llm_request once per engine (P's and D's).
WANTED = {"pd.request": 1, "pd.prefill": 1, "pd.decode": 1, "llm_request": 2,
          "pd.kv_write": 1, "pd.kv_pull": 1}


def _one(spans: list[Span], name: str, service: str | None = None) -> Span:
    found = [s for s in spans if s.name == name and (service is None or s.service == service)]
    assert len(found) == 1, (name, service, [(s.name, s.service) for s in spans])
    return found[0]


async def test_a_split_request_is_one_trace_from_the_proxy_to_the_transfer(
        pd_node, plain_server, otlp_collector: Collector):
    body = {"model": "tiny", "prompt": token_prompt(300, seed=1500), "max_tokens": 48,
            "temperature": 0}
    want = text_of(await plain_request(plain_server, "/v1/completions", body))
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body) as r:
            answer = await r.json()
            client_s = time.monotonic() - started
            request_id = r.headers["X-Request-Id"]
    assert text_of(answer) == want
    root = next((s for s in _wait_root(otlp_collector, request_id)), None)
    assert root is not None
    spans = otlp_collector.wait(root.trace_id, WANTED)
    by_id = {s.span_id: s for s in spans}
    prefill, decode = _one(spans, "pd.prefill"), _one(spans, "pd.decode")
    assert root.parent_id == "" and prefill.parent_id == decode.parent_id == root.span_id
    # vLLM's own spans, one per engine, each under the proxy's call to it.
    engine_spans = [s for s in spans if s.name == "llm_request"]
    assert sorted(by_id[s.parent_id].name for s in engine_spans) == ["pd.decode", "pd.prefill"]
    write, pull = _one(spans, "pd.kv_write"), _one(spans, "pd.kv_pull")
    assert (write.parent_id, pull.parent_id) == (prefill.span_id, decode.span_id)
    xfer = root.attributes["pd.transfer_id"]
    assert write.attributes["pd.transfer_id"] == pull.attributes["pd.transfer_id"] == xfer
    assert write.attributes["pd.bytes"] == pull.attributes["pd.bytes"] > 0
    assert write.attributes["pd.gbps"] > 0 and not write.error and not pull.error
    # The request's span is what the client felt (within 5%), and the legs fit inside it.
    assert abs(root.seconds - client_s) <= 0.05 * client_s, (root.seconds, client_s)
    assert root.start_ns <= prefill.start_ns and decode.end_ns <= root.end_ns
    print(f"trace {root.trace_id}: client {client_s * 1e3:.0f} ms, request span "
          f"{root.seconds * 1e3:.0f} ms, P's call {prefill.seconds * 1e3:.0f} ms, write "
          f"{write.seconds * 1e3:.1f} ms ({write.attributes['pd.bytes']} B), pull "
          f"{pull.seconds * 1e3:.1f} ms, D's call {decode.seconds * 1e3:.0f} ms; "
          f"{len(spans)} spans")


def _wait_root(collector: Collector, request_id: str, timeout: float = 30) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roots = [s for s in collector.spans if s.name == "pd.request"
                 and s.attributes.get("pd.request_id") == request_id]
        if roots:
            return roots
        time.sleep(0.2)
    raise AssertionError(f"no pd.request span for {request_id}")
