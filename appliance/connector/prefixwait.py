"""A prompt waits while another request of the same engine computes its next blocks.

vLLM puts a block in the prefix cache when it schedules the block's compute, not when the
block is computed. A request admitted meanwhile finds the blocks scheduled so far and
computes the rest of the shared prefix itself. When prefills are chunked (D's
long-prefill threshold, which applies as soon as two requests are eligible), every prompt
of a burst on a shared prefix races the first one chunk by chunk, and all of them compute
the prefix. On the kvbench model on one core, four prompts on two 768-token prefixes
computed 3,328 tokens instead of 2,048 and ended 0.8 s later (`bench/prefix_burst.py`).

Waiting costs the waiting request nothing it would not have spent: the running prefill's
chunks are scheduled first in every step, and once they are, the waiting request finds the
whole prefix cached and computes only its own tokens. A request waits only while another
one still has to compute its next block, so nothing waits for a decode, and a request
with at most one block left (a prompt cached whole but its last token) never waits. The
scheduler applies it to full-attention models only (sliding-window groups can cut a hit
short of blocks already computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm.v1.request import Request

class _Prefill(Protocol):
    """What the rule reads of a vLLM request."""

    request_id: str
    block_hashes: Sequence[object]
    num_prompt_tokens: int
    num_computed_tokens: int


def computes_next_block(hashes: Sequence[object], hit_tokens: int, prompt_tokens: int,
                        other: _Prefill, hash_block_size: int) -> bool:
    """Whether `other` still has to compute the block that follows a request's
    `hit_tokens` cached tokens (a request with `hashes` as its prompt's block hashes).

    Hashes chain (each covers its block and every block before it), so one equal hash
    means the whole prefix up to that block is shared. The block cannot be scheduled yet
    on `other`: if it were, it would be in the cache and part of the hit.
    """
    index = hit_tokens // hash_block_size
    if (index + 1) * hash_block_size >= prompt_tokens:
        return False  # one block left at most: racing for it costs less than a step
    if other.num_computed_tokens >= other.num_prompt_tokens:
        return False  # decoding: the block is computed (or was never in its prompt)
    return (index < len(hashes) and index < len(other.block_hashes)
            and other.block_hashes[index] == hashes[index])


@dataclass
class PrefillsInFlight:
    """The requests this engine admitted to compute their prompts, until they are done."""

    hash_block_size: int
    _prefills: dict[str, Request] = field(default_factory=dict)
    # A tracked request computes while admitted (WAITING in the step that admits it,
    # RUNNING after); preempted or finished, it is forgotten.
    _computing: frozenset[object] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        from vllm.v1.request import RequestStatus

        self._computing = frozenset((RequestStatus.WAITING, RequestStatus.RUNNING))

    def admitted(self, request: Request) -> None:
        """vLLM allocated the request's blocks: it computes from now on (a pull's request
        is not tracked, as its blocks are cached only once the KV has arrived)."""
        self._prune()
        if request.num_computed_tokens < request.num_prompt_tokens:
            self._prefills[request.request_id] = request

    def finished(self, request_id: str) -> None:
        self._prefills.pop(request_id, None)

    def computing_for(self, request: Request, hit_tokens: int) -> str | None:
        """The id of a running request that will compute `request`'s next uncached block,
        if any: `request` waits for it rather than computing the same prefix."""
        hashes = request.block_hashes
        if not self._prefills or len(hashes) <= hit_tokens // self.hash_block_size:
            return None
        self._prune()
        for other in self._prefills.values():
            if other.request_id != request.request_id and computes_next_block(
                    hashes, hit_tokens, request.num_prompt_tokens, other,
                    self.hash_block_size):
                return other.request_id
        return None

    def _prune(self) -> None:
        """Forget requests that finished, were preempted (they come back through
        `admitted`) or computed their prompt."""
        gone = [rid for rid, r in self._prefills.items()
                if r.status not in self._computing
                or r.num_computed_tokens >= r.num_prompt_tokens]
        for rid in gone:
            del self._prefills[rid]
