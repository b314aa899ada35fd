"""One run of the serving benchmark (`python -m loadtests.bench`, loadtests/bench.py):
vLLM benchmark_serving's flags, metrics and result block, over HTTP to any
OpenAI-compatible server. `result = asyncio.run(run_benchmark(config))` with a
BenchConfig, a dict of its fields, or an argparse.Namespace from `make_parser()`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from loadtests.serving import datasets
from loadtests.serving.client import RequestRecord, RequestSpec, failed_record, send_request
from loadtests.serving.metrics import format_cpu_block, format_result_block, summarize
from loadtests.serving.client_wait import ClientWait, warning as client_wait_warning
from loadtests.serving.process_cpu import ProcessCpu, per_token_us
from loadtests.serving.openai_stream import COMPLETIONS, CHAT_COMPLETIONS, join_url


# multiturn: a replay of multi-turn ShareGPT conversations, each turn's prompt
# holding the earlier turns (see datasets.sample_multiturn_requests).
DATASET_NAMES = ("random", "sharegpt", "prefix", "multiturn")


def _flag(default, help: str | None = "", *aliases: str, choices=None):
    """A BenchConfig field and its command-line flag (help, more names, choices)."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices})


@dataclass(slots=True)
class BenchConfig:
    """One run. Each field is a flag of the same name (vLLM's flags), see make_parser."""
    base_url: str | None = _flag(None, "e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    host: str = "127.0.0.1"
    port: int = 8000
    endpoint: str = _flag(COMPLETIONS, choices=(COMPLETIONS, CHAT_COMPLETIONS))
    model: str = "tiny"
    tokenizer: str | None = _flag(None, "HF dir or tokenizer.json; default: --model if a dir")
    api_key: str | None = _flag(None, "default: $OPENAI_API_KEY")
    dataset_name: str = _flag("sharegpt", choices=DATASET_NAMES)
    dataset_path: str | None = _flag(None, "ShareGPT JSON; default: the bundled sample")
    num_prompts: int = 1000
    random_input_len: int = _flag(1024, "prompt tokens of the random dataset", "--input-len")
    random_output_len: int = _flag(128, "output tokens of the random and prefix datasets",
                                   "--output-len")
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = _flag(None, "also for multiturn")
    prefix_len: int = _flag(1024, "prefix dataset: tokens of the shared prefix (system prompt)")
    suffix_len: int = _flag(64, "prefix dataset: tokens of each request's unique suffix")
    num_prefixes: int = _flag(1, "prefix dataset: distinct shared prefixes, used round robin")
    ignore_eos: bool = False
    temperature: float | None = _flag(
        None, "sent with every request; default: none sent (the server's default, 1.0 in the "
        "OpenAI API); 0 is greedy")
    server_pid: int | None = _flag(
        None, "the server's root process (e.g. `pgrep -f cluster.serve_local`): report CPU us "
        "per output token by process role (front door, ingress, engine, ray, client), read "
        "from /proc; same machine only")
    request_rate: float = _flag(math.inf, "req/s; inf sends all at once")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    disable_stream: bool = _flag(False, "stream=false: TTFT = latency")
    metric_percentiles: str = "99"
    timeout: float = _flag(300.0, "seconds per request")
    run_timeout: float = _flag(3600.0, "seconds for the whole run; the rest is cancelled")
    ready_check_timeout_sec: float = _flag(60.0, "one test request must succeed first; 0 skips it")
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    plot: bool = _flag(False, "write a PNG of TTFT/TPOT/ITL distributions")
    disable_tqdm: bool = False
    print_result: bool = _flag(True, None)  # None: no flag (library use)

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
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    spec = RequestSpec(api_url=cfg.api_url, endpoint=cfg.endpoint, model=cfg.model,
                       stream=not cfg.disable_stream, ignore_eos=cfg.ignore_eos,
                       temperature=cfg.temperature, timeout_s=cfg.timeout, headers=headers)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=2**20, trust_env=False) as session:
        if cfg.ready_check_timeout_sec > 0:
            await _initial_test(session, spec, requests[0], cfg.ready_check_timeout_sec)
        cpu = ProcessCpu(cfg.server_pid).start() if cfg.server_pid else None
        client_wait = ClientWait().start()
        records, start, duration = await _run_all(session, spec, cfg, requests)
        waited = client_wait.take()
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
        "cpu_seconds_by_role": cpu_seconds, "cpu_us_per_output_token": cpu_us, **waited,
        "errors": sorted({r.timeline.error for r in records if r.timeline.error}),
        "requests": [r.to_json(start) for r in records],
    }
    if cfg.print_result:
        print(format_result_block(summary), flush=True)
        if cpu_us:
            print(format_cpu_block(cpu_us), flush=True)
    late = client_wait_warning(waited, cfg.server_pid)
    if late:
        print(late, flush=True)
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
        from loadtests.serving.plots import plot_distributions  # matplotlib only when asked

        path = _result_path(cfg, stamp, ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
        title = (f"{cfg.model} {cfg.endpoint}, {cfg.dataset_name}: {cfg.num_prompts} prompts, "
                 f"rate {rate} req/s, concurrency {cfg.max_concurrency or 'unbounded'}, "
                 f"temperature {'server default' if cfg.temperature is None else cfg.temperature}")
        plot_distributions(result["requests"], path, title=title)
        result["plot_path"] = str(path)


def _scalar(hint: str) -> type:
    """"int | None" -> int (annotations are strings here)."""
    return {"int": int, "float": float, "str": str}[hint.split(" | ")[0]]


def make_parser(prog: str = "python -m loadtests.bench",
                description: str = "Benchmark an OpenAI-compatible server (vLLM's flags).",
                ) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    for f in dataclasses.fields(BenchConfig):
        help_text = f.metadata.get("help", "")
        if help_text is None:
            continue
        names = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        if f.type == "bool":
            p.add_argument(*names, action="store_true", help=help_text)
        else:
            p.add_argument(*names, type=_scalar(f.type), default=f.default, help=help_text,
                           choices=f.metadata.get("choices"))
    return p
