"""Runs inside the decode host's network namespace: waits for both servers, sends split
requests the way the proxy does, prints the answers' token ids as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request

from appliance.proxy.exchange.bodies import decode_body, prefill_body
from appliance.proxy.openai_api import COMPLETIONS
from tests.e2e.conftest import post_json


async def main(args: dict) -> None:
    import uuid

    import aiohttp

    deadline = time.monotonic() + args["timeout"]
    for url in (args["prefill"], args["decode"]):
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} never became healthy")
            time.sleep(0.5)
    answers = []
    headers = {"Authorization": f"Bearer {args['api_key']}"} if args.get("api_key") else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        for prompt in args["prompts"]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "return_token_ids": True}
            tid = f"xfer-{uuid.uuid4()}"
            p_body = prefill_body(body, COMPLETIONS, tid)
            d_body = decode_body(body, tid, args["bootstrap"], "prefill-0")
            d_task = asyncio.create_task(post_json(http, args["decode"] + "/v1/completions",
                                                   d_body))
            p_status, _ = await post_json(http, args["prefill"] + "/v1/completions", p_body)
            d_status, d_result = await d_task
            assert p_status == d_status == 200, (p_status, d_status, d_result)
            answers.append(d_result["choices"][0]["token_ids"])
    print(json.dumps(answers))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
