"""The prefix index as the proxy uses it: a request's lookup (`Lookup`: each node's cached
share of its prompt) and the cache that answers it (`PrefixCache`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from appliance.proxy.prefix import hashing
from appliance.proxy.prefix.events import KVEvents
from appliance.proxy.prefix.index import PrefixIndex
from appliance.proxy.prefix.tokenizer import Checks, InProcess, TokenizerUnavailable
from appliance.proxy.prefix.tokens import token_ids, tokenize_body
from appliance.sidechannel.curve import CurveKey

log = logging.getLogger("appliance.proxy.prefix")

# Prompts up to this many tokens (estimated) are tokenized on the proxy's loop (at most a
# few ms); longer ones in a thread.
INLINE_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class Lookup:
    """A prompt's exact tokens and, per node URL, how many of them its cache holds (and
    how many blocks the index knows it holds in all)."""

    tokens: int
    cached: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    tokenize_s: float = 0.0  # what asking for the prompt's ids took (0: it was ids)
    # The external hashes of the prompt's full blocks that an engine caches (all but the
    # last token's), and the block size.
    hashes: tuple[int, ...] = ()
    block_size: int = 0
    # Per node URL, the cached tokens its events alone show (`cached` adds the blocks of
    # prompts it computes now); None: the same as `cached` (a lookup made by hand).
    stored: dict[str, int] | None = None

    def on(self, url: str) -> int:
        return self.cached.get(url, 0)

    def lacking(self, url: str) -> tuple[int, ...]:
        """The prompt's full-block hashes when `url` lacked some of them at the lookup (a
        pull there brings them), else none."""
        held = self.cached if self.stored is None else self.stored
        return () if held.get(url, 0) >= len(self.hashes) * self.block_size else self.hashes


class PrefixCache:
    def __init__(self, session: aiohttp.ClientSession, headers: dict[str, str],
                 nodes: Callable[[], Iterable[str]], seed: str, resync_s: float,
                 tokenize_timeout_s: float, tokenizer: str | None = None,
                 block_size: int | None = None, key: CurveKey | None = None) -> None:
        self.session = session
        # The engines' block size as configured: lookups predict (and `expect`) before the
        # first KV event; until then, a burst of one prefix would compute it on every node.
        self.block_size = block_size
        self.headers = headers
        self.index = PrefixIndex(seed)
        self.events = KVEvents(self.index, nodes, session, headers, resync_s, key=key)
        self.timeout = aiohttp.ClientTimeout(total=tokenize_timeout_s)
        self.tokenize_failures = 0
        self.local: InProcess | None = None
        self.checks = Checks()
        self._checking: set[asyncio.Task[None]] = set()
        if tokenizer is not None:
            try:
                self.local = InProcess(tokenizer)
                log.info("prompts are tokenized in process with %s's tokenizer (chat "
                         "template: %s)", tokenizer,
                         "yes" if self.local.template is not None else "none, D's /tokenize")
            except TokenizerUnavailable as exc:
                log.warning("prompts are tokenized by a D's /tokenize, not in process: %s", exc)

    def start(self) -> None:
        self.events.start()

    async def stop(self) -> None:
        for task in list(self._checking):
            task.cancel()
        await self.events.stop()

    async def lookup(self, body: dict[str, Any], route: str, estimate: int, ask: str,
                     nodes: Sequence[str]) -> Lookup | None:
        """None when nothing can be predicted: no block size (none given, no event yet),
        no block held anywhere while none was given, a prompt shorter than one block, or
        its tokens not to be had (asked of `ask`'s /tokenize)."""
        if self.block_size is None and not self.index.has_blocks():
            return None
        size = self.index.block_size(nodes) or self.block_size
        if size is None or estimate < size // 2:  # estimates err; a block's worth is cheap
            return None
        what = tokenize_body(body, route)
        if what is None:
            return None
        started = time.monotonic()
        ids = what if isinstance(what, list) else await self._in_process(ask, what, estimate)
        if ids is None and isinstance(what, dict):
            ids = await self._tokenize(ask, what)
        if ids is None:
            return None
        took = time.monotonic() - started
        hashes = [hashing.external(h) for h in hashing.chain(ids, size, self.index.seed)]
        # vLLM computes a prompt's last token even when every block is cached.
        most = (len(ids) - 1) // size
        return self.recount(Lookup(len(ids), tokenize_s=took, hashes=tuple(hashes[:most]),
                                   block_size=size), nodes)

    def recount(self, lookup: Lookup, nodes: Sequence[str]) -> Lookup:
        """The lookup's counts as the index has them now: a request placed while this one
        waited (its tokenize, admission) may compute the same prefix (`expect`)."""
        size, hashes = lookup.block_size, lookup.hashes
        counts = {url: self.index.cached_and_expected(url, hashes) for url in nodes}
        return replace(lookup, cached={url: c[1] * size for url, c in counts.items()},
                       held={url: self.index.blocks_held(url) for url in nodes},
                       stored={url: c[0] * size for url, c in counts.items()})

    def expect(self, url: str, lookup: Lookup) -> None:
        """`url` computes this prompt now: until `unexpect`, a lookup counts its blocks as
        cached there (appliance.proxy.prefix.index)."""
        self.index.expect(url, lookup.hashes)

    def unexpect(self, url: str, lookup: Lookup) -> None:
        self.index.unexpect(url, lookup.hashes)

    def holds(self, url: str, hashes: Sequence[int]) -> bool:
        """Whether `url`'s engine caches every one of these blocks now (its KV events)."""
        return bool(hashes) and self.index.cached_blocks(url, hashes) >= len(hashes)

    async def _in_process(self, ask: str, what: dict[str, Any],
                          estimate: int) -> list[int] | None:
        """The ids by the proxy's own tokenizer (None: it has none, or cannot render this
        prompt as vLLM would); some are checked against `ask`'s /tokenize afterwards. A
        long prompt is tokenized in a thread: about 2 ms per 1,000 tokens would hold every
        other request's stream."""
        local = self.local
        if local is None:
            return None
        ids = (local.ids(what) if estimate <= INLINE_TOKENS
               else await asyncio.to_thread(local.ids, what))
        kind = "chat" if "messages" in what else "completion"
        if ids is not None and self.checks.due(kind):
            task = asyncio.create_task(self._check(ask, what, kind, ids))
            self._checking.add(task)
            task.add_done_callback(self._checking.discard)
        return ids

    async def _check(self, ask: str, what: dict[str, Any], kind: str, ids: list[int]) -> None:
        engine = await self._tokenize(ask, what)
        if engine is None or self.local is None or self.checks.compare(kind, ids, engine):
            return
        self.local = None
        log.warning("the proxy's tokenizer differs from %s's /tokenize (%s): prompts are "
                    "tokenized by a D from now on", ask, self.checks.differed)

    async def _tokenize(self, url: str, what: dict[str, Any]) -> list[int] | None:
        try:
            async with self.session.post(f"{url}/tokenize", json=what, headers=self.headers,
                                         timeout=self.timeout) as resp:
                if resp.status == 200:
                    return token_ids(await resp.json(content_type=None))
                log.debug("tokenize on %s answered %d", url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("tokenize on %s failed: %s", url, exc)
        self.tokenize_failures += 1
        return None

    def _tokenizer_state(self) -> dict[str, Any]:
        where = "proxy" if self.local is not None else "decode"
        return {"where": where, "checked": self.checks.agreed,
                **({"differed": self.checks.differed} if self.checks.differed else {})}

    def forget(self, url: str, why: str) -> None:
        self.index.drop(url, why)

    def describe(self) -> dict[str, Any]:
        return {"nodes": self.index.describe(), "tokenize_failures": self.tokenize_failures,
                "tokenizer": self._tokenizer_state(),
                "undecodable_batches": self.events.undecodable}
