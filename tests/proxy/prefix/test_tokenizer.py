"""The proxy's own tokenizer: the same ids as transformers' tokenizer and chat template for
the prompts it takes, /tokenize for the rest, and checks against a D's /tokenize that turn
it off at the first difference. (tests/e2e/test_pd_prefix_index.py checks it against a real
engine's /tokenize.)"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from appliance.proxy.prefix import hashing
from appliance.proxy.prefix.cache import PrefixCache
from appliance.proxy.prefix.tokenizer import (
    Checks,
    InProcess,
    TokenizerUnavailable,
    folder_error,
    folder_of,
)
from appliance.proxy.settings import load_settings

CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
MESSAGES = [{"role": "system", "content": "You are  terse.\n"},
            {"role": "user", "content": "héllo the quick brown fox <|im_end|> 123"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.mark.parametrize("generation", [True, False])
def test_chat_ids_are_transformers_ids(tiny_model, reference, generation):
    mine = InProcess(str(tiny_model))
    text = reference.apply_chat_template(MESSAGES, tokenize=False,
                                         add_generation_prompt=generation)
    want = reference(text, add_special_tokens=False)["input_ids"]
    assert mine.ids({"model": "tiny", "messages": MESSAGES,
                     "add_generation_prompt": generation}) == want
    if generation:  # vLLM's default for chat
        assert mine.ids({"model": "tiny", "messages": MESSAGES}) == want


def test_completion_ids_are_transformers_ids(tiny_model, reference):
    mine = InProcess(str(tiny_model))
    prompt = "the block cache holds tokens, 42 of them: <|im_start|> ünïcode  spaces\n" * 9
    assert mine.ids({"model": "tiny", "prompt": prompt}) == reference(prompt)["input_ids"]
    assert mine.ids({"model": "tiny", "prompt": prompt, "add_special_tokens": False}) == \
        reference(prompt, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"chat_template": "{{ messages }}"}, {"continue_final_message": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
    {"chat_template_kwargs": "not a mapping"}])
def test_what_it_does_not_render_goes_to_the_engine(tiny_model, extra):
    assert InProcess(str(tiny_model)).ids({"model": "tiny", "messages": MESSAGES,
                                           **extra}) is None


def test_unusable_folders_are_named(tmp_path, tiny_model):
    assert folder_error(str(tmp_path / "none")) == f"{tmp_path / 'none'} is not a folder"
    assert "has no tokenizer.json" in (folder_error(str(tmp_path)) or "")
    with pytest.raises(TokenizerUnavailable, match="not a folder"):
        InProcess(str(tmp_path / "none"))
    assert folder_of(str(tiny_model)) == str(tiny_model.resolve())
    assert folder_of("no-such-org/no-such-model") is None
    # Read where the proxy runs (not where its settings are rendered): an unusable folder
    # is warned of at its start, and D's /tokenize serves.
    flags = ["--prefill", "http://p", "--decode", "http://d", "--tokenizer"]
    assert load_settings([*flags, str(tmp_path)], environ={}).tokenizer == str(tmp_path)


def test_checks_take_the_first_prompts_of_each_kind_then_one_in_every():
    checks = Checks(first=2, every=4)
    assert [checks.due("chat") for _ in range(8)] == [True, True, False, True,
                                                      False, False, False, True]
    assert checks.due("completion")
    assert checks.compare("chat", [1, 2, 3], [1, 2, 3]) and checks.agreed == {"chat": 1}
    assert not checks.compare("chat", [1, 2, 3], [1, 5, 3, 4])
    assert checks.differed == "a chat prompt: 3 ids here, 4 from the engine, first different at 1"


class _FakeD:
    """A D's /tokenize answering with `shift` added to the true ids, counting calls."""

    def __init__(self, tokenizer: InProcess, shift: int = 0) -> None:
        self.tokenizer, self.shift, self.calls = tokenizer, shift, 0

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls += 1
        ids = self.tokenizer.ids(await request.json()) or []
        return web.json_response({"tokens": [t + self.shift for t in ids]})


async def _cache(tiny_model, shift: int) -> tuple[PrefixCache, _FakeD, TestServer]:
    fake = _FakeD(InProcess(str(tiny_model)), shift)
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    cache = PrefixCache(aiohttp.ClientSession(), {}, lambda: (), hashing.DEFAULT_SEED, 5.0,
                        1.0, str(tiny_model))
    cache.checks = Checks(first=2, every=1000)
    return cache, fake, server


