"""Serving benchmark with vLLM benchmark_serving's flags, metrics and result block.

    python -m loadtests.bench --base-url http://127.0.0.1:8000 --model tiny \\
        --dataset-name random --random-input-len 128 --random-output-len 128 \\
        --ignore-eos --num-prompts 200 --max-concurrency 64 --save-result --plot

Talks HTTP to any OpenAI-compatible server. Library use:
`result = asyncio.run(run_benchmark(config))` with a BenchConfig, a dict of its
fields, or an argparse.Namespace from `make_parser()`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from loadtests import datasets
from loadtests.client import RequestRecord, RequestSpec, failed_record, send_request
from loadtests.metrics import format_cpu_block, format_result_block, summarize
from loadtests.process_cpu import ProcessCpu, per_token_us
from loadtests.openai_stream import COMPLETIONS, CHAT_COMPLETIONS, join_url


# multiturn: a replay of multi-turn ShareGPT conversations, each turn's prompt
# holding the earlier turns (see datasets.sample_multiturn_requests).
DATASET_NAMES = ("random", "sharegpt", "prefix", "multiturn")


@dataclass(slots=True)
class BenchConfig:
    base_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    endpoint: str = COMPLETIONS
    model: str = "tiny"
    tokenizer: str | None = None
    api_key: str | None = None
    dataset_name: str = "sharegpt"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    # dataset "prefix": a shared prefix (system prompt) plus a unique suffix per
    # request; outputs of random_output_len tokens.
    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 1
    ignore_eos: bool = False
    temperature: float | None = None  # None: not sent, so the server's default (1.0)
    # The pid of the server's root process (a local app's launcher): the result then
    # holds the CPU time per output token of each of its processes' roles.
    server_pid: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    disable_stream: bool = False
    metric_percentiles: str = "99"
    timeout: float = 300.0  # seconds per request
    run_timeout: float = 3600.0  # seconds for the whole run; the rest is cancelled
    ready_check_timeout_sec: float = 60.0  # 0: skip the initial test request
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    plot: bool = False
    disable_tqdm: bool = False
    print_result: bool = True

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASET_NAMES:
            raise ValueError(f"dataset_name must be one of {', '.join(DATASET_NAMES)}, "
                             f"got {self.dataset_name!r}")
        if self.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {self.endpoint!r}")
        if self.num_prompts < 1 or self.request_rate <= 0 or self.timeout <= 0:
            raise ValueError("num_prompts, request_rate and timeout must be positive")

    @classmethod
    def from_any(cls, value) -> "BenchConfig":
        if isinstance(value, cls):
            return value
        items = vars(value) if isinstance(value, argparse.Namespace) else dict(value)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in items.items() if k in names})

    @property
    def api_url(self) -> str:
        return join_url(self.base_url or f"http://{self.host}:{self.port}", self.endpoint)

    @property
    def percentiles(self) -> tuple[float, ...]:
        return tuple(float(p) for p in self.metric_percentiles.split(",") if p.strip())


def load_requests(cfg: BenchConfig, tokenizer) -> list[datasets.SampleRequest]:
    if cfg.dataset_name == "random":
        return datasets.sample_random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                               tokenizer, cfg.random_range_ratio, cfg.seed)
    if cfg.dataset_name == "prefix":
        return datasets.sample_prefix_requests(cfg.num_prompts, cfg.prefix_len, cfg.suffix_len,
                                               cfg.random_output_len, tokenizer, cfg.num_prefixes,
                                               cfg.seed)
    if cfg.dataset_name == "multiturn":
        return datasets.sample_multiturn_requests(cfg.dataset_path, cfg.num_prompts, tokenizer,
                                                  cfg.sharegpt_output_len, cfg.seed)
    return datasets.sample_sharegpt_requests(cfg.dataset_path, cfg.num_prompts, tokenizer,
                                             cfg.sharegpt_output_len, cfg.seed)


def _resolve_tokenizer(cfg: BenchConfig):
    path = cfg.tokenizer
    if path is None and (Path(cfg.model) / "tokenizer.json").is_file():
        path = cfg.model  # vLLM's default: the tokenizer of the model directory
    return datasets.load_tokenizer(path)


async def _arrival_gaps(num: int, rate: float, burstiness: float, seed: int):
    """Yields request indices; gaps are gamma (Poisson at burstiness 1), as vLLM's."""
    rng = np.random.RandomState(seed)
    for i in range(num):
        yield i
        if math.isfinite(rate) and i + 1 < num:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def _initial_test(session, spec: RequestSpec, request, deadline_s: float) -> None:
    """One request must succeed before the clock starts (server up, model right)."""
    end = time.perf_counter() + deadline_s
    while True:
        record = await send_request(session, spec, -1, request)
        if record.timeline.success:
            return
        if time.perf_counter() >= end:
            raise RuntimeError(f"initial test request failed: {record.timeline.error}")
        await asyncio.sleep(1.0)


