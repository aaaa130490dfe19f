"""The fake vLLM's `/v1/responses`: a response object, or its event stream as vLLM 0.32
sends it (`event:` + `data:` per event, `response.created` and `response.in_progress` before
the engine has the request, one `response.output_text.delta` per token, no [DONE])."""

from __future__ import annotations

import json
from typing import Any

PATH = "/v1/responses"


def event(kind: str, seq: int, **fields: Any) -> bytes:
    data = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def response(name: str, body: dict[str, Any], text: str, status: str,
             output_tokens: int) -> dict[str, Any]:
    rid = body.get("request_id") or f"resp_{name}"
    out = {"id": rid, "object": "response", "created_at": 0, "model": "tiny",
           "status": status, "previous_response_id": body.get("previous_response_id"),
           "output": [], "usage": None, "kv_transfer_params": None}
    if status != "in_progress":
        out["output"] = [{"type": "message", "id": f"msg_{name}", "role": "assistant",
                          "status": "completed", "content": [
                              {"type": "output_text", "text": text, "annotations": []}]}]
        out["usage"] = {"input_tokens": 5, "output_tokens": output_tokens,
                        "total_tokens": 5 + output_tokens}
    return out


def whole(name: str, body: dict[str, Any], finish: str) -> dict[str, Any]:
    one = body.get("max_output_tokens") == 1
    status = "completed" if finish == "stop" else "incomplete"
    return response(name, body, "t0" if one else "t0 t1 t2 t3", status, 1 if one else 4)


def preamble(name: str, body: dict[str, Any]) -> bytes:
    opening = response(name, body, "", "in_progress", 0)
    return (event("response.created", 0, response=opening)
            + event("response.in_progress", 1, response=opening))


def opening_item(name: str) -> bytes:
    item = {"type": "message", "id": f"msg_{name}", "role": "assistant",
            "status": "in_progress", "content": []}
    return (event("response.output_item.added", 2, output_index=0, item=item)
            + event("response.content_part.added", 3, output_index=0, content_index=0,
                    item_id=f"msg_{name}", part={"type": "output_text", "text": ""}))


def delta(name: str, i: int) -> bytes:
    return event("response.output_text.delta", 4 + i, output_index=0, content_index=0,
                 item_id=f"msg_{name}", delta=f"t{i} ", logprobs=[])


def closing(name: str, body: dict[str, Any], n: int, finish: str) -> bytes:
    text = "".join(f"t{i} " for i in range(n))
    done = response(name, body, text, "completed" if finish == "stop" else "incomplete", n)
    seq = 4 + n
    return (event("response.output_text.done", seq, output_index=0, content_index=0,
                  item_id=f"msg_{name}", text=text, logprobs=[])
            + event("response.output_item.done", seq + 1, output_index=0,
                    item=done["output"][0])
            # vLLM's last event is response.completed whatever the status.
            + event("response.completed", seq + 2, response=done))
