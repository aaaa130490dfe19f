"""OpenAI-style JSON errors shared by the appliance's HTTP services."""

from __future__ import annotations

from aiohttp import web

# The status a request gets when its client hangs up before the answer ends (nginx's): no
# response is sent, it is counted and logged so, and it is no failure of the node's.
CLIENT_GONE = 499


def request_outcome(status: int | str) -> str:
    """"ok" (2xx), "cancelled" (the client hung up) or "failed": how `pdctl status` and
    `pdctl top` count the proxy's pd_proxy_requests_total by its status label."""
    code = str(status)
    if code.startswith("2"):
        return "ok"
    return "cancelled" if code == str(CLIENT_GONE) else "failed"


# Set by each app to its client_max_size, so a 413 can name the limit.
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, err_type: str | None = None) -> dict:
    fallback = "server_error" if status >= 500 else "invalid_request_error"
    kind = err_type or _TYPES.get(status, fallback)
    return {"error": {"message": message, "type": kind, "code": status}}


def json_error(status: int, message: str, err_type: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, err_type), status=status,
                             headers=headers)


@web.middleware
async def json_errors_middleware(request: web.Request, handler):
    """Turn aiohttp's plain-text HTTP errors (404, 405, 413, ...) into JSON bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        if exc.status == 404:
            reason = f"no route for {request.method} {request.path}"
        elif exc.status == 405:
            reason = f"method {request.method} not allowed on {request.path}"
        elif exc.status == 413:
            limit = request.app.get(MAX_BODY_BYTES)
            reason = "request body too large" + (f" (limit {limit} bytes)" if limit else "")
        else:
            reason = exc.reason
        return json_error(exc.status, reason)
