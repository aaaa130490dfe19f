"""Scheduler side of the connector (runs in vLLM's EngineCore process).

Producer (P): computes the prompt locally, tells its worker which blocks hold the prompt's
KV as soon as the step that completes the prefill is scheduled, and holds those blocks
after the request finishes until the worker reports the transfer over (docs/protocol.md
steps 12, 23, 33).
Unlike the reference, KV is sent whatever the finish reason (EOS or a stop string as the
single token included), and a request that ends before its KV exists is reported to the
worker at once so the decode node does not wait for a timeout. With `send_on_stop: false`
(the proxy's first-token mode, where D is asked only after P answers) a request that
stopped at its first token frees its KV at once: no decode node will come for it.

Consumer (D): reports the whole prompt as an asynchronous external load, which parks the
request in WAITING_FOR_REMOTE_KVS (17); vLLM recomputes only the last prompt token once
the load is reported (37). `remote_num_tokens` says P's KV covers D's prompt less its last
token (the proxy's first-token mode appends P's token): D then pulls only those blocks;
`recv_timeout_ms` is the request's own receive deadline (appliance.deadlines); any other
value is refused (nothing pulled, the prompt computed locally, P told to free).
A request aborted while waiting keeps its blocks until the
worker knows the producer will not write into them any more.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.connector import engine_wait
from appliance.connector.metadata import PDConnectorMetadata, RecvSpec, ReleaseSpec
from appliance.connector.planning.groups import KVGroup, needed_blocks
from appliance.connector.prefixwait import PrefillsInFlight
from appliance.connector.settings import ConnectorSettings
from appliance.connector.spans import traceparent_of
from appliance.deadlines import MAX_RECV_MS

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.appliance.connector.scheduler")

REQUIRED_PULL_PARAMS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
_RECENT_PULLS = 4096


@dataclass
class _Send:
    request: Request
    transfer_id: str
    ready: bool = False  # the worker was told the KV is (about to be) computed


def _timeout_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pull_block_ids(new_blocks: list[int], held: int, covered: int,
                   block_size: int) -> list[int]:
    """D's blocks that P's KV fills when P's prompt is `covered` tokens long.

    `new_blocks` follow `held` blocks of local prefix hit. D's prompt may run past P's
    (the proxy's first-token mode appends P's token, which protocol steps 24-25 discard): D
    asks only for the blocks P holds, so P's last block lines up with D's (the sender
    right-aligns them).
    """
    keep = max(0, _cdiv(covered, block_size) - held)
    return new_blocks[:keep]


class PDScheduler:
    def __init__(self, settings: ConnectorSettings, groups: list[KVGroup],
                 hash_block_size: int | None = None) -> None:
        self.settings = settings
        self.groups = groups  # one per KV-cache group, in vLLM's order
        self.kv_cache_manager: KVCacheManager | None = None
        # Producer state.
        self._sends: dict[str, _Send] = {}
        # Consumer state: requests whose pull is in flight (blocks held for it), req_id ->
        # transfer_id, and the transfers pulled lately.
        self._recving: dict[str, str] = {}
        self._pulled: OrderedDict[str, None] = OrderedDict()
        self._meta = PDConnectorMetadata()
        # Both roles: the requests computing their prompts, which a request sharing their
        # prefix waits for (None: no wait). Their block hashes' granularity is vLLM's
        # hash_block_size (the KV cache config's), else the smallest group's block. Full
        # attention only: a sliding-window group can cut a prompt's hit short of the blocks
        # another request computed, and the rule would have it wait for nothing.
        self._prefills = (PrefillsInFlight(hash_block_size
                                           or min(g.block_size for g in groups))
                          if settings.shared_prefix_wait
                          and not any(g.window_blocks for g in groups) else None)

    # --- hooks shared by both roles -----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            if self._prefills is not None:
                other = self._prefills.computing_for(request, num_computed_tokens)
                if other is not None:
                    log.debug("req %s: waits for req %s, which computes its prefix",
                              request.request_id, other)
                    return None, False
            return 0, False
        if self.settings.is_producer:
            log.warning("req %s: do_remote_prefill sent to a producer; computing locally",
                        request.request_id)
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        problem = self._pull_params_problem(params, prompt_len)
        if problem:
            # Refused: nothing is pulled, and the request is served by a local prefill
            # rather than left waiting on a transfer that cannot (or must not) happen.
            log.warning("req %s: refused its kv_transfer_params: %s; nothing pulled, the "
                        "prompt is computed locally", request.request_id, problem)
            params["do_remote_prefill"] = False
            if self._transfer_problem(params) is None:
                self._release(params)  # P holds KV for it that nobody will pull
            return 0, False
        transfer_id = params["transfer_id"]
        if transfer_id in self._recving.values():
            # A sibling (another choice of an n > 1 request) is pulling this transfer, and P
            # serves it once: wait for it; its blocks then serve as a local prefix hit.
            return None, False
        if transfer_id in self._pulled:
            log.info("req %s: transfer %s was pulled by another request; computing the "
                     "rest of the prompt locally", request.request_id, transfer_id)
            params["do_remote_prefill"] = False
            return 0, False
        count = prompt_len - num_computed_tokens
        # Protocol step 17: the whole (uncached) prompt arrives asynchronously.
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._prefills is not None and num_external_tokens == 0:
            self._prefills.admitted(request)
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_prefill") and not self.settings.is_producer:
            params["do_remote_prefill"] = False  # one pull per request
            if num_external_tokens > 0:
                block_ids = self._pull_blocks(blocks, params.get("remote_num_tokens"))
                self._meta.recvs[request.request_id] = RecvSpec(
                    transfer_id=params["transfer_id"], block_ids=block_ids,
                    remote_engine_id=params["remote_engine_id"],
                    remote_bootstrap_addr=params["remote_bootstrap_addr"],
                    timeout_s=_timeout_s(params.get("recv_timeout_ms")))
                self._recving[request.request_id] = params["transfer_id"]
                self._trace(request, params["transfer_id"])
            else:
                # Full local prefix hit: nothing to pull, but P holds blocks for us.
                self._release(params)
        elif params.get("do_remote_decode") and self.settings.is_producer:
            transfer_id = params.get("transfer_id")
            if not transfer_id:
                log.warning("req %s: do_remote_decode without transfer_id; KV will not be "
                            "sent", request.request_id)
                return
            if request.request_id not in self._sends:  # protocol step 12
                self._sends[request.request_id] = _Send(request, transfer_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        if self.settings.is_producer:
            self._mark_ready_sends(scheduler_output)
        meta, self._meta = self._meta, PDConnectorMetadata()
        meta.idle = not scheduler_output.num_scheduled_tokens
        if not self.settings.is_producer:
            engine_wait.idle_step(meta.idle)  # this process waits for the worker's answer
        return meta

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self._prefills is not None:
            self._prefills.finished(request.request_id)
        params = request.kv_transfer_params
        if not params:
            return False, None
        req_id = request.request_id
        if self.settings.is_producer:
            send = self._sends.pop(req_id, None)
            if send is None:
                return False, None
            if send.ready:
                # Protocol step 23, whatever the finish reason: the KV exists, so it is sent
                # (or expires); the worker reports finished_sending to free the blocks.
                self._meta.finished_sends.add(req_id)
                if (params.get("send_on_stop") is False
                        and getattr(request.status, "name", "") == "FINISHED_STOPPED"):
                    # The proxy sends D only after P's answer, and a stopped answer is
                    # the whole answer: no D will ask, so free without waiting.
                    self._meta.released_sends.add(send.transfer_id)
                return True, None
            # Ended before its KV was computed (aborted, rejected): tell D now.
            self._meta.aborted_sends.add(send.transfer_id)
            return False, None
        # Consumer.
        if params.get("do_remote_prefill"):
            # Finished before it was ever scheduled: P still holds blocks for it.
            params["do_remote_prefill"] = False
            if (not self._pull_params_problem(params, len(request.prompt_token_ids or ()))
                    and params["transfer_id"] not in self._recving.values()
                    and params["transfer_id"] not in self._pulled):  # a sibling's
                self._release(params)
            return False, None
        if req_id in self._recving:
            if self._meta.recvs.pop(req_id, None) is not None:
                # Aborted before its pull reached the worker: nothing will write into its
                # blocks, so they are freed now (a cancel would name a request the worker
                # never knew); P, which holds the KV, is told.
                del self._recving[req_id]
                self._release(params)
                return False, None
            # Aborted while P may be writing into its blocks: hold them until the worker
            # reports the pull over (once: if that report is already on its way, it frees
            # them, and the worker ignores the cancel).
            self._meta.cancelled_recvs[req_id] = self._recving[req_id]
            return True, None
        return False, None

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        for req_id in finished_recving or ():
            transfer_id = self._recving.pop(req_id, None)
            if transfer_id is not None:
                self._pulled[transfer_id] = None
                while len(self._pulled) > _RECENT_PULLS:
                    self._pulled.popitem(last=False)
            # Its report frees the blocks; a cancel still queued would be a second one.
            self._meta.cancelled_recvs.pop(req_id, None)

    # --- helpers ------------------------------------------------------------------------

    def _pull_blocks(self, blocks: KVCacheBlocks, covered: int | None) -> list[list[int]]:
        """Per KV-cache group, D's blocks that P's KV fills (protocol step 18)."""
        new = blocks.get_unhashed_block_ids_all_groups()  # null placeholders left out
        everything = blocks.get_block_ids()
        out = []
        for g, group in enumerate(self.groups):
            ids = list(new[g])
            if covered is not None:
                held = len(everything[g]) - len(ids)  # prefix hits and null placeholders
                ids = pull_block_ids(ids, held, covered, group.block_size)
            out.append(ids)
        return needed_blocks(self.groups, out)

    def _mark_ready_sends(self, scheduler_output: SchedulerOutput) -> None:
        """Tell the worker which sends have their whole prompt computed by this step."""
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            send = self._sends.get(req_id)
            if send is not None and send.ready:
                # Its blocks were freed by the preemption: vLLM recomputes the prompt
                # (requires_kv_delivery), and this marks it ready again, with new blocks.
                send.ready = False
                self._meta.preempted_sends.add(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, send in self._sends.items():
            if send.ready or req_id not in scheduled:
                continue
            req = send.request
            # build_connector_meta runs before num_computed_tokens is advanced.
            if req.num_computed_tokens + scheduled[req_id] < req.num_prompt_tokens:
                continue  # chunked prefill: more chunks to come
            assert self.kv_cache_manager is not None, "kv cache manager was not bound"
            blocks = needed_blocks(self.groups, self.kv_cache_manager.get_block_ids(req_id),
                                   req.num_prompt_tokens)
            self._meta.ready_sends[req_id] = (send.transfer_id, blocks)
            self._trace(req, send.transfer_id)
            send.ready = True

    def _trace(self, request: Request, transfer_id: str) -> None:
        parent = traceparent_of(request)
        if parent is not None:
            self._meta.trace_parents[transfer_id] = parent

    def _transfer_problem(self, params: dict[str, Any]) -> str | None:
        """Why these params name no transfer this node may contact P about (None: they do,
        so P may hold KV for it)."""
        missing = [p for p in REQUIRED_PULL_PARAMS if not params.get(p)]
        if missing:
            return f"kv_transfer_params lacks {', '.join(missing)}"
        if not self.settings.bootstrap_allowed(str(params["remote_bootstrap_addr"])):
            return f"bootstrap address {params['remote_bootstrap_addr']!r} is not allowed"
        return None

    def _pull_params_problem(self, params: dict[str, Any], prompt_len: int) -> str | None:
        problem = self._transfer_problem(params)
        if problem:
            return problem
        covered = params.get("remote_num_tokens")
        if covered is not None and (type(covered) is not int or covered != prompt_len - 1):
            # The only prefix this protocol continues from: P's prompt, when D's prompt is
            # P's plus P's first token. D reports the whole prompt as loaded, so any other
            # value would leave tokens counted as computed that nobody wrote.
            return (f"remote_num_tokens={covered!r}: it must be the prompt's length less one "
                    f"({prompt_len - 1}, P's prompt before its first token)")
        wait = params.get("recv_timeout_ms")
        if wait is not None and (type(wait) not in (int, float) or not 0 < wait <= MAX_RECV_MS):
            return f"recv_timeout_ms={wait!r}: it must be a number of ms in (0, {MAX_RECV_MS}]"
        return None

    def _release(self, params: dict[str, Any]) -> None:
        self._meta.releases.append(ReleaseSpec(
            transfer_id=params["transfer_id"], remote_engine_id=params["remote_engine_id"],
            remote_bootstrap_addr=params["remote_bootstrap_addr"]))
