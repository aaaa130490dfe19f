"""A prompt waits while another request of the engine computes its next blocks
(appliance.connector.prefixwait), on stand-in requests: the rule, its bookkeeping, and the
scheduler hook that applies it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from appliance.connector.planning.groups import KVGroup
from appliance.connector.prefixwait import PrefillsInFlight, computes_next_block
from appliance.connector.scheduler import PDScheduler
from appliance.connector.settings import ConnectorSettings

BS = 16


def hashes(prefix: str, blocks: int, start: int = 0) -> list[bytes]:
    """Chained block hashes: equal up to where the prompts differ (the prefix's name)."""
    return [f"{prefix}:{i}".encode() for i in range(start, start + blocks)]


@dataclass
class Req:
    request_id: str
    block_hashes: list[bytes]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)


def shared(rid: str, own: str, prefix_blocks: int = 8, own_blocks: int = 2) -> Req:
    """A prompt of a shared prefix (`prefix_blocks` blocks) and blocks of its own."""
    return Req(rid, hashes("p", prefix_blocks) + hashes(own, own_blocks, prefix_blocks),
               (prefix_blocks + own_blocks) * BS + 5)


def test_a_request_waits_for_the_prefill_computing_its_next_block():
    first, second = shared("a", "x"), shared("b", "y")
    # The first was admitted with two chunks of the prefix scheduled: the second's hit.
    first.num_computed_tokens = 0
    assert computes_next_block(second.block_hashes, 2 * BS, second.num_prompt_tokens,
                               first, BS)
    # Once the whole prefix is scheduled, the hit covers it and the next block is its own.
    assert not computes_next_block(second.block_hashes, 8 * BS, second.num_prompt_tokens,
                                   first, BS)


def test_no_wait_for_a_decode_a_different_prefix_or_the_last_block():
    first, second = shared("a", "x"), shared("b", "y")
    first.num_computed_tokens = first.num_prompt_tokens  # decoding
    assert not computes_next_block(second.block_hashes, 2 * BS, second.num_prompt_tokens,
                                   first, BS)
    other = Req("c", hashes("q", 10), 10 * BS + 5)  # another prefix
    assert not computes_next_block(second.block_hashes, 2 * BS, second.num_prompt_tokens,
                                   other, BS)
    # The same prompt, cached whole but for its last block: one block to race for.
    same = Req("d", list(first.block_hashes), first.num_prompt_tokens)
    first.num_computed_tokens = 0
    assert not computes_next_block(same.block_hashes, 10 * BS, same.num_prompt_tokens,
                                   first, BS)


def test_the_bookkeeping_follows_admission_preemption_and_the_end():
    inflight = PrefillsInFlight(BS)
    first, second = shared("a", "x"), shared("b", "y")
    assert inflight.computing_for(second, 2 * BS) is None  # nothing admitted
    inflight.admitted(first)
    assert inflight.computing_for(second, 2 * BS) == "a"
    assert inflight.computing_for(first, 2 * BS) is None  # never itself
    first.status = RequestStatus.RUNNING
    assert inflight.computing_for(second, 2 * BS) == "a"
    first.status = RequestStatus.PREEMPTED  # it comes back through admitted()
    assert inflight.computing_for(second, 2 * BS) is None
    first.status = RequestStatus.RUNNING
    inflight.admitted(first)
    first.num_computed_tokens = first.num_prompt_tokens  # its prompt computed
    assert inflight.computing_for(second, 2 * BS) is None
    first.num_computed_tokens = 0
    inflight.admitted(first)
    inflight.finished("a")
    assert inflight.computing_for(second, 2 * BS) is None
    # A prompt admitted whole from the cache (or KV that arrived) computes nothing.
    done = shared("c", "z")
    done.num_computed_tokens = done.num_prompt_tokens
    inflight.admitted(done)
    assert inflight.computing_for(second, 2 * BS) is None


def _scheduler(role: str, groups: tuple[KVGroup, ...] = (KVGroup(BS),),
               **extra: Any) -> PDScheduler:
    return PDScheduler(ConnectorSettings(engine_id="e0", role=role,
                                         bootstrap_addr="http://127.0.0.1:1", **extra),
                       list(groups))


def test_the_scheduler_holds_a_local_prompt_back_in_both_roles():
    for role in ("producer", "consumer"):
        s = _scheduler(role)
        first, second = shared("a", "x"), shared("b", "y")
        s.update_state_after_alloc(first, None, 0)  # type: ignore[arg-type]
        assert s.get_num_new_matched_tokens(second, 2 * BS) == (None, False)
        assert s.get_num_new_matched_tokens(second, 8 * BS) == (0, False)
        s.request_finished(first, ([],))  # type: ignore[arg-type]
        assert s.get_num_new_matched_tokens(second, 2 * BS) == (0, False)


def test_a_pull_is_neither_tracked_nor_held_back_and_the_setting_turns_it_off():
    s = _scheduler("consumer")
    first, second = shared("a", "x"), shared("b", "y")
    s.update_state_after_alloc(first, None, 5 * BS)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens(second, 2 * BS) == (0, False)
    off = _scheduler("consumer", shared_prefix_wait=False)
    off.update_state_after_alloc(first, None, 0)  # type: ignore[arg-type]
    assert off.get_num_new_matched_tokens(second, 2 * BS) == (0, False)


def test_no_wait_on_a_model_with_sliding_window_groups():
    """A sliding-window group can cut a hit short of blocks another request computed: the
    rule stays off there rather than have a prompt wait for nothing."""
    s = _scheduler("consumer", (KVGroup(BS), KVGroup(BS, window_blocks=9)))
    first, second = shared("a", "x"), shared("b", "y")
    s.update_state_after_alloc(first, None, 0)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens(second, 2 * BS) == (0, False)
