"""Producer (P) worker side: serve decode nodes' transfer requests by pushing KV into them.

docs/protocol.md steps 4 (ROUTER side channel registered with the bootstrap), 14/22/27 (a transfer
waits until its prefill is computed and the decode node's metadata has arrived), 28-31
(descriptors, batch write, FINISH reply, finished_sending).

Everything here runs on the side-channel loop; vLLM's worker thread only enqueues calls
(`on_ready`, `on_finished`, `on_aborted`, `on_released`; `on_preempted` waited for) and
reads `take_finished`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from appliance.bootstrap.client import BootstrapClient, BootstrapError
from appliance.bootstrap.wire import Registration
from appliance.connector.planning.descriptors import build_group_descriptors
from appliance.connector.planning.plan import PlanError, Region
from appliance.connector.planning.tpplan import Leg, leg_for
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel import guard
from appliance.connector.sidechannel.layout import layout_from_wire
from appliance.connector.sidechannel.registration import keep_registered
from appliance.connector.spans import TransferSpans
from appliance.connector.stats import TransferStats
from appliance.connector.transfers.digest import Slice, digest_cpu, sent_slices
from appliance.connector.transfers.ledger import Ledger
from appliance.connector.transfers.outgoing import Outgoing, write
from appliance.connector.transfers.state import TransferState
from appliance.connector.transfers.transport import TransferError, Transport
from appliance.deadlines import write_by_s
from appliance.netaddr import host_port, url_host
from appliance.sidechannel import curve
from appliance.sidechannel import messages as m

log = logging.getLogger("vllm.appliance.connector.transfers.sender")


class Sender(Ledger):
    def __init__(self, settings: ConnectorSettings, transport: Transport,
                 regions: list[Region], host: str, tp_rank: int, tp_size: int, dp_rank: int,
                 stats: TransferStats, thread_init: Callable[[], None] | None = None,
                 total_heads: int | None = None,
                 digester: Callable[[list[Slice]], int | None] = digest_cpu) -> None:
        self._key = curve.load(settings.side_channel_key_file)  # a bad file fails start-up
        self._internal = guard.networks(settings.internal_networks)
        self._curve: curve.CurveServer | None = None
        self.spans = TransferSpans("prefill", settings.engine_id, tp_rank)
        self.settings = settings
        self.transport = transport
        self.regions = regions
        self.host = host
        self.tp_rank, self.tp_size, self.dp_rank = tp_rank, tp_size, dp_rank
        self.total_heads = total_heads  # the model's KV heads; 0: MLA; None: unknown
        self.stats = stats
        self._digester = digester  # numpy over CPU KV, torch on the GPU (digest.py)
        Ledger.__init__(self)
        self._layouts: OrderedDict[tuple[str, int], list[Region]] = OrderedDict()
        # thread_init binds each push thread to the worker's GPU (Mooncake's copies and the
        # fence's event run there; a thread left on device 0 fails or lands on the wrong GPU
        # for TP ranks > 0).
        self._pool = ThreadPoolExecutor(settings.num_workers, thread_name_prefix="pd-push",
                                        initializer=thread_init)
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._bootstrap = BootstrapClient(settings.bootstrap_addr, settings.bootstrap_token)
        self.side_channel_addr = ""
        self._tasks: list[asyncio.Task] = []

    # --- start-up (protocol step 4)-------------------------------------------------------

    async def start(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.settings.max_message_bytes)  # memory bound
        if self._key is not None:  # before bind: no handshake may precede the ZAP handler
            self._curve = curve.CurveServer(sock, self._key, self.stats.record_rejected)
        port = sock.bind_to_random_port(f"tcp://{url_host(self.host)}")
        self._sock = sock
        self.side_channel_addr = f"tcp://{host_port(self.host, port)}"
        self._tasks = [asyncio.create_task(self._listen()),
                       asyncio.create_task(keep_registered(
                           self._bootstrap, self._registration(), self.settings)),
                       asyncio.create_task(self._expire_loop())]
        return self.side_channel_addr

    def _registration(self) -> Registration:
        return Registration(engine_id=self.settings.engine_id, addr=self.side_channel_addr,
                            dp_rank=self.dp_rank, tp_rank=self.tp_rank, pp_rank=0,
                            tp_size=self.tp_size)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.tp_rank == 0:
            try:
                await asyncio.wait_for(self._bootstrap.delete(self.settings.engine_id), 2)
            except (BootstrapError, asyncio.TimeoutError):
                pass
        await self._bootstrap.close()
        if self._curve is not None:
            self._curve.close()
        if self._sock is not None:
            self._sock.close(0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- calls from vLLM's worker thread (via the loop) ------------------------------------

    def on_ready(self, req_id: str, transfer_id: str, block_ids: list[list[int]],
                 fence: Callable[[], None] | None) -> None:
        """The prompt's KV is computed (once `fence` returns): protocol step 27, one step early."""
        t = self.by_transfer.get(transfer_id)
        if t is not None and t.p_req_id is not None and t.p_req_id != req_id:
            # Two prefill requests carry one transfer id: refuse the second.
            dup = Outgoing(transfer_id=transfer_id, p_req_id=req_id)
            dup.fail("transfer_id already used by another prefill request", p_req=req_id)
            self.by_req[req_id] = dup
            return
        if t is None:
            if transfer_id in self._seen:
                # Over before this prefill finished (released, cancelled, expired), or the
                # id was used before: either way nobody will pull this KV.
                dup = Outgoing(transfer_id=transfer_id, p_req_id=req_id)
                dup.fail(f"transfer already over ({self._seen[transfer_id]}); not sent",
                         p_req=req_id)
                self.by_req[req_id] = dup
                return
            t = self.by_transfer[transfer_id] = Outgoing(transfer_id=transfer_id)
        t.p_req_id, t.block_ids, t.fence = req_id, [list(g) for g in block_ids], fence
        t.deadline = time.monotonic() + self.settings.send_timeout_s
        self.by_req[req_id] = t
        t.ready.set()

    def on_preempted(self, req_ids: set[str]) -> None:
        """vLLM preempted these prefills after their KV was computed and freed the blocks;
        it recomputes them, and on_ready comes again with new blocks. A transfer not being
        written yet waits for those; one being written is failed once its write ends."""
        for req_id in req_ids:
            t = self.by_req.get(req_id)
            if t is None or t.state.terminal:
                continue  # written and answered already: from the blocks before the free
            if t.writing:
                t.preempted = True
            else:  # not written yet, or between two decode ranks' legs: the new blocks
                t.block_ids, t.fence = None, None
                t.ready.clear()
            log.info("p_req=%s transfer=%s preempted after its prefill (%s)", req_id,
                     t.transfer_id, t.state.value)

    def on_finished(self, req_ids: set[str]) -> None:
        """The scheduler holds these requests' blocks until we report them (protocol steps
        23, 32)."""
        for req_id in req_ids:
            t = self.by_req.get(req_id)
            if t is None:
                log.error("p_req %s finished but has no transfer; freeing its blocks", req_id)
                self._report(req_id)
                continue
            t.scheduler_finished = True
            if t.state.terminal:
                self._retire(t)

    def on_aborted(self, transfer_ids: set[str]) -> None:
        """The prefill request ended before its KV existed: fail its decode node now."""
        for transfer_id in transfer_ids:
            t = self.by_transfer.pop(transfer_id, None)
            reason = "prefill request ended before its KV was computed"
            self._remember(transfer_id, reason)
            if t is not None and t.fail(reason, d_req=t.d_req_id):
                t.ready.set()  # wakes _serve, which answers the decode node

    def on_released(self, transfer_ids: set[str],
                    why: str = "released by the prefill request") -> None:
        """No decode node will ask for these: free the blocks now instead of after
        send_timeout_s. From the scheduler (the request stopped at its first token and the
        proxy answered from P) and from the side channel (D's request never ran, or the
        proxy saw D never get it)."""
        for transfer_id in transfer_ids:
            t = self.by_transfer.get(transfer_id)
            if t is None:
                self._remember(transfer_id, why)
            elif t.d_req_id is None and t.state is TransferState.WAITING_FOR_INPUT:
                t.advance(TransferState.SUCCESS, p_req=t.p_req_id, released=True)
                t.ready.set()
                self._settle(t)
            # else a decode node asked after all: its transfer goes on and settles itself
            # (or that node's own cancel ends it).

    # --- the side channel (protocol steps 21-22, 30)--------------------------------------

    async def _listen(self) -> None:
        assert self._sock is not None
        while True:
            identity, frame = await self._recv()
            if identity is None or frame is None:
                continue
            msg = guard.admit(frame, self.settings.max_message_bytes,
                              self.settings.max_message_entries, self._internal)
            if isinstance(msg, guard.Rejection):  # counted, logged, answered ERROR; no more
                asyncio.create_task(self._reply(identity, msg.record(self.stats)))
                continue
            try:
                if isinstance(msg, m.CancelRequest):
                    self._cancel(identity, msg)
                else:
                    self._accept(identity, msg)
            except Exception:  # noqa: BLE001 - the listener must outlive any one message
                log.exception("side-channel message from %s not handled", msg.engine_id)

    async def _recv(self) -> tuple[bytes | None, zmq.Frame | None]:
        assert self._sock is not None
        frames = await self._sock.recv_multipart(copy=False)  # frames know their peer
        if len(frames) != 2:
            log.warning("dropped side-channel message with %d frames", len(frames))
            return None, None
        return frames[0].bytes, frames[1]

    async def _reply(self, identity: bytes, resp: m.TransferResponse) -> None:
        assert self._sock is not None
        await self._sock.send_multipart([identity, m.encode_response(resp)])

    def _accept(self, identity: bytes, msg: m.TransferRequest) -> None:
        key = (msg.engine_id, msg.layout_id)
        if msg.layout is not None:
            self._layouts[key] = layout_from_wire(msg.layout)
            while len(self._layouts) > 256:
                self._layouts.popitem(last=False)
        dst_regions = self._layouts.get(key)
        d_ids = {e.d_req_id: "layout unknown" for e in msg.reqs}
        if dst_regions is None:
            asyncio.create_task(self._reply(identity, m.TransferResponse(
                status=m.Status.LAYOUT_MISS, failed=d_ids, layout_id=msg.layout_id)))
            return
        if problem := guard.check_blocks(msg, dst_regions):  # also against a cached layout
            why = guard.Rejection("blocks", problem, msg)
            asyncio.create_task(self._reply(identity, why.record(self.stats)))
            return
        try:
            leg = leg_for(self.tp_rank, self.tp_size, msg.tp_rank, msg.tp_size,
                          self.total_heads, self.regions, dst_regions)
        except PlanError as exc:
            problem = str(exc)
            self.stats.record_failure()
            log.warning("rejected transfer request from %s: %s", msg.engine_id, problem)
            asyncio.create_task(self._reply(identity, m.TransferResponse(
                status=m.Status.ERROR, failed={k: problem for k in d_ids}, message=problem)))
            return
        for entry in msg.reqs:
            asyncio.create_task(self._serve(identity, msg.session_id, leg, entry))

    async def _serve(self, identity: bytes, session: str, leg: Leg,
                     entry: m.ReqEntry) -> None:
        digest: int | None = None
        try:
            ok, why, digest = await self._push(session, leg, entry)
        except Exception as exc:  # noqa: BLE001 - a bug must not strand blocks or D
            log.exception("push of transfer %s failed unexpectedly", entry.transfer_id)
            ok, why = False, f"internal error: {exc!r}"
            t = self.by_transfer.get(entry.transfer_id)
            if t is not None and t.fail(why, d_req=entry.d_req_id):
                t.ready.set()
                self._settle(t)
        digests = {entry.d_req_id: digest} if ok and digest is not None else {}
        resp = (m.TransferResponse(status=m.Status.FINISH, ok=[entry.d_req_id],
                                   digests=digests) if ok else
                m.TransferResponse(status=m.Status.FINISH, failed={entry.d_req_id: why}))
        await self._reply(identity, resp)

    async def _push(self, session: str, leg: Leg,
                    entry: m.ReqEntry) -> tuple[bool, str, int | None]:
        tid, d_req = entry.transfer_id, entry.d_req_id
        # Leave D a margin: a write must be over before D's deadline, not merely started.
        now = time.monotonic()
        d_wait_s = entry.deadline_ms / 1000 if entry.deadline_ms else 0.0
        write_by = now + write_by_s(d_wait_s) if d_wait_s else float("inf")
        if tid in self._seen:
            why = f"transfer {tid} is over ({self._seen[tid]}); transfer_id seen twice?"
            return False, why, None
        t = self.by_transfer.get(tid)
        if t is None:  # D arrived before the prefill finished (protocol step 22)
            t = self.by_transfer[tid] = Outgoing(transfer_id=tid)
            # Wait for the prefill as long as D waits for it (appliance.deadlines): giving
            # up sooner would have D recompute a prompt this node is still computing.
            t.deadline = now + max(self.settings.send_timeout_s, d_wait_s)
        if leg.d_rank in t.asked or len(t.asked) >= t.legs or (
                t.d_req_id is not None and t.d_req_id != d_req):
            return False, f"transfer_id {tid} already requested by {t.d_req_id}", None
        t.d_req_id, t.legs = d_req, leg.pullers
        t.asked.add(leg.d_rank)
        t.write_by = min(t.write_by, write_by)  # no batch of its write starts later
        if not any(entry.block_ids):  # D needs no KV (aborted, or a local cache hit)
            t.served.add(leg.d_rank)
            if t.state is TransferState.WAITING_FOR_INPUT and t.all_served:
                t.advance(TransferState.SUCCESS, p_req=t.p_req_id, d_req=d_req, released=True)
            if t.state.terminal:
                self._settle(t)
            return True, "", None
        await t.ready.wait()
        while t.state is not TransferState.FAILED and t.block_ids is None:
            await t.ready.wait()  # preempted between the wake-up and now: the new blocks
        if t.state is TransferState.FAILED:
            self._settle(t)
            return False, t.error or "failed", None
        assert t.block_ids is not None
        if time.monotonic() > t.write_by:
            t.fail("the decode node's deadline passed before the KV was ready",
                   p_req=t.p_req_id, d_req=d_req)
            self._settle(t)
            return False, t.error or "deadline", None
        if t.state is TransferState.WAITING_FOR_INPUT:
            t.advance(TransferState.TRANSFERRING, p_req=t.p_req_id, d_req=d_req)
        t.writing += 1
        started = time.monotonic()
        span = {"pd.p_req": t.p_req_id or "", "pd.d_req": d_req, "pd.d_rank": leg.d_rank,
                "pd.blocks": sum(map(len, entry.block_ids))}
        try:
            descs = build_group_descriptors(leg.src, leg.dst, t.block_ids, entry.block_ids)
            fence = t.fence
            summed = None
            if entry.digest:  # D checks what lands: what we wrote, at D's addresses
                slices = sent_slices(leg.src, leg.dst, t.block_ids, entry.block_ids)
                summed = lambda: self._digester(slices)  # noqa: E731 - run in the push thread
            result, digest = await asyncio.get_running_loop().run_in_executor(
                self._pool, write, self.transport, fence, session, descs,
                self.settings.max_batch_descs, t.stop_reason, summed)
        except (PlanError, TransferError) as exc:
            self.stats.record_failure()
            self.spans.record("pd.kv_write", tid, started, span, error=str(exc))
            t.fail(str(exc), p_req=t.p_req_id, d_req=d_req)
            self._settle(t)
            return False, str(exc), None
        finally:
            t.writing -= 1
        if t.preempted or t.state is TransferState.FAILED:
            # The blocks it read were freed under it, and may hold another prompt's KV by
            # now: D must not use what arrived (it recomputes, by its load-failure policy).
            t.fail("the prefill was preempted while its KV was being written",
                   p_req=t.p_req_id, d_req=d_req)
            self._settle(t)
            return False, t.error or "preempted", None
        self.stats.record_transfer(result.nbytes, result.descriptors, result.seconds)
        self.spans.record("pd.kv_write", tid, started, {
            **span, "pd.bytes": result.nbytes, "pd.descriptors": result.descriptors,
            "pd.write_s": result.seconds, "pd.gbps": result.gbps})
        t.served.add(leg.d_rank)
        log.info("sent p_req=%s d_req=%s transfer=%s blocks=%d bytes=%d descs=%d in %.1f ms "
                 "(%.2f GB/s)%s", t.p_req_id, d_req, tid, sum(map(len, entry.block_ids)),
                 result.nbytes, result.descriptors, result.seconds * 1e3, result.gbps,
                 f" to decode tp {leg.d_rank}" if t.legs > 1 else "")
        if t.all_served:  # every decode rank that pulls from us has its heads
            t.advance(TransferState.SUCCESS)
            self._settle(t)
        return True, "", digest

    def _cancel(self, identity: bytes, msg: m.CancelRequest) -> None:
        """D gave up on these transfers: fail those not yet being written, answer for all.
        Release entries (nobody will pull: from D or the proxy) free without an answer."""
        releases = {e.transfer_id for e in msg.reqs if e.is_release}
        if releases:
            self.on_released(releases, "released: no decode request will pull it")
        failed: dict[str, str] = {}
        ok: list[str] = []
        for entry in msg.reqs:
            if entry.is_release:
                continue
            t = self.by_transfer.get(entry.transfer_id)
            if t is None or t.state is TransferState.WAITING_FOR_INPUT:
                why = "cancelled by the decode node"
                if t is not None:
                    t.fail(why, p_req=t.p_req_id, d_req=entry.d_req_id)
                    t.ready.set()
                    if t.d_req_id is None:
                        self._settle(t)  # else the waiting _push settles and answers
                else:
                    self._remember(entry.transfer_id, why)
                failed[entry.d_req_id] = "cancelled"
            elif t.state is TransferState.TRANSFERRING and t.writing:
                t.cancelled = True  # stops before its next batch; _serve answers then
            elif t.state is TransferState.TRANSFERRING:
                # Between two decode ranks' legs: nothing is being written to stop.
                t.fail("cancelled by the decode node", p_req=t.p_req_id, d_req=entry.d_req_id)
                t.ready.set()
                self._settle(t)
                failed[entry.d_req_id] = "cancelled"
            elif t.state is TransferState.SUCCESS:
                ok.append(entry.d_req_id)
            else:
                failed[entry.d_req_id] = t.error or "failed"
        if ok or failed:
            asyncio.create_task(self._reply(identity, m.TransferResponse(
                status=m.Status.FINISH, ok=ok, failed=failed)))

    async def _expire_loop(self) -> None:
        """Deadlines on what the ledger holds, checked twice a second (Ledger.expire)."""
        while True:
            await asyncio.sleep(0.5)
            for _ in range(self.expire(time.monotonic())):
                self.stats.record_expired()
