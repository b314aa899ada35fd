"""Offline prefix-caching benchmark (no HTTP): `python -m loadtests.bench_prefix`.

Caching on vs off side by side in one run, on the `tiny` preset by default:

- shared prefix: every prompt is one shared prefix (a system prompt, 1,024
  tokens) plus a unique suffix (64 tokens); 128 output tokens, greedy,
  ignore_eos; at concurrency 1 (one request after another) and at a higher
  concurrency (a closed loop: a new request as soon as one ends).
- multi-turn chat: a replay of the ShareGPT sample's multi-turn conversations
  (tokenized with the presets' tokenizer); each conversation sends its turns one
  after another, each turn's prompt holding the turns before it (the recorded
  replies), several conversations at once; TTFT by turn.

TTFT is taken at the first delta, as a consumer sees it. Rounds interleave the
two configurations on this noisy machine; figures are medians over rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import time

import numpy as np

from loadtests import datasets
from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncEngine


def shared_prefix_prompts(num_prompts: int, prefix_len: int, suffix_len: int,
                          seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 8192) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, 8192) for _ in range(suffix_len)] for _ in range(num_prompts)]


def chat_conversations(tokenizer_dir: str, max_prompt_len: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (prompt ids, recorded reply length in tokens)."""
    tok = datasets.HFTokenizer(tokenizer_dir)
    out = []
    for turns in datasets.load_sharegpt_conversations(datasets.DEFAULT_SHAREGPT_PATH):
        conv = []
        for prompt, reply in datasets.conversation_prompts(turns):
            ids = tok.encode(prompt)
            if len(ids) > max_prompt_len:
                break
            conv.append((ids, len(tok.encode(reply))))
        if len(conv) >= 2:
            out.append(conv)
    return out


