"""A burst of requests at once, from a process of its own, so that its client work
does not delay the test process's reading of the streams it watches meanwhile.

`python tests/burst_client.py URL NUM_REQUESTS MAX_TOKENS MODEL PROMPT_REPEATS START_AT`
(each prompt: "Burst <i> of the day. " that many times; sent at once, or with
START_AT -1 once it printed "ready" and read a line from stdin) prints one JSON
object: `first_sent`, `mid_sent` (the median) and `last_sent` (`time.monotonic()`,
the same clock in every process of the machine) and `rows`, per request [status (-1: the client failed),
seconds from sending to its first event (or its whole answer), seconds to its end,
the ingress's Server-Timing ttft in seconds or null, whether a stream ended with
[DONE] and no error event, the error message of a non-200 answer or null].

Not a test module.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_support import stream_request  # noqa: E402


def server_ttft_s(headers: dict) -> float | None:
    """The ingress's admission-to-first-token time (its Server-Timing header)."""
    for key, value in headers.items():
        if key.lower() == "server-timing":
            name, _, duration = value.partition(";dur=")
            if name == "ttft":
                return float(duration) / 1000
    return None


async def burst(url: str, num_requests: int, max_tokens: int, model: str,
                prompt_repeats: int, start_at: float = 0.0) -> dict:
    sent_at: list[float] = []

    async def one(client, i):
        sent = time.monotonic()
        sent_at.append(sent)
        body = {"model": model, "prompt": f"Burst {i} of the day. " * prompt_repeats,
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            r = await stream_request(client, url, body)
        except Exception as e:  # noqa: BLE001 - reported as a row, not a crash
            return [-1, 0.0, time.monotonic() - sent, None, False, repr(e)]
        ended = time.monotonic()
        first = (r.event_times[0] if r.event_times else ended) - sent
        complete = r.done and not r.error_events
        message = None
        if r.status != 200:
            try:
                message = r.json().get("error", {}).get("message")
            except ValueError:  # not JSON: a proxy's own page
                message = r.body[:200].decode(errors="replace")
        return [r.status, first, ended - sent, server_ttft_s(r.headers), complete, message]

    limits = httpx.Limits(max_connections=num_requests)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        if start_at < 0:  # told when: "ready" out, then a line in
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
        rows = await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    sent_at.sort()
    return {"first_sent": sent_at[0], "mid_sent": sent_at[len(sent_at) // 2],
            "last_sent": sent_at[-1], "rows": rows}


if __name__ == "__main__":
    url, num_requests, max_tokens, model, prompt_repeats, start_at = sys.argv[1:7]
    print(json.dumps(asyncio.run(burst(url, int(num_requests), int(max_tokens), model,
                                       int(prompt_repeats), float(start_at)))))
