"""A client's JSON body decoded, or refused with a 400: not JSON, not an object, or nested
deeper than any request needs.

The depth limit is the client's fault answered as such: decoded unchecked, 100,000 levels
raise RecursionError (a 500, the server blamed); a few hundred decode, and then whatever
walks or re-encodes the body further down the stack may raise it instead. Imports nothing
of the proxy but `errors`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.proxy.errors import ProxyError

# Far past any OpenAI body (a tool's or response_format's JSON schema is tens of levels),
# far inside the interpreter's recursion limit (1000) with the stack a handler runs on.
MAX_DEPTH = 128

_TOO_DEEP = f"request body is nested too deeply (the limit is {MAX_DEPTH} levels)"


def decode_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict; ProxyError(400) when it is not one within MAX_DEPTH levels."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec checks the depth as it goes: nothing is half-built
        raise ProxyError(400, _TOO_DEEP) from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
    # Nesting needs an opening bracket per level: most bodies have too few to be checked.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and too_deep(body, MAX_DEPTH):
        raise ProxyError(400, _TOO_DEEP)
    return body


def too_deep(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest in `value` (a list or dict) more than `limit` levels
    (`value` is level 1). A loop with its own stack: it must not recurse on what it checks."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for item in node.values() if isinstance(node, dict) else node:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return False
