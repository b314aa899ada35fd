"""SSEResponse: one `send` per item, the last one ending the body.

The ASGI server (uvicorn) turns each body message into one socket write, and a
body message with more_body False into the chunk plus the chunked terminator in
that same write; so the messages counted here are the connection's writes.
"""
from __future__ import annotations

import asyncio

from cluster.api.response_writer import SSEResponse, StreamEnd

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET"}


def _sends(items: list[bytes], fail_start: bool = False) -> tuple[list[dict], list[str]]:
    """The messages SSEResponse sends for a body of `items`, and what the body's
    generator did (`closed` once its clean-up ran) and when `on_end` ran.
    `fail_start`: the send of the headers fails (the body never starts)."""
    sent: list[dict] = []
    log: list[str] = []

    async def body():
        try:
            for item in items:
                yield item
            log.append("exhausted")
        finally:
            log.append("closed")

    async def send(message: dict) -> None:
        if fail_start and message["type"] == "http.response.start":
            raise OSError("connection reset")
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    response = SSEResponse(body(), media_type="text/event-stream",
                           on_end=lambda: log.append("on_end"))
    try:
        asyncio.run(response(SCOPE, receive, send))
    except Exception:  # Starlette turns the failed send into ClientDisconnect
        log.append("raised")
    return sent, log


def test_a_stream_end_goes_out_with_the_end_of_the_body():
    sent, log = _sends([b"data: 1\n\n", b"data: 2\n\n", StreamEnd(b"data: 3\n\ndata: [DONE]\n\n")])
    assert sent[0]["type"] == "http.response.start"
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"data: 1\n\n", True), (b"data: 2\n\n", True),
                      (b"data: 3\n\ndata: [DONE]\n\n", False)]
    # the generator's clean-up (token counts) still runs, without a further send
    assert log == ["closed", "on_end"]


def test_a_body_without_a_stream_end_ends_with_an_empty_message():
    """An error event ends a stream without [DONE]: the body ends after it."""
    sent, log = _sends([b"data: 1\n\n", b"event: error\ndata: {}\n\n"])
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True), (b"event: error\ndata: {}\n\n", True), (b"", False)]
    assert log == ["exhausted", "closed", "on_end"]


def test_on_end_runs_when_the_body_never_started():
    """The headers' send failed: the body's clean-up never runs, on_end does (the
    ingress lets go of the request's relays there)."""
    sent, log = _sends([b"data: 1\n\n"], fail_start=True)
    assert sent == [] and log == ["on_end", "raised"]
