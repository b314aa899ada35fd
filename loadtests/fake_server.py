"""A fake OpenAI-compatible server that streams known chunks: tests and dry runs.

Takes every flag of `cluster.serve_local`, read by the launcher's own parser, so
`loadtests.bench compare --launcher loadtests.fake_server` runs the whole matrix
without Ray; what it does with them is in loadtests/README.md ("Dry runs").
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import threading
import time
from dataclasses import dataclass

from aiohttp import web

FAILURES = ("http500", "cut", "error_event")


@dataclass(slots=True)
class FakeServerConfig:
    model: str = "fake"
    num_scheduler_steps: int = 1
    release_per_window: bool = False
    step_ms: float = 0.0
    fail_every: int = 0  # 0: never fail
    failure: str = "http500"

    def __post_init__(self) -> None:
        if self.failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {self.failure!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.num_scheduler_steps if self.release_per_window else 1


def _sse(data) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def _chunk(is_chat: bool, model: str, text: str, finish: str | None, first: bool) -> dict:
    if is_chat:
        delta = {"content": text} if not first else {"role": "assistant", "content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": "fake-1", "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice]}


class FakeOpenAIServer:
    def __init__(self, config: FakeServerConfig):
        self.config = config
        self.num_requests = 0
        self.total_completion_tokens = 0  # what usage reported, summed
        self.total_prompt_tokens = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.num_requests += 1
        is_chat = "messages" in body
        prompt = body["messages"][-1]["content"] if is_chat else body.get("prompt", "")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        fails = self.config.fail_every > 0 and self.num_requests % self.config.fail_every == 0
        if fails and self.config.failure == "http500":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        tokens = [f" t{i}" for i in range(max_tokens)]
        usage = {"prompt_tokens": len(str(prompt).split()), "completion_tokens": max_tokens,
                 "total_tokens": len(str(prompt).split()) + max_tokens}
        if not body.get("stream"):
            await asyncio.sleep(self.config.step_ms * max_tokens / 1000.0)
            self._count(usage)
            answer = _chunk(is_chat, self.config.model, "".join(tokens), "length", False)
            if is_chat:
                answer["choices"][0] = {"index": 0, "finish_reason": "length",
                                        "message": {"role": "assistant", "content": "".join(tokens)}}
            return web.json_response({**answer, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await self._stream(request, resp, body, is_chat, tokens, usage, fails)
        except ConnectionResetError:
            pass  # the client left mid-stream (a load test stopping)
        return resp

    def _count(self, usage: dict) -> None:
        self.total_completion_tokens += usage["completion_tokens"]
        self.total_prompt_tokens += usage["prompt_tokens"]

    async def _stream(self, request, resp, body, is_chat, tokens, usage, fails) -> None:
        await resp.prepare(request)
        model, per_chunk = self.config.model, self.config.tokens_per_chunk
        if is_chat:  # OpenAI's first chat chunk carries only the role
            await resp.write(_sse(_chunk(True, model, "", None, True)))
        for start in range(0, len(tokens), per_chunk):
            piece = tokens[start:start + per_chunk]
            await asyncio.sleep(self.config.step_ms * len(piece) / 1000.0)
            if fails and start > 0 and self.config.failure == "cut":
                await resp.write_eof()  # a clean end, but without [DONE]
                return
            finish = "length" if start + per_chunk >= len(tokens) else None
            await resp.write(_sse(_chunk(is_chat, model, "".join(piece), finish, False)))
        if fails and self.config.failure == "error_event":
            await resp.write(_sse({"error": {"message": "injected error event", "code": 500}}))
        elif (body.get("stream_options") or {}).get("include_usage"):
            self._count(usage)
            await resp.write(_sse({"id": "fake-1", "object": "chunk", "model": model,
                                   "choices": [], "usage": usage}))
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()


class FakeServerThread:
    """Runs the fake server in a daemon thread (port 0: a free one)."""

    def __init__(self, config: FakeServerConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.server = FakeOpenAIServer(config or FakeServerConfig())
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.server.app(), access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def __enter__(self) -> "FakeServerThread":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(the fake's own flags, the launcher's flags as its own parser reads them)."""
    from cluster.serve_local import parse_args as parse_launcher_args

    p = argparse.ArgumentParser(prog="python -m loadtests.fake_server", description=__doc__.split("\n")[0],
                                epilog="Every flag of python -m cluster.serve_local is accepted too.")
    p.add_argument("--step-ms", type=float, default=1.0, help="one decode step, in ms")
    p.add_argument("--fail-every", type=int, default=0, help="every Nth request fails (0: none)")
    p.add_argument("--failure", choices=FAILURES, default="http500")
    fake, launcher_argv = p.parse_known_args(argv)
    return fake, parse_launcher_args(launcher_argv)


def main(argv: list[str] | None = None) -> None:
    from cluster.serve_local import app_args
    from replicas.config import EngineConfig

    fake, launcher = parse_args(argv)
    args, host, port = app_args(launcher)
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)} | args
    config = FakeServerConfig(model=args.get("served_model_name") or engine["model"],
                              num_scheduler_steps=engine["num_scheduler_steps"],
                              release_per_window=not engine["release_per_step"], step_ms=fake.step_ms,
                              fail_every=fake.fail_every, failure=fake.failure)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with FakeServerThread(config, host, port) as srv:
        print(f"Serving at {srv.base_url}/v1", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
