"""The local launcher's fallback front door, `--front-door serve-proxy` (Serve's
Python proxy instead of HAProxy, the default), serves the same OpenAI API: streams
end with `[DONE]` and carry the same text as a non-streaming answer, concurrent
streams all complete, and the launcher shuts down cleanly. (The HAProxy default
runs in the launcher's lifecycle tests and the docs' commands.)"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtests.serving.local_server import LocalServer
from loadtests.serving.openai_stream import StreamParser

pytestmark = [pytest.mark.ray, pytest.mark.front_door, pytest.mark.timeout(600)]

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[str, bool]:
    async with client.stream("POST", url, json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        parsed = StreamParser.of([line async for line in r.aiter_lines()])
    return parsed.text, parsed.is_done


def test_serve_proxy_front_door_serves_streams(tmp_path):
    flags = ["--front-door", "serve-proxy", "--num-cpus", "3", "--max-num-seqs", "16",
             "--num-kv-blocks", "512", "--max-model-len", "512"]
    with LocalServer(flags, log_path=tmp_path / "server.log", stop_timeout_s=60) as srv:
        url = srv.base_url + "/v1/completions"
        whole = httpx.post(url, json=BODY, timeout=60).json()["choices"][0]["text"]

        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(_stream(client, url) for _ in range(8)))

        results = asyncio.run(run())
        assert all(done and text == whole for text, done in results), results
        process = srv.process
    log = (tmp_path / "server.log").read_text()
    assert process.returncode == 0, log[-2000:]
    assert "Front door: serve-proxy (requested)" in log
