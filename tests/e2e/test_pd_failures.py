"""Failure paths that need a node of their own: the prefill server dies mid-way."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from tests.e2e.conftest import TEST_CONNECTOR, pd_request, plain_request, running_node, token_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def doomed_node(tiny_model, tmp_path_factory):
    with running_node(tiny_model, tmp_path_factory.mktemp("doomed-node"), bootstrap_ttl=3,
                      connector_extra={**TEST_CONNECTOR, "register_interval_s": 1}) as node:
        yield node


async def test_prefill_killed_while_decode_waits(doomed_node, plain_server):
    """P dies while D waits for its KV: D's request still finishes (recomputed locally)
    within the receive deadline, equal to a plain server's answer, and P drops out of the
    bootstrap once its registration expires."""
    body = {"model": "tiny", "prompt": token_prompt(120, seed=41), "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}
    expected = await plain_request(plain_server, "/v1/completions", body)
    start = time.monotonic()
    pending = asyncio.create_task(pd_request(doomed_node, "/v1/completions", body,
                                             send_p=False))
    await asyncio.sleep(1.0)
    doomed_node.prefill.stop(timeout=0.1)  # SIGTERM, then SIGKILL the whole group
    got, _ = await pending
    assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert time.monotonic() - start < 8 + 10
    deadline = time.monotonic() + 10
    url = doomed_node.spec.bootstrap_url + "/query"
    while json.load(urllib.request.urlopen(url, timeout=5)):
        assert time.monotonic() < deadline, "dead prefill engine still in /query"
        await asyncio.sleep(0.5)
