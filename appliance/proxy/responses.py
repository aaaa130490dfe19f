"""The Responses API (`POST /v1/responses`) through the node (docs/protocol.md, "The
Responses API").

vLLM 0.32's Responses path takes `kv_transfer_params` into the engine's sampling params
as chat does, so a response is placed and split like a chat: P gets `max_output_tokens: 1`,
D the client's body and P's KV, and D's event stream is relayed (exchange.sse). What one
node must serve whole instead:

- `previous_response_id`: the conversation so far is in the response store of the node
  that answered it (vLLM keeps one per server, only with VLLM_ENABLE_RESPONSES_API_STORE
  set); P has none of it. The proxy remembers which node answered each response it
  relayed (`Homes`) and sends the next turn there, whole; a response it does not know (an
  answer through another proxy, a restart) goes whole to the node placement picks, whose
  404 the client gets, as from a plain server that lost it;
- `background`: vLLM answers at once and decodes after; no split can wait on that;
- a P with several dp ranks behind one API server: vLLM's Responses path ignores
  `X-data-parallel-rank`, so P's prefill could run in another engine than the one D is
  told to pull from;
- server-side tools (web search, code interpreter, MCP ...): vLLM runs a turn per tool
  call inside one request, each with the request's `kv_transfer_params`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from appliance.proxy.access import AccessRecord
from appliance.proxy.nodes.backends import Backend, PrefillBackend
from appliance.proxy.placement.rule import Decision, Where, serve_whole

B = TypeVar("B", bound=Backend)

# Response ids remembered, the latest first out last (an entry is about 200 bytes).
HOMES_LIMIT = 65536
# Tools a client runs itself: the rest vLLM runs in the request (the module's doc).
_CLIENT_TOOLS = frozenset({"function", "custom", "namespace"})


class Homes:
    """The node that answered each response the proxy relayed (its id -> the node's URL):
    where it is stored, if that node stores responses."""

    def __init__(self, limit: int = HOMES_LIMIT) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, url: str) -> None:
        self._homes[response_id] = url
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        url = self._homes.get(response_id)
        if url is not None:
            self._homes.move_to_end(response_id)  # a conversation going on stays
        return url


def new_response_id() -> str:
    """An id of vLLM's own form (`resp_` + 16 hex digits)."""
    return f"resp_{os.urandom(8).hex()}"


@dataclass(slots=True)
class Turn:
    """One Responses request: its id, the response it continues and where that one is."""

    homes: Homes
    response_id: str | None  # None: not to be stored
    previous: str | None
    background: bool
    server_tools: bool

    @classmethod
    def begin(cls, body: dict[str, Any], homes: Homes) -> Turn:
        """The request's turn; a response that may be stored gets its id here (vLLM takes
        the body's `request_id` as the response's), so the proxy knows where it lives."""
        response_id = None
        if body.get("store", True) is not False:
            if not isinstance(body.get("request_id"), str) or not body["request_id"]:
                body["request_id"] = new_response_id()
            response_id = body["request_id"]
        previous = body.get("previous_response_id")
        tools = body.get("tools")
        return cls(homes, response_id, previous if isinstance(previous, str) else None,
                   body.get("background") is True,
                   isinstance(tools, list) and any(
                       not isinstance(t, dict) or t.get("type") not in _CLIENT_TOOLS
                       for t in tools))

    def home(self, nodes: Sequence[B]) -> B | None:
        """The node among `nodes` that answered the previous response, if any."""
        url = None if self.previous is None else self.homes.home(self.previous)
        return next((n for n in nodes if n.url == url), None) if url is not None else None

    def decodes(self, ready: Callable[[], Sequence[Backend]]
                ) -> Callable[[], Sequence[Backend]]:
        """The decode nodes admission may pick from: the previous response's, while it is
        in rotation (a full one is waited for, as any node would be); else any."""
        def nodes() -> Sequence[Backend]:
            found = ready()
            home = self.home(found)
            return found if home is None else [home]
        return nodes

    def overrule(self, p: PrefillBackend, d: Backend) -> Callable[[Decision], Decision] | None:
        """What placement must respect for this request (None: nothing, a split is fine)."""
        where: Where | None = None
        if self.previous is not None:
            reason = "previous_response"
            home = self.home([p, d])
            if home is not None:
                where = "p_alone" if home is p else "local"
        elif self.background:
            reason = "background"
        elif self.server_tools:
            reason = "server_tools"
        elif len(p.engine_ids) > 1:
            reason = "dp_ranks"
        else:
            return None
        return serve_whole(reason, where)

    def answered(self, status: int, rec: AccessRecord) -> None:
        """The response is stored, if at all, on the node that decoded it."""
        if (self.response_id is not None and status == 200 and rec.error is None
                and rec.decode != "-"):
            self.homes.remember(self.response_id, rec.decode)