async def _timed(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    first, n = None, 0
    async for delta in engine.generate(rid, prompt, params):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        n += len(delta.token_ids)
    return {"ttft_ms": (first - start) * 1e3, "num_tokens": n}


def _warm(engine: AsyncEngine) -> None:
    async def warm():
        async for _ in engine.generate("warmup", [1, 2, 3], SamplingParams(max_tokens=4)):
            pass
    asyncio.run(warm())


def _summary(records: list[dict], duration: float, stats: dict) -> dict:
    ttft = [r["ttft_ms"] for r in records]
    return {"median_ttft_ms": float(np.median(ttft)), "p90_ttft_ms": float(np.percentile(ttft, 90)),
            "output_tokens_per_s": sum(r["num_tokens"] for r in records) / duration,
            "duration_s": duration, "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]}


def run_shared_prefix(config: EngineConfig, prompts: list[list[int]], concurrency: int,
                      output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = AsyncEngine(config)
    try:
        _warm(engine)

        async def main():
            sem = asyncio.Semaphore(concurrency)

            async def one(i, p):
                async with sem:
                    return await _timed(engine, f"r{i}", p, params)
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        t0 = time.perf_counter()
        records = asyncio.run(main())
        duration = time.perf_counter() - t0
        return _summary(records, duration, engine.stats())
    finally:
        engine.shutdown()
        gc.collect()


def run_chat(config: EngineConfig, conversations: list, concurrency: int, max_output_len: int) -> dict:
    engine = AsyncEngine(config)
    try:
        _warm(engine)

        async def conversation(c: int, turns: list) -> list[dict]:
            records = []
            for k, (prompt, reply_len) in enumerate(turns):
                params = SamplingParams(temperature=0.0, max_tokens=min(reply_len, max_output_len),
                                        ignore_eos=True)
                record = await _timed(engine, f"c{c}t{k}", prompt, params)
                records.append({**record, "turn": k})
            return records

        async def main():
            sem = asyncio.Semaphore(concurrency)

            async def one(c, turns):
                async with sem:
                    return await conversation(c, turns)
            return await asyncio.gather(*[one(c, t) for c, t in enumerate(conversations)])
        t0 = time.perf_counter()
        per_conv = asyncio.run(main())
        duration = time.perf_counter() - t0
        records = [r for conv in per_conv for r in conv]
        row = _summary(records, duration, engine.stats())
        for k, label in ((0, "turn1"), (1, "turn2"), (2, "turn3+")):
            ttft = [r["ttft_ms"] for r in records if min(r["turn"], 2) == k]
            row[f"median_ttft_{label}_ms"] = float(np.median(ttft)) if ttft else float("nan")
        return row
    finally:
        engine.shutdown()
        gc.collect()


def _median_rows(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _print_table(title: str, rows: dict[str, dict], keys: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    print(f"{'caching':<9}" + "".join(f"{label:>{len(label) + 3}}" for _, label, _ in keys))
    for name, row in rows.items():
        print(f"{name:<9}" + "".join(f"{row[k]:>{len(label) + 3}{fmt}}" for k, label, fmt in keys))
    on, off = rows["on"], rows["off"]
    print(f"caching on vs off: median TTFT {off['median_ttft_ms'] / on['median_ttft_ms']:.2f}x lower, "
          f"throughput {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x", flush=True)


_PREFIX_KEYS = [("median_ttft_ms", "TTFT p50 ms", ".1f"), ("p90_ttft_ms", "TTFT p90 ms", ".1f"),
                ("output_tokens_per_s", "out tok/s", ".0f"),
                ("prefix_cache_hit_rate", "hit rate", ".2f")]
_CHAT_KEYS = [("median_ttft_turn1_ms", "TTFT turn 1", ".1f"),
              ("median_ttft_turn2_ms", "turn 2", ".1f"), ("median_ttft_turn3+_ms", "turn 3+", ".1f"),
              ("median_ttft_ms", "all p50", ".1f"), ("output_tokens_per_s", "out tok/s", ".0f"),
              ("prefix_cache_hit_rate", "hit rate", ".2f")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="per run; default: 8 at concurrency 1, else 4 x concurrency")
    ap.add_argument("--chat-concurrency", type=int, nargs="*", default=[1, 8],
                    help="conversations at once (none: skip the chat replay)")
    ap.add_argument("--chat-output-len", type=int, default=64, help="cap on each turn's reply")
    ap.add_argument("--chat-conversations", type=int, default=24,
                    help="the first this many multi-turn conversations of the sample (0: all)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--result-dir", default="results")
    args = ap.parse_args()
    configs = {"on": EngineConfig(model=args.model, enable_prefix_caching=True),
               "off": EngineConfig(model=args.model, enable_prefix_caching=False)}
    result: dict = {"shared_prefix": [], "chat": []}
    for c in args.concurrency:
        n = args.num_prompts or (8 if c == 1 else 4 * c)
        prompts = shared_prefix_prompts(n, args.prefix_len, args.suffix_len, seed=c)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, cfg in configs.items():
                runs[name].append(run_shared_prefix(cfg, prompts, c, args.output_len))
        rows = {name: _median_rows(rs) for name, rs in runs.items()}
        result["shared_prefix"].append({"concurrency": c, "num_prompts": n, **rows})
        _print_table(f"{args.model}: {args.prefix_len}-token shared prefix + {args.suffix_len}-token "
                     f"suffix, {args.output_len} out, {n} prompts, concurrency {c}", rows, _PREFIX_KEYS)
    if args.chat_concurrency:
        from replicas.presets import resolve_tokenizer_dir
        # NOTE: 2048 is the presets' context; longer turns end their conversation.
        convs = chat_conversations(resolve_tokenizer_dir(args.model), 2048 - args.chat_output_len - 1)
        convs = convs[:args.chat_conversations or None]
        num_turns = sum(map(len, convs))
        for c in args.chat_concurrency:
            runs = {name: [] for name in configs}
            for _ in range(args.repeats):
                for name, cfg in configs.items():
                    runs[name].append(run_chat(cfg, convs, c, args.chat_output_len))
            rows = {name: _median_rows(rs) for name, rs in runs.items()}
            result["chat"].append({"num_conversations": len(convs), "num_turns": num_turns,
                                   "concurrency": c, **rows})
            _print_table(f"{args.model}: multi-turn chat replay, {len(convs)} conversations "
                         f"({num_turns} turns), {c} at once", rows, _CHAT_KEYS)
    os.makedirs(args.result_dir, exist_ok=True)
    path = os.path.join(args.result_dir, "bench_prefix.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