async def _lookups(cache: PrefixCache, url: str, n: int) -> None:
    for i in range(n):
        body = {"model": "tiny", "prompt": f"prompt {i} " + "the cache holds tokens " * 20}
        assert await cache._in_process(url, body, 100) is not None or cache.local is None
        await asyncio.sleep(0.05)  # the checks run after the lookup, off its path


async def test_agreeing_checks_keep_it_and_ask_d_only_for_them(tiny_model):
    cache, fake, server = await _cache(tiny_model, shift=0)
    try:
        await _lookups(cache, str(server.make_url("")).rstrip("/"), 6)
        assert fake.calls == 2 and cache.local is not None
        assert cache.describe()["tokenizer"] == {"where": "proxy",
                                                   "checked": {"completion": 2}}
    finally:
        await cache.stop()
        await cache.session.close()
        await server.close()


async def test_a_difference_turns_it_off_for_good(tiny_model, caplog):
    cache, fake, server = await _cache(tiny_model, shift=1)
    url = str(server.make_url("")).rstrip("/")
    try:
        with caplog.at_level(logging.WARNING, "appliance.proxy.prefix"):
            await _lookups(cache, url, 3)
        assert cache.local is None
        state = cache.describe()["tokenizer"]
        assert state["where"] == "decode" and "first different at 0" in state["differed"]
        assert "prompts are tokenized by a D from now on" in caplog.text
        json.dumps(state)
    finally:
        await cache.stop()
        await cache.session.close()
        await server.close()


def test_the_local_node_gives_the_proxy_its_models_tokenizer(tiny_model, tmp_path):
    from appliance.localnode import LocalNode, NodeSpec

    node = LocalNode(NodeSpec(model=tiny_model, log_dir=tmp_path, proxy_port=18000))
    assert node.proxy is not None
    argv = node.proxy.argv
    assert argv[argv.index("--tokenizer") + 1] == str(tiny_model.resolve())
    # and the engines' block size, so its index predicts from the first request
    assert argv[argv.index("--kv-block-size") + 1] == \
        node.decode.argv[node.decode.argv.index("--block-size") + 1]
    # (and D's prefill chunk, the CPU stack's default; P's prefills are whole)
    d_argv, p_argv = node.decode.argv, node.prefill.argv
    assert d_argv[d_argv.index("--long-prefill-token-threshold") + 1] == "128"
    assert "--long-prefill-token-threshold" not in p_argv
    # each engine's step budget: the CPU stack's, or vLLM's own for 0
    for argv in (d_argv, p_argv):
        assert argv[argv.index("--max-num-batched-tokens") + 1] == "256"
    whole = LocalNode(NodeSpec(model=tiny_model, log_dir=tmp_path, decode_prefill_chunk=0,
                               max_num_batched_tokens=0))
    assert "--long-prefill-token-threshold" not in whole.decode.argv
    assert "--max-num-batched-tokens" not in whole.decode.argv + whole.prefill.argv


async def test_a_long_prompt_is_tokenized_off_the_loop(tiny_model, monkeypatch):
    cache, fake, server = await _cache(tiny_model, shift=0)
    threads = []

    async def to_thread(fn, *args):
        threads.append(fn)
        return fn(*args)
    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    url = str(server.make_url("")).rstrip("/")
    try:
        body = {"model": "tiny", "prompt": "the cache holds tokens " * 2000}
        ids = await cache._in_process(url, body, 8000)
        assert ids == cache.local.ids(body) and len(threads) == 1
        await cache._in_process(url, {"model": "tiny", "prompt": "short"}, 2)
        assert len(threads) == 1
    finally:
        await cache.stop()
        await cache.session.close()
        await server.close()


def test_a_folder_without_a_fast_tokenizer_leaves_it_to_d(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "appliance.proxy.prefix"):
        cache = PrefixCache(None, {}, lambda: (), hashing.DEFAULT_SEED, 5.0, 1.0,  # type: ignore[arg-type]
                            str(tmp_path))
    assert cache.local is None and "has no tokenizer.json" in caplog.text
    assert cache.describe()["tokenizer"] == {"where": "decode", "checked": {}}
