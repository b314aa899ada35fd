"""What the ingress's own code costs per streamed event, without Ray or HTTP.

`python -m loadtests.bench ingress-chain [--streams 200] [--steps 128] [--rounds 3]`
runs, in this one process on uvloop, what the ingress does between an engine
replica's step message and the ASGI `send` of each stream's SSE bytes: the channel
hub decodes each step and fills the requests' collectors, each request's `Relay`
detokenizes its delta (`TextStream`, the `tiny` tokenizer), `sse_events` formats the
chunk, and `SSEResponse` hands it to `send`. A scripted engine stands in for the
replica (admission calls and one per-step channel) and `send` only counts bytes.
Every step carries one token for every stream, as per-step release does.

The figure is CPU microseconds per event (process time over the steps, divided by
streams x steps), the median of the rounds. It includes building each step's
message (~0.3 us an event) and waiting for every stream's write, so no delta
merges: the per-step path at its steadiest. Ray's metrics are off (the ingress
samples them) and the channel is a plain queue, not Serve's response generator.
What it leaves out, and what the ingress pays on top (`bench --server-pid`
measures the whole): Serve's and uvicorn's ASGI layers and the socket write under
`send`, the per-request work (parsing, tokenizing, admission), Ray's metrics, and
the other processes on the same cores. Machines differ: compare revisions in one sitting, alternated.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from cluster.transport.wire import GREETING, EngineRequest, encode_step
from deltas.types import FinishReason, TokenDelta
from replicas.config import SamplingParams  # plain data: no torch

# NOTE: the ingress's modules (and Ray with them) load in `measure`: the parser
# stays importable where only the command's flags are checked.

REPLICA_ID = "replica-1"
# Loop turns a step may take to reach every stream's write (a few, normally).
_MAX_SPINS = 10_000
PROMPT_IDS = [5, 6, 7, 8]
_END = object()


class _Call:
    """A Serve streaming call's stand-in: yields what is put, until `_END`."""

    def __init__(self, *items) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            self._queue.put_nowait(item)

    def put(self, item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self._queue.put_nowait(_END)


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class ScriptedReplica:
    """One engine replica: admits every request; `step` sends one step message."""

    def __init__(self) -> None:
        self.generate = _Method(lambda wire: _Call(REPLICA_ID))
        self.channel = _Method(self._channel)
        self._channel_call: _Call | None = None

    def _channel(self, owner, owner_handle=None, **pin) -> _Call:
        self._channel_call = _Call(GREETING)
        return self._channel_call

    def step(self, deltas: list[TokenDelta]) -> None:
        self._channel_call.put(encode_step(deltas))


class CountingSend:
    """The ASGI `send` under the response: counts events and bytes, writes nothing."""

    def __init__(self) -> None:
        self.num_bodies = 0
        self.num_bytes = 0
        self.ended = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            self.num_bodies += 1
            self.num_bytes += len(message["body"])
            self.ended = not message.get("more_body", False)


def word_piece_ids(tokenizer, limit: int = 3000) -> list[int]:
    """Ids whose bytes are whole printable ASCII: each makes an event of its own
    (a piece of a UTF-8 character, or a skipped special token, makes no text and
    so no event until the next token)."""
    ids = []
    for token_id in range(limit * 2):
        data = tokenizer.token_bytes(token_id)
        if (data and data.isascii() and data.decode().isprintable() and data.strip()
                and tokenizer.decode([token_id]).strip()):  # decode skips special tokens
            ids.append(token_id)
        if len(ids) == limit:
            break
    return ids


async def _one_round(tokenizer, pieces: list[int], streams: int, steps: int) -> float:
    """CPU microseconds per event over steps 2..`steps` (the first opens the streams)."""
    from cluster.api.openai_events import CompletionFormatter
    from cluster.api.response_writer import SSEResponse, sse_events
    from cluster.transport.channels import ChannelHub
    from cluster.transport.relay import Relay
    from deltas.text_stream import TextStream

    def _token_id(stream: int, step: int) -> int:
        return pieces[(stream * 7 + step * 13) % len(pieces)]

    replica = ScriptedReplica()
    hub = ChannelHub(replica, "ingress-1")
    relays = []
    for i in range(streams):
        request = EngineRequest(f"r{i}", PROMPT_IDS, SamplingParams(max_tokens=steps), hub.owner)
        opening = asyncio.ensure_future(Relay.open(replica, hub, request, TextStream(tokenizer)))
        while replica._channel_call is None or f"r{i}" not in hub._collectors:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # attached
        replica.step([TokenDelta(f"r{i}", [_token_id(i, 1)], num_prompt_tokens=len(PROMPT_IDS),
                                 num_output_tokens=1)])
        relays.append(await opening)
    sends = [CountingSend() for _ in relays]
    formatter = CompletionFormatter("cmpl-chain", "tiny", 0)

    async def respond(relay, send: CountingSend) -> None:
        events = sse_events([relay], formatter, False, None, None, time.monotonic(),
                            len(PROMPT_IDS))
        await SSEResponse(events, media_type="text/event-stream").stream_response(send)

    responses = [asyncio.ensure_future(respond(r, s)) for r, s in zip(relays, sends)]
    await asyncio.sleep(0.01)  # each response has sent its first event and waits
    started = time.process_time()
    for step in range(2, steps + 1):
        finish = FinishReason.LENGTH if step == steps else None
        replica.step([TokenDelta(f"r{i}", [_token_id(i, step)], num_prompt_tokens=len(PROMPT_IDS),
                                 num_output_tokens=step, finish_reason=finish)
                      for i in range(streams)])
        for _ in range(_MAX_SPINS):
            if all(s.num_bodies >= step or s.ended for s in sends):
                break
            await asyncio.sleep(0)
        else:
            raise RuntimeError(f"a stream wrote nothing for step {step}")
    await asyncio.gather(*responses)
    elapsed = time.process_time() - started
    # every step one write per stream, the last with the end of the body
    if not all(s.ended and s.num_bodies == steps for s in sends):
        raise RuntimeError("a stream did not get one write per step and its end")
    return elapsed / (streams * (steps - 1)) * 1e6


def measure(streams: int, steps: int, rounds: int) -> dict:
    import uvloop

    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    if streams < 1 or steps < 2 or rounds < 1:
        raise ValueError("need --streams >= 1, --steps >= 2 and --rounds >= 1")
    tokenizer = Tokenizer.from_dir(resolve_tokenizer_dir("tiny"))
    pieces = word_piece_ids(tokenizer)
    per_round = [uvloop.run(_one_round(tokenizer, pieces, streams, steps)) for _ in range(rounds)]
    return {"us_per_event": statistics.median(per_round), "rounds_us": per_round,
            "events": streams * (steps - 1)}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench ingress-chain",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="concurrent streams")
    p.add_argument("--steps", type=int, default=128, help="steps, one token per stream each")
    p.add_argument("--rounds", type=int, default=3)
    return p


def main(argv: list[str]) -> dict:
    args = make_parser().parse_args(argv)
    result = measure(args.streams, args.steps, args.rounds)
    rounds = ", ".join(f"{us:.2f}" for us in result["rounds_us"])
    print(f"{args.streams} streams x {args.steps} steps: {result['us_per_event']:.2f} CPU us "
          f"per event (median of {args.rounds}: {rounds}), {result['events']} events a round")
    return result
