"""Do a few costly clients slow everyone else? 64 plain streams on one app, alone
and beside four noisy clients, in one run (rounds alternate the phases):

- `alone`: the 64 streams only;
- `schemas`: four clients each sending request after request with a ~1 MB JSON
  schema of its own (a new one each time: no cache helps);
- `trickle`: four clients each holding `--trickle-connections` connections that
  send headers and a few bytes of a body, then nothing.

Per phase: the streams' p99 and longest gap between two events of a stream, their
median time to first token, and how many of them completed with `[DONE]`; the noisy
clients' answers by status. Every loop is bounded in count and time; the server is
stopped at the end.

    python -m loadtests.bench noisy-neighbours --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtests.serving.local_server import LocalServer

PHASES = ("alone", "schemas", "trickle")


def large_schema(tag: int, num_chars: int = 950_000) -> dict:
    """A JSON schema of about `num_chars` characters of JSON, all properties required
    (thousands of optional ones exceed the grammar engine's parser limits)."""
    field = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * 400},
                                              "b": {"type": "integer", "minimum": 0}},
             "required": ["a"]}
    names = [f"f_{i:05d}" for i in range(num_chars // len(json.dumps({"f_00000": field})))]
    return {"type": "object", "description": f"schema {tag}",
            "properties": {name: field for name in names}, "required": names}


async def _stream(client: httpx.AsyncClient, body: dict, deadline: float) -> dict:
    started = time.monotonic()
    times, done = [], False
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                  timeout=max(1.0, deadline - started)) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "times": [], "done": False, "started": started}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                elif line == "data: [DONE]":
                    done = True
    except (httpx.HTTPError, asyncio.TimeoutError):
        pass
    return {"status": 200, "times": times, "done": done, "started": started}


async def _schema_client(base: str, stop: asyncio.Event, statuses: Counter, tag0: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        tag = tag0
        while not stop.is_set():
            tag += 1
            body = {"model": "tiny", "prompt": "A record:", "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "big", "schema": large_schema(tag)}}}
            try:
                r = await client.post("/v1/completions", content=json.dumps(body),
                                      headers={"Content-Type": "application/json"})
                statuses[str(r.status_code)] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1


async def _trickle_client(host: str, port: int, num_connections: int, stop: asyncio.Event,
                          statuses: Counter) -> None:
    async def one():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          "Content-Type: application/json\r\nContent-Length: 400\r\n\r\n"
                          '{"model": "tiny", ').encode())
            await writer.drain()
            read = asyncio.ensure_future(reader.read(64))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if read.done() and read.result():
                statuses[read.result().split(b" ")[1].decode()] += 1
            else:
                statuses["still trickling at the end"] += 1
            read.cancel()
            stopped.cancel()
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(num_connections)))


async def run_phase(base: str, phase: str, ns) -> dict:
    host, port = base.removeprefix("http://").split(":")
    stop = asyncio.Event()
    noisy_statuses: Counter = Counter()
    noisy = []
    if phase == "schemas":
        noisy = [asyncio.ensure_future(_schema_client(base, stop, noisy_statuses, i * 10**6))
                 for i in range(ns.noisy_clients)]
    elif phase == "trickle":
        noisy = [asyncio.ensure_future(_trickle_client(host, int(port), ns.trickle_connections,
                                                       stop, noisy_statuses))
                 for _ in range(ns.noisy_clients)]
    if noisy:
        await asyncio.sleep(1.0)  # the noisy clients are at work before the streams start
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": ns.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    deadline = time.monotonic() + ns.phase_timeout_s
    limits = httpx.Limits(max_connections=ns.streams + 8)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        streams = await asyncio.gather(*(_stream(client, body, deadline)
                                         for _ in range(ns.streams)))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*noisy, return_exceptions=True), 180)
    gaps = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:])]
    ttfts = [s["times"][0] - s["started"] for s in streams if s["times"]]
    gaps.sort()
    return {"phase": phase,
            "completed": sum(s["done"] for s in streams),
            "refused": dict(Counter(str(s["status"]) for s in streams if s["status"] != 200)),
            "p99_gap_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 1) if gaps else None,
            "max_gap_ms": round(1000 * gaps[-1], 1) if gaps else None,
            "median_ttft_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "noisy": dict(noisy_statuses)}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench noisy-neighbours",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--noisy-clients", type=int, default=4)
    p.add_argument("--trickle-connections", type=int, default=16, help="per trickling client")
    p.add_argument("--phase-timeout-s", type=float, default=120.0)
    p.add_argument("--max-pending", type=int, default=72,
                   help="the app's ingress_max_pending_requests: room for the streams and "
                        "the noisy clients' requests, which the trickling connections of "
                        "all clients would nearly fill if a slot were taken before the body")
    return p


def main(argv: list[str] | None = None) -> dict:
    ns = make_parser().parse_args(argv)
    results: dict[str, list[dict]] = {phase: [] for phase in PHASES}
    config = Path(tempfile.mkdtemp()) / "serve.yaml"
    config.write_text(json.dumps({"applications": [{"args": {
        "model": "tiny", "ingress_max_pending_requests": ns.max_pending}}]}))
    with LocalServer(["--config", str(config)],
                     log_path=config.with_name("server.log")) as server:
        for _ in range(ns.rounds):
            for phase in PHASES:
                result = asyncio.run(run_phase(server.base_url, phase, ns))
                print(json.dumps(result), flush=True)
                results[phase].append(result)
    print("phase     completed  p99 gap ms  max gap ms  ttft ms   (medians over rounds)")
    for phase, rows in results.items():
        def med(key):
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.median(values) if values else float("nan")
        print(f"{phase:9} {med('completed'):9.0f}  {med('p99_gap_ms'):10.1f}  "
              f"{med('max_gap_ms'):10.1f}  {med('median_ttft_ms'):7.1f}")
    return results