async def _run_all(session, spec: RequestSpec, cfg: BenchConfig,
                   requests: list) -> tuple[list[RequestRecord], float, float]:
    records: list[RequestRecord | None] = [None] * len(requests)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), disable=cfg.disable_tqdm)

    async def one(i: int) -> None:
        if limit is None:
            records[i] = await send_request(session, spec, i, requests[i])
        else:
            async with limit:
                records[i] = await send_request(session, spec, i, requests[i])
        bar.update(1)

    start = time.perf_counter()
    tasks = []
    async def launch() -> None:
        async for i in _arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed):
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    try:
        await asyncio.wait_for(launch(), timeout=cfg.run_timeout)
    except asyncio.TimeoutError:
        pass  # wait_for cancelled launch() and with it the requests in flight
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - start
    bar.close()
    for i, rec in enumerate(records):
        if rec is None:
            records[i] = failed_record(i, requests[i], start, f"run timeout after {cfg.run_timeout:g}s")
    return records, start, duration


def _headers(cfg: BenchConfig) -> dict:
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _result_path(cfg: BenchConfig, stamp: str, suffix: str) -> Path:
    name = cfg.result_filename
    if not name:
        model_id = Path(cfg.model).name or "model"
        name = f"bench-{cfg.request_rate}qps-{model_id}-{stamp}.json"
    return Path(cfg.result_dir or ".") / Path(name).with_suffix(suffix).name


async def run_benchmark(args_or_config) -> dict:
    """Runs the whole benchmark; returns vLLM-named summary keys plus "requests"."""
    cfg = BenchConfig.from_any(args_or_config)
    tokenizer = _resolve_tokenizer(cfg)
    requests = load_requests(cfg, tokenizer)
    spec = RequestSpec(api_url=cfg.api_url, endpoint=cfg.endpoint, model=cfg.model,
                       stream=not cfg.disable_stream, ignore_eos=cfg.ignore_eos,
                       temperature=cfg.temperature, timeout_s=cfg.timeout, headers=_headers(cfg))
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=2**20, trust_env=False) as session:
        if cfg.ready_check_timeout_sec > 0:
            await _initial_test(session, spec, requests[0], cfg.ready_check_timeout_sec)
        cpu = ProcessCpu(cfg.server_pid).start() if cfg.server_pid else None
        records, start, duration = await _run_all(session, spec, cfg, requests)
        cpu_seconds = cpu.take() if cpu is not None else {}
    for rec in records:
        rec.resolve_output_tokens(tokenizer)
    summary = summarize([r.timeline for r in records], duration, cfg.percentiles)
    cpu_us = per_token_us(cpu_seconds, summary.total_output_tokens)
    result = {
        "date": datetime.now().isoformat(timespec="seconds"), "api_url": cfg.api_url,
        "endpoint": cfg.endpoint, "model_id": cfg.model, "tokenizer_id": cfg.tokenizer,
        "dataset_name": cfg.dataset_name, "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "stream": spec.stream, "ignore_eos": cfg.ignore_eos, "temperature": cfg.temperature,
        **summary.to_dict(),
        "cpu_seconds_by_role": cpu_seconds, "cpu_us_per_output_token": cpu_us,
        "errors": sorted({r.timeline.error for r in records if r.timeline.error}),
        "requests": [r.to_json(start) for r in records],
    }
    if cfg.print_result:
        print(format_result_block(summary), flush=True)
        if cpu_us:
            print(format_cpu_block(cpu_us), flush=True)
    _write_outputs(cfg, result)
    return result


def _write_outputs(cfg: BenchConfig, result: dict) -> None:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.save_result:
        path = _result_path(cfg, stamp, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        result["result_path"] = str(path)
    if cfg.plot:
        from loadtests.plots import plot_distributions  # matplotlib only when asked

        path = _result_path(cfg, stamp, ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_distributions(result["requests"], path, title=f"{cfg.model} {cfg.endpoint}")
        result["plot_path"] = str(path)


def make_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(description="Benchmark an OpenAI-compatible server (vLLM's flags).")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--endpoint", default=d.endpoint, choices=[COMPLETIONS, CHAT_COMPLETIONS])
    p.add_argument("--model", default=d.model)
    p.add_argument("--tokenizer", default=None, help="HF dir or tokenizer.json; default: --model if a dir")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", default=d.dataset_name, choices=list(DATASET_NAMES))
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the bundled sample")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--random-input-len", type=int, default=d.random_input_len)
    p.add_argument("--random-output-len", type=int, default=d.random_output_len,
                   help="output tokens of the random and prefix datasets")
    p.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="also for multiturn")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="prefix dataset: tokens of the shared prefix (system prompt)")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len,
                   help="prefix dataset: tokens of each request's unique suffix")
    p.add_argument("--num-prefixes", type=int, default=d.num_prefixes,
                   help="prefix dataset: distinct shared prefixes, used round robin")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None,
                   help="sent with every request; default: none sent (the server's default, "
                        "1.0 in the OpenAI API); 0 is greedy")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's root process (e.g. `pgrep -f cluster.serve_local`): report "
                        "CPU us per output token by process role (front door, ingress, engine, "
                        "ray, client), read from /proc; same machine only")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="req/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=d.burstiness)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--disable-stream", action="store_true", help="stream=false: TTFT = latency")
    p.add_argument("--metric-percentiles", default=d.metric_percentiles)
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request")
    p.add_argument("--run-timeout", type=float, default=d.run_timeout, help="seconds for the whole run")
    p.add_argument("--ready-check-timeout-sec", type=float, default=d.ready_check_timeout_sec)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="write a PNG of TTFT/TPOT/ITL distributions")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    result = asyncio.run(run_benchmark(make_parser().parse_args(argv)))
    for key in ("result_path", "plot_path"):
        if key in result:
            print(f"wrote {result[key]}")
    return result


if __name__ == "__main__":
    main()
