"""Consumer (D) worker side: ask a producer to push a request's KV into our blocks.

docs/protocol.md steps 19-21 (resolve the producer's workers through its bootstrap sidecar, send our
Mooncake session, layout and block ids over a ZMQ DEALER) and 34-35 (a FINISH reply marks
the request received). Beyond the reference: a receive deadline, explicit ERROR handling,
releases that let the producer free KV nobody will fetch, and no write into a block given
back: on a deadline or an abort the blocks stay held until the producer answers, or until
`cancel_grace_s` past the deadline the producer was sent. The producer starts no batch after
that deadline (less a margin) and stops a write under way before its next batch, so once the
bound passes nothing it does can land here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

import zmq.asyncio

from appliance.bootstrap.client import BootstrapError
from appliance.connector.metadata import RecvSpec, ReleaseSpec
from appliance.connector.planning.plan import PlanError, Region
from appliance.connector.reports import Reports
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.layout import layout_to_wire
from appliance.connector.sidechannel.peers import Peer, Peers
from appliance.connector.sidechannel.producers import Producers
from appliance.connector.spans import TransferSpans
from appliance.connector.stats import TransferStats
from appliance.connector.transfers import digest
from appliance.connector.transfers.incoming import Incoming, remaining_ms
from appliance.connector.transfers.state import TransferState
from appliance.connector.transfers.transport import Transport
from appliance.sidechannel import curve
from appliance.sidechannel import messages as m

log = logging.getLogger("vllm.appliance.connector.transfers.receiver")


class Receiver:
    def __init__(self, settings: ConnectorSettings, transport: Transport,
                 regions: list[Region], host: str, tp_rank: int, tp_size: int,
                 stats: TransferStats, total_heads: int | None = None,
                 digester: Callable[[list[digest.Slice]], int | None] = digest.digest_cpu,
                 ) -> None:
        self._key = curve.load(settings.side_channel_key_file)  # a bad file fails start-up
        self.settings = settings
        self.transport = transport
        self.host = host
        self.regions = regions
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.stats = stats
        self._digester = digester  # numpy over CPU KV, torch on the GPU (digest.py)
        self.layout_id = secrets.randbits(63)
        self.incoming: dict[str, Incoming] = {}
        self._ctx = zmq.asyncio.Context()
        self._peers = Peers(self._ctx, self, stats, self._key, settings.peer_idle_s,
                            settings.max_peers)
        self._next_sweep = 0.0
        self.producers = Producers(settings, tp_rank, tp_size, total_heads, self._peers.gone,
                                   self._worker_replaced)
        self._reports = Reports()
        self.spans = TransferSpans("decode", settings.engine_id, tp_rank)
        self._tasks = [asyncio.create_task(self._deadline_loop())]

    # --- calls from vLLM's worker thread (via the loop) ------------------------------------

    def on_recv(self, req_id: str, spec: RecvSpec) -> None:
        wait_s = spec.timeout_s or self.settings.recv_timeout_s
        inc = Incoming(transfer_id=spec.transfer_id, d_req_id=req_id, spec=spec,
                       state=TransferState.BOOTSTRAPPING, deadline=time.monotonic() + wait_s,
                       verify=digest.chosen(self.settings.verify_kv))
        self.incoming[req_id] = inc
        asyncio.create_task(self._pull(inc))

    def on_cancel(self, req_id: str, transfer_id: str) -> None:
        """The request was aborted while waiting; its blocks stay held until P confirms."""
        inc = self.incoming.get(req_id)
        if inc is None:
            # Over and reported already: that report frees the blocks. Reporting again
            # would name a request vLLM has forgotten (its scheduler asserts on that).
            return
        if inc.state is TransferState.VERIFYING:
            # Every producer answered: nothing writes any more; the check ends it failed.
            inc.cancelled, inc.cancel_reason = True, "cancelled: the request was aborted"
            return
        if inc.state is TransferState.BOOTSTRAPPING:
            # Our block ids never left this process: nothing can write into them.
            inc.cancelled = True
            self._finish(inc, ok=False, error="cancelled before the request was sent")
            return
        self._give_up(inc, "cancelled: the request was aborted")

    def on_release(self, spec: ReleaseSpec) -> None:
        asyncio.create_task(self._release(spec))

    def take_results(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed is a subset. Waits up
        to `wait_s` for one when there is none and a pull is in flight."""
        return self._reports.take(wait_s if self.incoming else 0.0)

    # --- protocol steps 20-21 -------------------------------------------------------------

    async def _pull(self, inc: Incoming) -> None:
        spec = inc.spec
        assert spec is not None
        try:
            addrs = await self.producers.resolve(spec.remote_bootstrap_addr,
                                                 spec.remote_engine_id)
        except (BootstrapError, PlanError) as exc:
            self._finish(inc, ok=False, error=str(exc))
            return
        await self._release_unpulled(spec.remote_bootstrap_addr, spec.remote_engine_id,
                                     inc.transfer_id)
        if inc.state.terminal or inc.cancelled:
            # Aborted (or past its deadline) while we looked P up: our blocks are free
            # already, but P holds the KV for us until send_timeout_s unless told.
            self._finish(inc, ok=False, error="cancelled")
            for addr in addrs:
                await self._send_cancel(addr, m.CancelEntry.release(inc.transfer_id))
            return
        inc.waiting = set(addrs)
        inc.advance(TransferState.WAITING_FOR_INPUT, d_req=inc.d_req_id, peer=",".join(addrs))
        for addr in addrs:
            await self._send_request(inc, addr, with_layout=False)

    async def _send_request(self, inc: Incoming, addr: str, with_layout: bool) -> None:
        assert inc.spec is not None
        peer = self._peers.get(addr)
        include = with_layout or not peer.layout_sent
        msg = m.TransferRequest(
            engine_id=self.settings.engine_id, host=self.host,
            rpc_port=self.transport.rpc_port, layout_id=self.layout_id,
            reqs=[m.ReqEntry(inc.d_req_id, inc.transfer_id,
                             [list(g) for g in inc.spec.block_ids],
                             remaining_ms(inc.deadline), inc.verify)],
            tp_rank=self.tp_rank, tp_size=self.tp_size,
            layout=layout_to_wire(self.regions) if include else None)
        peer.layout_sent = True
        await peer.send(m.encode_request(msg))

    # --- replies (protocol step 34)-------------------------------------------------------

    def on_response(self, peer: Peer, resp: m.TransferResponse) -> None:
        if resp.status is m.Status.LAYOUT_MISS:
            peer.layout_sent = False  # the producer restarted or evicted our layout
            for d_req in resp.failed:
                inc = self.incoming.get(d_req)
                if inc is None or inc.state.terminal:
                    continue
                if inc.cancelled:  # the producer never took it: nothing can write
                    self._answered(inc, peer.addr, inc.cancel_reason)
                else:
                    asyncio.create_task(self._send_request(inc, peer.addr, with_layout=True))
            return
        for d_req in resp.ok:
            inc = self.incoming.get(d_req)
            if inc is not None:
                self._answered(inc, peer.addr, None, resp.digests.get(d_req))
        for d_req, why in resp.failed.items():
            inc = self.incoming.get(d_req)
            if inc is not None:
                self._answered(inc, peer.addr, f"producer: {why}")
        if resp.status is m.Status.ERROR and not resp.failed:
            log.warning("producer %s rejected a request: %s", peer.addr, resp.message)

    def on_peer_refused(self, peer: Peer, why: str) -> None:
        """The producer at `peer` refused our handshake: none of our requests reached it,
        so none of its writes can land in our blocks. Its pulls fail now (vLLM's load-failure
        policy recomputes them), the socket and what it queued go, and the next request
        looks the producer up and connects again."""
        self.stats.record_rejected("handshake")
        log.error("side channel to %s refused: %s; check side_channel_key_file is the same "
                  "on every host (pdctl init --rotate-keys rotates them all); its pulls are "
                  "computed here", peer.addr, why)
        self._peers.close(peer, f"refused: {why}")
        self.producers.forget(peer.addr)
        for inc in list(self.incoming.values()):
            if peer.addr in inc.waiting:
                self._answered(inc, peer.addr, f"side channel to {peer.addr} refused: {why}")

    def _sweep(self, busy: set[str], now: float) -> None:
        """Closes lost, idle and surplus sockets, and forgets them as workers' addresses."""
        for addr in self._peers.sweep(busy, now):
            self.producers.forget(addr)

    def on_peer_lost(self, peer: Peer) -> None:
        """The link to a producer worker dropped: it died (a restart binds a new port) or
        the network cut it. Its address is looked up again before the next pull (and while
        it has not come back, the sidecar is asked again when it names it), so a restarted P
        costs that pull no wait; with no pull waiting on it the socket goes now (the sweep's
        rule). Pulls waiting on it end (vLLM's load-failure policy) once cancel_grace_s
        passed, not at their deadline."""
        self.producers.forget(peer.addr)
        busy = self._busy_peers()
        if peer.addr in busy:
            log.warning("side channel to %s lost with pulls waiting on it", peer.addr)
        now = time.monotonic()
        for inc in list(self.incoming.values()):
            if peer.addr in inc.waiting:
                # A dropped link is no dead worker: P may still write into these blocks
                # until the deadline it was sent. They stay held until P confirms the
                # cancel (queued for the link's return) or that deadline passed, or the
                # sidecar names another worker in its place (`_worker_replaced`).
                self._give_up(inc, f"side channel to {peer.addr} lost")
        self._sweep(busy, now)

    def _worker_replaced(self, addr: str) -> None:
        """The sidecar names another worker where `addr` was (a restarted P): the worker at
        `addr` is gone and writes nothing more, but for what was on the wire, so the pulls
        waiting on it go back after cancel_grace_s, not at their deadline."""
        until = time.monotonic() + self.settings.cancel_grace_s
        for inc in list(self.incoming.values()):
            if addr in inc.waiting:
                self._give_up(inc, f"its producer {addr} was replaced")
                inc.hold_until = min(inc.hold_until, until)

    def _busy_peers(self) -> set[str]:
        return {addr for inc in self.incoming.values() for addr in inc.waiting}

    def _answered(self, inc: Incoming, addr: str, failure: str | None,
                  digest_of_write: int | None = None) -> None:
        """One producer worker is done with this pull. It is over once all are: received
        if every one wrote its heads (and, when checked, what landed is what they wrote),
        else failed. A failure makes the others stop too, and the blocks stay held until
        they answer (no write lands in a freed block)."""
        if addr not in inc.waiting:
            return  # a late or repeated answer
        inc.waiting.discard(addr)
        inc.digests.append(digest_of_write)
        if failure is not None and inc.failure is None:
            inc.failure = failure
            if inc.waiting:
                self._give_up(inc, failure)
        if inc.waiting:
            return
        if inc.failure is not None or inc.cancelled:
            self._finish(inc, ok=False, error=inc.failure or inc.cancel_reason)
        elif inc.verify:
            inc.advance(TransferState.VERIFYING, d_req=inc.d_req_id)
            asyncio.create_task(self._check(inc))
        else:
            self._finish(inc, ok=True)

    async def _check(self, inc: Incoming) -> None:
        """Fail closed: a pull whose blocks do not hold what its producers wrote is handed
        to vLLM's load-failure policy (recomputed here), never decoded from."""
        assert inc.spec is not None
        mine = None
        if None not in inc.digests:  # else a producer could not sum its slices
            slices = digest.received_slices(self.regions, inc.spec.block_ids)
            try:
                mine = await asyncio.get_running_loop().run_in_executor(
                    None, self._digester, slices)
            except Exception:  # noqa: BLE001 - unreadable memory is no KV to trust
                log.exception("d_req=%s transfer=%s: digest failed", inc.d_req_id,
                              inc.transfer_id)
                self._finish(inc, ok=False, error="its blocks could not be summed")
                return
        if inc.cancelled:  # aborted meanwhile: vLLM frees the blocks either way
            self._finish(inc, ok=False, error=inc.cancel_reason)
            return
        if mine is None:  # memory not in whole words on one side: taken unchecked
            self.stats.record_verify("unverified")
            self._finish(inc, ok=True)
            return
        theirs = digest.combine([d for d in inc.digests if d is not None])
        if mine == theirs:
            self.stats.record_verify("verified")
            self._finish(inc, ok=True)
            return
        self.stats.record_verify("digest_mismatches")
        log.error("d_req=%s transfer=%s: the KV that landed does not match what the producer "
                  "wrote (digest %016x, producer's %016x); recomputed here", inc.d_req_id,
                  inc.transfer_id, mine, theirs)
        self._finish(inc, ok=False, error="KV digest mismatch")

    # --- cancellation, release, deadlines -------------------------------------------------

    async def _send_cancel(self, peer: str, entry: m.CancelEntry) -> None:
        msg = m.CancelRequest(engine_id=self.settings.engine_id, reqs=[entry])
        await self._peers.get(peer).send(m.encode_cancel(msg))

    def _give_up(self, inc: Incoming, why: str) -> None:
        """Stop waiting for this pull, keeping its blocks until no write can land in them.

        The producer answers a cancel at once, or once the write under way stops before its
        next batch; that answer frees the blocks (or, when the write had just completed,
        delivers the KV after all). Without an answer the blocks go back at `cancel_grace_s`
        past the deadline the producer was sent: it starts no batch after that deadline (less
        a margin), and the grace covers the one batch that may have started just before.
        """
        if inc.cancelled or inc.state.terminal:
            return
        inc.cancelled, inc.cancel_reason = True, why
        inc.hold_until = (max(inc.deadline, time.monotonic())
                          + self.settings.cancel_grace_s)
        log.info("d_req=%s transfer=%s %s; blocks held until the producer confirms (at most "
                 "%.1fs)", inc.d_req_id, inc.transfer_id, why,
                 inc.hold_until - time.monotonic())
        for addr in inc.waiting:
            asyncio.create_task(self._send_cancel(
                addr, m.CancelEntry(inc.d_req_id, inc.transfer_id)))
            # A producer given up on may be restarting at another address (same engine id):
            # the next pull asks the sidecar again rather than trusting this one.
            self.producers.forget(addr)

    async def _release(self, spec: ReleaseSpec) -> None:
        try:
            addrs = await self.producers.resolve(spec.remote_bootstrap_addr,
                                                 spec.remote_engine_id)
        except (BootstrapError, PlanError) as exc:
            log.info("release of %s not delivered: %s", spec.transfer_id, exc)
            return
        for addr in addrs:
            await self._send_cancel(addr, m.CancelEntry.release(spec.transfer_id))
        await self._release_unpulled(spec.remote_bootstrap_addr, spec.remote_engine_id,
                                     spec.transfer_id)

    async def _release_unpulled(self, bootstrap: str, engine_id: str, transfer_id: str) -> None:
        """Decode rank 0 tells the prefill ranks no decode rank pulls from (P's TP larger
        than ours) that nobody will: each frees the prompt's blocks now, not at
        send_timeout_s (vLLM frees them only once every prefill worker reported)."""
        if self.tp_rank != 0:
            return
        for r, addr in self.producers.unpulled(bootstrap, engine_id):
            if addr is not None:
                await self._send_cancel(addr, m.CancelEntry.release(transfer_id))
            else:
                log.warning("transfer=%s: prefill tp rank %d is not registered; it holds the "
                            "prompt until send_timeout_s", transfer_id, r)

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + min(5.0, self.settings.peer_idle_s / 2)
                self._sweep(self._busy_peers(), now)
            for inc in list(self.incoming.values()):
                if inc.state.terminal or inc.state is TransferState.VERIFYING:
                    continue  # a check writes nothing and ends by itself
                if inc.cancelled:
                    if now > inc.hold_until:
                        self._finish(inc, ok=False, error=(
                            f"{inc.cancel_reason}; the producer never confirmed, and can "
                            f"write nothing more {self.settings.cancel_grace_s:g}s past the "
                            "deadline it was given"))
                elif now > inc.deadline:
                    why = (f"no KV from the producer within its receive deadline "
                           f"({inc.deadline - inc.created:.3g}s, {inc.state.value})")
                    if inc.state is TransferState.BOOTSTRAPPING:
                        # Never sent: nothing can write into its blocks.
                        self._finish(inc, ok=False, error=why)
                    else:
                        self._give_up(inc, why)

    def _finish(self, inc: Incoming, ok: bool, error: str | None = None) -> None:
        if self.incoming.pop(inc.d_req_id, None) is None:
            return
        if ok and not inc.state.terminal:
            inc.advance(TransferState.SUCCESS, d_req=inc.d_req_id)
        else:
            ok = False
            inc.fail(error or "failed", d_req=inc.d_req_id)
        self.stats.record_recv(ok)
        if self.spans.on and inc.spec is not None:
            nbytes = sum(r.block_bytes * len(inc.spec.block_ids[r.group]) for r in self.regions
                         if r.group < len(inc.spec.block_ids))
            took = time.monotonic() - inc.created
            self.spans.record("pd.kv_pull", inc.transfer_id, inc.created, {
                "pd.d_req": inc.d_req_id, "pd.bytes": nbytes,
                "pd.blocks": sum(map(len, inc.spec.block_ids)),
                "pd.gbps": nbytes / took / 1e9 if took > 0 else 0.0},
                error=None if ok else inc.error or error or "failed")
        if ok:
            log.info("received d_req=%s transfer=%s blocks=%d in %.1f ms", inc.d_req_id,
                     inc.transfer_id, sum(map(len, inc.spec.block_ids)) if inc.spec else 0,
                     (time.monotonic() - inc.created) * 1e3)
        self._report(inc.d_req_id, ok)

    def _report(self, req_id: str, ok: bool) -> None:
        self._reports.add(req_id, ok)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._peers.close_all()
        await self.producers.close()
