"""Structured outputs under load, offline (no HTTP): `python -m loadtests.bench_engine
--structured`.

Side by side in one run, interleaved round by round (`--repeats`), medians:
- `mixed`: `--concurrency` streams at once, every fourth (`--constrained-every`)
  held to a JSON schema (sampled, seeded); the rest greedy, ignore_eos,
  `--output-len` tokens;
- `unconstrained`: the same requests with no constrained neighbours: the
  constrained ones run unconstrained (same temperature and seed) for as many
  tokens as they made in `mixed`.
With `--constraint tools` the constrained streams are tool calls instead: chat's
`tool_choice: "required"` grammar (cluster/api/tools/grammar.py, the `<tool_call>`
form) over two tools, one call each, its arguments held to the tool's schema.
Reported: output throughput and median TPOT of the unconstrained streams in each,
the constrained streams' median TPOT, how many constrained outputs validate, and
the grammar engine's cost per token (mask, and feeding the sampled token), replayed
on one thread over the constrained outputs.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

from loadtests.engine.engine_runner import engine_config, random_prompts, stream_sessions
from loadtests.serving.metrics import format_table, summarize
from replicas import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 10, "items": {
              "type": "object", "additionalProperties": False, "required": ["id", "tag", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "tag": {"enum": ["alpha", "beta", "gamma"]},
                             "ok": {"type": "boolean"}}}}}}


TOOLS = [{"type": "function", "function": {"name": "search_orders", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["customer", "items"],
    "properties": {"customer": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "status": {"enum": ["open", "shipped", "returned"]},
                   "items": {"type": "array", "minItems": 2, "maxItems": 6,
                             "items": {"type": "string", "maxLength": 12}}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def constraint_spec(constraint: str) -> dict:
    """The structured output the constrained streams carry."""
    if constraint == "json":
        return {"json": SCHEMA}
    from cluster.api.tools.formats import HERMES
    from cluster.api.tools.grammar import tool_grammar
    return {"grammar": tool_grammar(TOOLS, HERMES, choice="required", parallel=False)}


def is_valid(text: str, constraint: str) -> bool:
    """A constrained output parses and validates against its schema."""
    import jsonschema
    try:
        if constraint == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        from cluster.api.tools.formats import HERMES
        from cluster.api.tools.stream import tool_message
        content, calls = tool_message(text, HERMES)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                schemas[call["function"]["name"]])
        return content is None and len(calls) == 1
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def _group_row(timelines) -> dict:
    start = min(t.send_time for t in timelines)
    end = max(t.chunk_times[-1] for t in timelines if t.chunk_times)
    s = summarize(timelines, end - start)
    return {"tok_s": s.output_throughput, "tpot_ms": s.tpot.median_ms,
            "num_tokens": s.total_output_tokens}


def _run(engine, sessions, tag: str) -> list:
    def open_stream(request_id, prompt, params):
        return engine.generate(f"{tag}-{request_id}", prompt, params)
    timelines, _, _ = asyncio.run(stream_sessions(open_stream, sessions))
    return [ts[0] for ts in timelines]


def _mask_cost_us(engine, outputs: list[list[int]], spec: dict) -> tuple[float, float]:
    """(mask us per token, feed us per token), one thread, replaying each output."""
    import llguidance.torch as llt
    mask_s = feed_s = 0.0
    n = 0
    bitmask = llt.allocate_token_bitmask(1, engine.core.vocab_size)
    for ids in outputs:
        g = engine.core.grammars.compile(spec).matcher
        for token in ids:
            t0 = time.perf_counter()
            llt.fill_next_token_bitmask(g, bitmask, 0)
            t1 = time.perf_counter()
            g.consume_token(token)
            feed_s += time.perf_counter() - t1
            mask_s += t1 - t0
            n += 1
    return mask_s / max(n, 1) * 1e6, feed_s / max(n, 1) * 1e6


NUM_SCHEDULER_STEPS = 8


def report(model: str, num_streams: int, constrained_every: int, input_len: int,
           output_len: int, repeats: int, constraint: str = "json") -> dict:
    """Run both workloads `repeats` times, print the table and the grammar cost."""
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.async_engine import AsyncEngine

    prompts = random_prompts(num_streams, input_len)
    is_constrained = [i % constrained_every == constrained_every - 1
                      for i in range(num_streams)]
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    spec = constraint_spec(constraint)
    mixed = [[(p, SamplingParams(temperature=1.0, seed=i, max_tokens=2 * output_len,
                                 structured_output=spec) if c else free)]
             for i, (p, c) in enumerate(zip(prompts, is_constrained))]
    engine = AsyncEngine(engine_config(model, num_scheduler_steps=NUM_SCHEDULER_STEPS))
    tokenizer = Tokenizer.from_dir(engine.core.model_dir)
    rows: dict[str, list[dict]] = {"mixed": [], "unconstrained": []}
    constrained_ids: list[list[int]] = []
    try:
        _run(engine, [[(p, SamplingParams(max_tokens=4))] for p in prompts[:8]], "warm-up")
        for k in range(repeats):
            got = _run(engine, mixed, f"mixed{k}")
            failed = [t.error for t in got if not t.success]
            if failed:
                raise SystemExit(f"{len(failed)} streams failed, first: {failed[0]}")
            # NOTE: timelines keep no ids: the constrained texts come from a rerun below
            lengths = {i: t.num_output_tokens for i, t in enumerate(got) if is_constrained[i]}
            same_load = [[(p, SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                                             max_tokens=lengths[i]) if c else free)]
                         for i, (p, c) in enumerate(zip(prompts, is_constrained))]
            base = _run(engine, same_load, f"unconstrained{k}")
            for name, timelines in (("mixed", got), ("unconstrained", base)):
                free_row = _group_row([t for t, c in zip(timelines, is_constrained) if not c])
                other = _group_row([t for t, c in zip(timelines, is_constrained) if c])
                rows[name].append({"free_tok_s": free_row["tok_s"],
                                   "free_tpot_ms": free_row["tpot_ms"],
                                   "other_tpot_ms": other["tpot_ms"],
                                   "other_tokens": other["num_tokens"]})

        async def token_ids(i, prompt, params):
            ids = []
            async for d in engine.generate(f"check{i}", prompt, params):
                ids += d.token_ids
            return ids

        async def texts():  # NOTE: seeded, so the same outputs as in the timed runs
            return await asyncio.gather(*(token_ids(i, p, params)
                                          for i, ((p, params),) in enumerate(mixed)
                                          if is_constrained[i]))
        constrained_ids = asyncio.run(texts())
    finally:
        engine.shutdown()
    num_valid = sum(is_valid(tokenizer.decode(ids), constraint) for ids in constrained_ids)
    table = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for name, rs in rows.items()}
    what = "a JSON schema" if constraint == "json" else "a required tool call"
    print(f"{num_streams} streams, every {constrained_every}th with {what}, "
          f"{input_len} in / {output_len} out, N={NUM_SCHEDULER_STEPS}, "
          f"{model}, medians of {repeats}")
    print(format_table(table, [("free_tok_s", "unconstrained streams tok/s", ".0f"),
                               ("free_tpot_ms", "their TPOT ms", ".2f"),
                               ("other_tpot_ms", "constrained TPOT ms", ".2f"),
                               ("other_tokens", "constrained tokens", ".0f")],
                       name_header="run", baseline="unconstrained",
                       ratio_columns=[("free_tok_s", "tok/s"), ("other_tpot_ms", "TPOT")]))
    m = table["mixed"]
    print(f"constrained TPOT / unconstrained TPOT (mixed run): "
          f"{m['other_tpot_ms'] / m['free_tpot_ms']:.3f}")
    print(f"constrained outputs that parse and validate: {num_valid}/{len(constrained_ids)}")
    mask_us, feed_us = _mask_cost_us(engine, constrained_ids, spec)
    print(f"llguidance per token, one thread: mask {mask_us:.1f} us, feed token {feed_us:.1f} us")
    return {"runs": table, "num_valid": num_valid, "num_constrained": len(constrained_ids),
            "mask_us_per_token": mask_us, "feed_us_per_token": feed_us}
