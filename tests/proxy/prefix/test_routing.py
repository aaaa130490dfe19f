"""Which P and D a request goes to with the prefix index: cache_aware (the default) and the
SGLang gateway's rule on the same index; without a lookup both are round robin."""

from __future__ import annotations

from appliance.proxy.nodes.backends import Backend
from appliance.proxy.placement.routing import (
    SGLANG_BALANCE_ABS,
    CacheAwareDecode,
    CacheAwarePrefill,
    Router,
    SGLangCacheAware,
)
from appliance.proxy.prefix.cache import Lookup


def _nodes(role: str, *loads: int, queued: tuple[int, ...] = ()) -> list[Backend]:
    out = []
    for i, load in enumerate(loads):
        b = Backend(role, f"http://{role}{i}", healthy=True, in_flight=load)
        b.prefill_tokens = queued[i] if queued else 0
        out.append(b)
    return out


def _lookup(tokens: int, **cached: int) -> Lookup:
    return Lookup(tokens, {f"http://{k}": v for k, v in cached.items()},
                  {f"http://{k}": v // 32 for k, v in cached.items()})


def test_decode_goes_where_the_prompt_is_cached_within_the_load_band():
    d = _nodes("decode", 3, 1, 0)
    # decode0 caches most but has 3 more requests than the least loaded: out of the band.
    assert CacheAwareDecode().pick(d, _lookup(512, decode0=480, decode1=256)).url == \
        "http://decode1"
    d[0].in_flight = 2  # within the band now (least 0 + 2)
    assert CacheAwareDecode().pick(d, _lookup(512, decode0=480, decode1=256)).url == \
        "http://decode0"
    # Nothing cached anywhere: the least loaded.
    assert CacheAwareDecode().pick(d, _lookup(512)).url == "http://decode2"


def test_prefill_goes_where_least_is_left_to_compute():
    p = _nodes("prefill", 0, 0, queued=(0, 1000))
    # prefill1 caches the prompt but has 1,000 tokens queued: 1000 + 2 x 32 > 2 x 512.
    assert CacheAwarePrefill().pick(p, _lookup(512, prefill1=480)).url == "http://prefill0"
    p[1].prefill_tokens = 900  # 900 + 64 < 1024: the saved work outweighs the queue
    assert CacheAwarePrefill().pick(p, _lookup(512, prefill1=480)).url == "http://prefill1"


def test_without_a_lookup_in_turn_and_ties_go_round():
    router = Router("cache_aware")
    d = _nodes("decode", 0, 0)
    assert [router.pick_decode(d).url for _ in range(4)] == ["http://decode0", "http://decode1"] * 2
    # A lookup that finds nothing cached: the least loaded, equals in turn.
    assert [router.pick_decode(d, _lookup(64)).url for _ in range(4)] == \
        ["http://decode0", "http://decode1"] * 2
    d[0].in_flight = 1
    assert router.pick_decode(d, _lookup(64)).url == "http://decode1"


def test_sglangs_rule():
    rule = SGLangCacheAware()
    nodes = _nodes("decode", 0, 0, 0)
    # Balanced, best match over 0.3 of the prompt: the best match.
    assert rule.pick(nodes, _lookup(100, decode1=64)).url == "http://decode1"
    # Best match at 0.3 or less: the node caching least (the smallest tree).
    nodes_held = _lookup(100, decode0=25, decode1=0, decode2=0)
    held = {"http://decode0": 20, "http://decode1": 10, "http://decode2": 3}
    assert rule.pick(nodes, Lookup(100, nodes_held.cached, held)).url == "http://decode2"
    # Imbalanced (max - min over 64 and max over 1.5x min): the least loaded, cache or not.
    nodes = _nodes("decode", SGLANG_BALANCE_ABS + 10, 5, 9)
    assert rule.pick(nodes, _lookup(100, decode0=96)).url == "http://decode1"
