"""The scheduler side's bookkeeping on stand-in requests (no engine): what it hands the
worker for the proxy's first-token mode (docs/protocol.md steps 12, 18, 23)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.connector.planning.groups import KVGroup
from appliance.connector.scheduler import PDScheduler, pull_block_ids
from appliance.connector.settings import ConnectorSettings

BS = 16


class Status(enum.Enum):  # the names vLLM's RequestStatus uses
    FINISHED_STOPPED = 1
    FINISHED_LENGTH_CAPPED = 2


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    num_computed_tokens: int = 0
    status: Status = Status.FINISHED_LENGTH_CAPPED
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Blocks:
    ids: list[int]
    hashed: int = 0  # leading blocks that were a local prefix hit

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [self.ids[self.hashed:]]


@dataclass
class Manager:
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def scheduler(role: str) -> PDScheduler:
    return PDScheduler(ConnectorSettings(engine_id="e0", role=role,
                                         bootstrap_addr="http://127.0.0.1:1"), [KVGroup(BS)])


def pull_params(**extra: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": "x1", "remote_engine_id": "p0",
            "remote_bootstrap_addr": "http://127.0.0.1:1", **extra}


@pytest.mark.parametrize(("blocks", "held", "covered", "expected"), [
    ([5, 6, 7], 0, 48, [5, 6, 7]),  # D's prompt is P's + one token into a fresh block
    ([5, 6, 7, 8], 0, 48, [5, 6, 7]),  # 48 tokens fill 3 blocks; D's 49th needs a 4th
    ([5, 6, 7], 0, 33, [5, 6, 7]),  # P's last block is partly filled
    ([7, 8], 1, 48, [7, 8]),  # one block of local prefix hit
    ([9], 3, 48, []),  # the prefix hit covers all P holds
    ([4], 0, 1, [4]),
])
def test_pull_block_ids(blocks, held, covered, expected):
    assert pull_block_ids(blocks, held, covered, BS) == expected


def test_decode_pulls_only_the_blocks_the_prefill_holds():
    s = scheduler("consumer")
    # P prefilled 48 tokens (3 full blocks); D's prompt is those plus P's first token.
    req = Req("d1", list(range(49)), pull_params(remote_num_tokens=48))
    assert s.get_num_new_matched_tokens(req, 0) == (49, True)
    s.update_state_after_alloc(req, Blocks([10, 11, 12, 13]), 49)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs["d1"].block_ids == [[10, 11, 12]]


def test_decode_without_remote_num_tokens_pulls_every_prompt_block():
    s = scheduler("consumer")
    req = Req("d1", list(range(49)), pull_params())
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([10, 11, 12, 13]), 49)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs["d1"].block_ids == [[10, 11, 12, 13]]


@pytest.mark.parametrize("bad", [0, -3, "48", 1.5, True, 50, 1, 47, 49])
def test_remote_num_tokens_other_than_prompt_less_one_is_refused(bad, caplog):
    """Only P's prompt before its first token (48 of D's 49) may be continued: any other
    value would leave D counting tokens as loaded that nobody wrote. Nothing is pulled, the
    prompt is computed locally, and P is told to free the KV it holds."""
    import logging
    logger = logging.getLogger("vllm.appliance.connector.scheduler")
    logger.addHandler(caplog.handler)  # vLLM's "vllm" logger does not propagate to root
    s = scheduler("consumer")
    req = Req("d1", list(range(49)), pull_params(remote_num_tokens=bad))
    try:
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        logger.removeHandler(caplog.handler)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    s.update_state_after_alloc(req, Blocks([10, 11, 12, 13]), 0)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs == {}
    assert [r.transfer_id for r in meta.releases] == ["x1"]
    assert "remote_num_tokens" in caplog.text and "refused" in caplog.text


def test_refused_params_at_a_foreign_bootstrap_release_nothing():
    s = PDScheduler(ConnectorSettings(engine_id="e0", role="consumer",
                                      allowed_bootstrap_addrs=("http://10.0.0.1:8998",)),
                    [KVGroup(BS)])
    req = Req("d1", list(range(49)), pull_params(remote_num_tokens=3))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).releases == []


def prefill_done(s: PDScheduler, req: Req) -> None:
    """The step that computes the whole prompt is scheduled (protocol steps 12-13)."""
    s.kv_cache_manager = Manager({req.request_id: [1, 2, 3]})
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={req.request_id: req.num_prompt_tokens}))
    assert meta.ready_sends[req.request_id] == ("x1", [[1, 2, 3]])


@pytest.mark.parametrize(("send_on_stop", "status", "released"), [
    (False, Status.FINISHED_STOPPED, True),  # first-token mode, P's answer was all of it
    (False, Status.FINISHED_LENGTH_CAPPED, False),  # D comes next
    (None, Status.FINISHED_STOPPED, False),  # classic mode: D is already waiting
])
def test_prefill_stopped_at_its_first_token(send_on_stop, status, released):
    s = scheduler("producer")
    params = {"do_remote_decode": True, "transfer_id": "x1"}
    if send_on_stop is not None:
        params["send_on_stop"] = send_on_stop
    req = Req("p1", list(range(40)), params, status=status)
    prefill_done(s, req)
    # Blocks stay held either way; the worker frees them when told or when D is done.
    assert s.request_finished(req, ([1, 2, 3],)) == (True, None)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.finished_sends == {"p1"}
    assert meta.released_sends == ({"x1"} if released else set())


def _aborted(req: Req) -> Req:
    req.status = Status.FINISHED_STOPPED
    return req


def test_decode_aborted_before_its_pull_left_frees_at_once_and_releases_p():
    """Allocated and aborted within one step: the worker never heard of the pull, so the
    blocks are freed now (no cancel for a request it never knew) and P is told."""
    s = scheduler("consumer")
    req = Req("d1", list(range(40)), pull_params())
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([10, 11, 12]), 40)
    assert s.request_finished(_aborted(req), ([10, 11, 12],)) == (False, None)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs == {} and meta.cancelled_recvs == {}
    assert [r.transfer_id for r in meta.releases] == ["x1"]


def test_decode_aborted_while_pulling_holds_blocks_until_reported_once():
    s = scheduler("consumer")
    req = Req("d1", list(range(40)), pull_params())
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([10, 11, 12]), 40)
    assert "d1" in s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).recvs
    assert s.request_finished(_aborted(req), ([10, 11, 12],)) == (True, None)
    # The worker's report of the finished pull is processed before the cancel went out:
    # that report frees the blocks, so the cancel is dropped (a second report would name a
    # request vLLM has forgotten, and its scheduler asserts on that).
    s.update_connector_output({"d1"})
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.cancelled_recvs == {} and meta.releases == []


def test_decode_aborted_while_pulling_sends_the_cancel():
    s = scheduler("consumer")
    req = Req("d1", list(range(40)), pull_params())
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([10, 11, 12]), 40)
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert s.request_finished(_aborted(req), ([10, 11, 12],)) == (True, None)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.cancelled_recvs == {"d1": "x1"}


def test_prefill_preempted_after_ready_is_marked_ready_again_with_new_blocks():
    """Async scheduling: step N computes the prompt (ready), step N+1's schedule preempts
    the request before N's output is in; vLLM recomputes it into other blocks."""
    s = scheduler("producer")
    req = Req("p1", list(range(40)), {"do_remote_decode": True, "transfer_id": "x1"})
    prefill_done(s, req)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={},
                                                  preempted_req_ids={"p1", "other"}))
    assert meta.preempted_sends == {"p1"} and meta.ready_sends == {}
    s.kv_cache_manager = Manager({"p1": [7, 8, 9]})
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p1": 40},
                                                  preempted_req_ids=set()))
    assert meta.ready_sends == {"p1": ("x1", [[7, 8, 9]])} and meta.preempted_sends == set()


def test_prefill_preempted_before_ready_needs_nothing():
    s = scheduler("producer")
    req = Req("p1", list(range(40)), {"do_remote_decode": True, "transfer_id": "x1"})
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={},
                                                  preempted_req_ids={"p1"}))
    assert meta.preempted_sends == set()


def test_second_choice_waits_for_the_first_choices_pull_then_computes_locally():
    """n > 1: vLLM gives each choice its own request with the same kv_transfer_params. P
    serves a transfer once, so the second waits (None: ask again next step) while the first
    pulls, then uses the first's blocks as a local prefix hit instead of pulling again."""
    s = scheduler("consumer")
    first = Req("0_d1", list(range(40)), pull_params())
    second = Req("1_d1", list(range(40)), pull_params())
    assert s.get_num_new_matched_tokens(first, 0) == (40, True)
    s.update_state_after_alloc(first, Blocks([10, 11, 12]), 40)
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    s.update_connector_output({"0_d1"})  # the first's KV arrived
    assert s.get_num_new_matched_tokens(second, 32) == (0, False)
    assert second.kv_transfer_params["do_remote_prefill"] is False


def test_waiting_second_choice_aborted_does_not_release_the_firsts_transfer():
    s = scheduler("consumer")
    first = Req("0_d1", list(range(40)), pull_params())
    second = Req("1_d1", list(range(40)), pull_params())
    s.get_num_new_matched_tokens(first, 0)
    s.update_state_after_alloc(first, Blocks([10, 11, 12]), 40)
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    assert s.request_finished(_aborted(second), ((),)) == (False, None)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.releases == [] and "0_d1" in meta.recvs


def test_a_requests_own_receive_deadline_reaches_the_worker():
    """The proxy sends D how long to wait for this request's KV (appliance.deadlines)."""
    s = scheduler("consumer")
    req = Req("d1", list(range(49)), pull_params(recv_timeout_ms=130_000))
    assert s.get_num_new_matched_tokens(req, 0) == (49, True)
    s.update_state_after_alloc(req, Blocks([10, 11, 12, 13]), 49)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs["d1"].timeout_s == 130.0
    other = Req("d2", list(range(49)), {**pull_params(), "transfer_id": "x2"})
    s.get_num_new_matched_tokens(other, 0)
    s.update_state_after_alloc(other, Blocks([20, 21, 22, 23]), 49)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs["d2"].timeout_s is None  # the connector's recv_timeout_s


@pytest.mark.parametrize("bad", [0, -5, "9000", True, [1], 86_400_001])
def test_a_receive_deadline_that_is_not_a_sane_number_is_refused(bad):
    s = scheduler("consumer")
    req = Req("d1", list(range(49)), pull_params(recv_timeout_ms=bad))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert [r.transfer_id for r in meta.releases] == ["x1"]


def test_the_trace_context_vllm_received_goes_to_the_worker_by_transfer():
    """vLLM hands the scheduler each request's trace headers (the proxy's call span):
    the worker records the transfer under it (appliance.connector.spans)."""
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    d = scheduler("consumer")
    req = Req("d1", list(range(49)), pull_params())
    req.trace_headers = {"traceparent": tp}  # type: ignore[attr-defined]
    d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, Blocks([10, 11, 12, 13]), 49)
    assert d.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={})).trace_parents == {"x1": tp}
    assert d.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).trace_parents == {}
