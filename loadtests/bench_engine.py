"""Offline, in-process engine benchmark (no HTTP): `python -m loadtests.bench_engine`.

One mode per run, every one on the runner of loadtests/engine/engine_runner.py (greedy,
ignore_eos, 128-token prompts unless said):
- default: the `tiny` and `small` presets at 1, 16 and 64 concurrent requests (128
  output tokens), beside transformers' `generate` on the same workload (one request
  at a time, and one batch), with ratios;
- `--matrix`: N=1 vs N=8, async off vs on, release per step vs per window vs no
  streaming, at 64 and 256 concurrent streams (256 out); plus the output-processing
  CPU time per token at output lengths 128 and 2048;
- `--ceiling`: the engine against its model's raw forward and an earlier revision
  (`--baseline-ref`), with a profiled step breakdown (loadtests/engine/engine_ceiling.py);
- `--process`: the engine loop on a thread vs in its own process, and per torch
  thread count (`--num-threads 1 2`), 200 streams;
- `--prefix`: prefix caching on vs off: a shared 1,024-token prefix plus unique
  64-token suffixes at concurrency 1 and 16, and a replay of the ShareGPT sample's
  multi-turn conversations (TTFT by turn);
- `--roofline`: this machine's float32 and bfloat16 `torch.mm` rate at the model's own
  step products (`smollm2-135m` at 64 and 256 streams by default), the decode
  throughput it allows, and the engine's decode throughput as a share of it
  (loadtests/engine/gemm_roofline.py);
- `--sampling`: greedy, temperature 1.0, and temperature 1.0 with top-k 50 and top-p 0.9
  on the trained preset (its 49k vocabulary), the sampler alone (beside the
  whole-vocabulary sort) and the engine (loadtests/engine/sampling_pace.py);
- `--structured`: 200 streams, every fourth held to a JSON schema, beside the same
  requests with no constrained neighbours, and the grammar engine's cost per token
  (loadtests/engine/structured_outputs.py); `--constraint tools`: required tool calls instead;
- `--accuracy`: each `--quantizations` mode's perplexity on a shipped text and its
  top-1 agreement with `none` (`--dtype`; loadtests/engine/quant_accuracy.py);
- `--paths`: decode tok/s at each `--concurrency` with every quantized layer on each
  of its paths, `none` beside (`--num-threads`, default 1; loadtests/engine/quant_crossover.py);
- `--limits`: this machine's read bandwidth and an `--input-len` prompt's GEMM time
  on every core (loadtests/engine/machine_limits.py);
- `--tensor-parallel`: the decode step at one rank against two (one thread each), the
  collectives' share of the step and a plan's cost (loadtests/engine/tensor_parallel_pace.py).
Configurations of a table are interleaved round by round (`--repeats`), medians.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from deltas.types import OutputKind
from loadtests.serving import datasets
from loadtests.engine.engine_runner import (engine_config, greedy, random_prompts, run_engine,
                                     run_process_engine, sessions_of)
from loadtests.serving.metrics import format_table, median_rows, ratio

MODES = ("matrix", "ceiling", "process", "prefix", "structured", "roofline", "sampling",
         "accuracy", "paths", "limits", "tensor_parallel")
# per mode: models, concurrency, output_len, repeats
DEFAULTS = {"core": (["tiny", "small"], [1, 16, 64], 128, 1),
            "matrix": (["tiny", "small"], [64, 256], 256, 1),
            "ceiling": (["tiny"], [200], 128, 1), "process": (["tiny"], [200], 128, 2),
            "prefix": (["tiny"], [1, 16], 128, 3),
            "structured": (["tiny"], [200], 128, 3),
            "roofline": (["smollm2-135m"], [64, 256], 64, 1),
            "sampling": (["smollm2-135m"], [64, 256], 64, 1),
            "accuracy": (["smollm2-135m"], [], 0, 1),
            "paths": (["smollm2-135m"], [1, 4, 8, 16, 32, 64], 0, 1),
            "limits": (["smollm2-135m"], [], 0, 1),
            "tensor_parallel": (["tiny", "smollm2-135m"], [1, 64, 256], 0, 2)}
TOK_S = ("output_throughput", "tok/s", ".0f")
TTFT = ("median_ttft_ms", "TTFT p50 ms", ".1f")
TPOT = [("median_tpot_ms", "TPOT p50 ms", ".2f"), ("p99_tpot_ms", "p99", ".2f")]
ITL = [("median_itl_ms", "ITL p50 ms", ".2f"), ("p99_itl_ms", "p99", ".2f")]
HIT = ("prefix_cache_hit_rate", "hit rate", ".2f")


def interleaved(runs: dict, repeats: int) -> dict[str, dict]:
    """{name: () -> row}, run round by round (a noisy machine): median rows."""
    return median_rows([{name: fn() for name, fn in runs.items()} for _ in range(repeats)])


def _print(title: str, rows: dict, columns, **kw) -> None:
    print(f"\n{title}\n{format_table(rows, columns, **kw)}", flush=True)


# -- default: the engine beside transformers ---------------------------------------------
def run_transformers(model_dir: str, batch: int, num_requests: int, input_len: int, output_len: int) -> dict:
    """transformers' greedy generate on the same workload, `batch` prompts at a time."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts(num_requests, input_len)
    total = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, num_requests, batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=4)
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"output_throughput": total / (time.perf_counter() - t0)}


def core_mode(args) -> dict:
    from replicas.checkpoints.presets import ensure_model_dir
    rows = {}
    with_hf = args.hf_batch_max > 0  # 0: the engine alone, no transformers reference
    for model in args.models:
        model_dir = ensure_model_dir(model)
        single = run_transformers(model_dir, 1, 2, args.input_len, args.output_len) if with_hf else None
        for c in args.concurrency:
            n = max(c, 4)
            row = run_engine(engine_config(model), sessions_of(random_prompts(n, args.input_len),
                                                               greedy(args.output_len)), c)
            if not with_hf:
                rows[f"{model} c={c}"] = row
                continue
            batch = min(c, args.hf_batch_max)
            batched = run_transformers(model_dir, batch, batch, args.input_len, args.output_len) \
                if c > 1 else single
            row.update(hf_single=single["output_throughput"], hf_batched=batched["output_throughput"])
            row["x_hf_single"] = ratio(row["output_throughput"], row["hf_single"])
            row["x_hf_batched"] = ratio(row["output_throughput"], row["hf_batched"])
            rows[f"{model} c={c}"] = row
        hf_columns = [("hf_single", "HF single tok/s", ".0f"),
                      ("hf_batched", "HF batched tok/s", ".0f"),
                      ("x_hf_single", "x HF single", ".1f"), ("x_hf_batched", "x HF batched", ".2f")]
        _print(f"{model}: {args.input_len} in / {args.output_len} out, greedy"
               + ("; HF = transformers' generate" if with_hf else ""),
               {k: r for k, r in rows.items() if k.startswith(model + " ")},
               [TOK_S, TPOT[0], *(hf_columns if with_hf else [])])
    return rows


# -- --matrix --------------------------------------------------------------------------
MATRIX = {  # name -> (EngineConfig overrides, output kind)
    "N1-sync": (dict(num_scheduler_steps=1, async_output=False), OutputKind.DELTA),
    "N1-async": (dict(num_scheduler_steps=1, async_output=True), OutputKind.DELTA),
    "N8-sync-step": (dict(num_scheduler_steps=8, async_output=False), OutputKind.DELTA),
    "N8-async-window": (dict(num_scheduler_steps=8, release_per_step=False), OutputKind.DELTA),
    "N8-async-step": (dict(num_scheduler_steps=8), OutputKind.DELTA),
    "N8-async-nostream": (dict(num_scheduler_steps=8), OutputKind.FINAL_ONLY),
}


def _matrix_row(model: str, c: int, input_len: int, output_len: int, name: str) -> dict:
    over, kind = MATRIX[name]
    row = run_engine(engine_config(model, **over), sessions_of(
        random_prompts(c, input_len), greedy(output_len, output_kind=kind)), c)
    if kind == OutputKind.FINAL_ONLY:  # one delta per request: TPOT and ITL mean nothing
        row.update(dict.fromkeys([k for k, _, _ in TPOT + ITL]))
    return row


def matrix_mode(args) -> dict:
    out = {"matrix": {}, "output_cost": {}}
    for model in args.models:
        for c in args.concurrency:
            rows = interleaved({name: lambda name=name: _matrix_row(
                model, c, args.input_len, args.output_len, name) for name in MATRIX}, args.repeats)
            out["matrix"][f"{model} c={c}"] = rows
            _print(f"{model}, {c} streams", rows, [TOK_S, *TPOT, *ITL,
                   ("mean_tokens_per_chunk", "tok/delta", ".2f")], name_header="config",
                   baseline="N1-sync", ratio_columns=[("output_throughput", "tok/s x")])
            step, window = rows["N8-async-step"], rows["N8-async-window"]
            print(f"per-step vs per-window: TPOT cost "
                  f"{100 * (step['median_tpot_ms'] / window['median_tpot_ms'] - 1):+.1f}%, median ITL "
                  f"{window['median_itl_ms'] / step['median_itl_ms']:.1f}x better", flush=True)
    lengths = (128, 2048)
    for n in lengths:
        row = run_engine(engine_config("tiny", num_scheduler_steps=8, max_model_len=max(lengths) + 64),
                         sessions_of(random_prompts(16, 16), greedy(n)), 16)
        out["output_cost"][f"output_len {n}"] = row
    _print("Output processing CPU time per token (tiny, N=8, 16 streams)", out["output_cost"],
           [("output_cpu_us_per_token", "us/token", ".2f")], baseline=f"output_len {lengths[0]}",
           ratio_columns=[("output_cpu_us_per_token", "x")])
    return out


# -- --process -----------------------------------------------------------------------------
def process_mode(args) -> dict:
    out = {}
    for model in args.models:
        for n in args.concurrency:
            work = lambda: sessions_of(random_prompts(n, args.input_len), greedy(args.output_len))  # noqa: E731
            runs = {"thread": lambda: run_engine(engine_config(model), work(), n)}
            runs.update({f"thread, {t} torch threads": lambda t=t: run_engine(
                engine_config(model, num_threads=t), work(), n) for t in args.num_threads})
            runs["process"] = lambda: run_process_engine(dict(model=model, max_num_seqs=256), work(), n)
            rows = out[f"{model} c={n}"] = interleaved(runs, args.repeats)
            _print(f"{model}, {n} streams, {args.input_len} in / {args.output_len} out; medians of "
                   f"{args.repeats} interleaved rounds", rows, [TOK_S, TPOT[0], *ITL, TTFT],
                   name_header="engine loop in", baseline="thread",
                   ratio_columns=[("output_throughput", "tok/s x")])
            print("tok/s by round: " + "; ".join(f"{name} {[round(x) for x in r['rounds_output_throughput']]}"
                                                 for name, r in rows.items()), flush=True)
    return out


# -- --prefix ------------------------------------------------------------------------------
def chat_conversations(tokenizer_dir: str, max_prompt_len: int) -> list[list[tuple[list[int], int]]]:
    """The sample's multi-turn conversations: per turn, (prompt ids, recorded reply tokens)."""
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


def chat_sessions(conversations, max_output_len: int):
    return [[(ids, greedy(min(reply_len, max_output_len))) for ids, reply_len in conv]
            for conv in conversations]


def prefix_mode(args) -> dict:
    from replicas.checkpoints.presets import resolve_tokenizer_dir
    model = args.models[0]
    configs = {name: engine_config(model, enable_prefix_caching=name == "on") for name in ("on", "off")}
    out = {"shared_prefix": {}, "chat": {}}
    for c in args.concurrency:
        n = args.num_prompts or (8 if c == 1 else 4 * c)
        work = sessions_of(random_prompts(n, args.suffix_len, seed=c, prefix_len=args.prefix_len),
                           greedy(args.output_len))
        rows = out["shared_prefix"][f"c={c}"] = interleaved(
            {name: lambda cfg=cfg: run_engine(cfg, work, c) for name, cfg in configs.items()}, args.repeats)
        _print(f"{model}: {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffix, "
               f"{args.output_len} out, {n} prompts, concurrency {c}", rows,
               [TTFT, ("p90_ttft_ms", "TTFT p90 ms", ".1f"), TOK_S, HIT], name_header="caching",
               baseline="off", ratio_columns=[("median_ttft_ms", "TTFT x"), ("output_throughput", "tok/s x")])
    # NOTE: 2048 is the presets' context; longer turns end their conversation.
    convs = chat_conversations(resolve_tokenizer_dir(model), 2048 - args.chat_output_len - 1)
    convs = convs[:args.chat_conversations or None]
    for c in args.chat_concurrency:
        work = chat_sessions(convs, args.chat_output_len)
        rows = out["chat"][f"c={c}"] = interleaved(
            {name: lambda cfg=cfg: run_engine(cfg, work, c) for name, cfg in configs.items()}, args.repeats)
        _print(f"{model}: multi-turn chat replay, {len(convs)} conversations "
               f"({sum(map(len, convs))} turns), {c} at once", rows,
               [("median_ttft_turn1_ms", "TTFT turn 1", ".1f"), ("median_ttft_turn2_ms", "turn 2", ".1f"),
                ("median_ttft_turn3+_ms", "turn 3+", ".1f"), TTFT, TOK_S, HIT], name_header="caching",
               baseline="off", ratio_columns=[("median_ttft_ms", "TTFT x")])
    return out


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtests.bench_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ap.add_mutually_exclusive_group()
    for mode in MODES:
        modes.add_argument(f"--{mode.replace('_', '-')}", dest=mode, action="store_true")
    ap.add_argument("--models", "--model", nargs="+", default=None, help="default: per mode")
    ap.add_argument("--concurrency", "--num-requests", type=int, nargs="+", default=None,
                    help="streams at once (--process: streams, all at once)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=None,
                    help="default: 256 with --matrix, else 128")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved rounds, medians (default: 2 --process and --tensor-parallel; "
                         "3 --prefix and --structured; else 1)")
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--hf-batch-max", type=int, default=64,
                    help="default mode: transformers' largest batch; 0 skips the transformers "
                         "reference (the engine's rows only)")
    ap.add_argument("--baseline-ref", default=None,
                    help="--ceiling: also run the engine at this git revision, interleaved")
    ap.add_argument("--current-ref", default=None,
                    help="--ceiling: compare only the engines of this revision and --baseline-ref")
    ap.add_argument("--num-threads", type=int, nargs="*", default=[],
                    help="--process: a thread row per torch thread count")
    ap.add_argument("--prefix-len", type=int, default=1024, help="--prefix: shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=64, help="--prefix: unique suffix tokens")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="--prefix: per run; default 8 at concurrency 1, else 4 x concurrency")
    ap.add_argument("--chat-concurrency", type=int, nargs="*", default=[1, 8],
                    help="--prefix: conversations at once (none: skip the chat replay)")
    ap.add_argument("--chat-output-len", type=int, default=64, help="--prefix: cap on each reply")
    ap.add_argument("--chat-conversations", type=int, default=24,
                    help="--prefix: the first this many multi-turn conversations (0: all)")
    ap.add_argument("--constrained-every", type=int, default=4,
                    help="--structured: every this many streams carries a JSON schema")
    ap.add_argument("--constraint", default="json", choices=("json", "tools"),
                    help="--structured: what the constrained streams are held to: a JSON "
                         "schema, or a required tool call (chat's tool grammar)")
    ap.add_argument("--quantizations", nargs="+", default=["none", "auto", "int8", "int4"],
                    help="--accuracy: the modes, each against none")
    ap.add_argument("--dtype", default=None,
                    help="--accuracy (default float32), --paths and --limits (default auto)")
    ap.add_argument("--path", default="kernel", choices=("kernel", "batch", "gemm"),
                    help="--accuracy: the quantized layers' path for every row")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    mode = next((m for m in MODES if getattr(args, m)), "core")
    models, concurrency, output_len, repeats = DEFAULTS[mode]
    args.models, args.concurrency = args.models or models, args.concurrency or concurrency
    args.output_len, args.repeats = args.output_len or output_len, args.repeats or repeats
    os.makedirs(args.result_dir, exist_ok=True)
    if mode == "ceiling":
        from loadtests.engine.engine_ceiling import ceiling_run
        result = {"ceiling": [ceiling_run(m, c, args) for m in args.models for c in args.concurrency]}
    elif mode == "structured":
        from loadtests.engine.structured_outputs import report
        result = {f"{m} c={c}": report(m, c, args.constrained_every, args.input_len,
                                       args.output_len, args.repeats, args.constraint)
                  for m in args.models for c in args.concurrency}
    elif mode == "roofline":
        from loadtests.engine.gemm_roofline import report
        result = report(args.models, args.concurrency, args.input_len, args.output_len)
    elif mode == "sampling":
        from loadtests.engine.sampling_pace import report
        result = report(args.models, args.concurrency, args.input_len, args.output_len,
                        args.repeats)
    elif mode == "accuracy":
        from loadtests.engine.quant_accuracy import report
        result = report(args.models, args.quantizations, args.dtype or "float32", path=args.path)
    elif mode == "paths":
        from loadtests.engine.quant_crossover import report
        result = report(args.models[0], args.concurrency,
                        args.num_threads[0] if args.num_threads else 1, args.dtype or "auto")
    elif mode == "tensor_parallel":
        from loadtests.engine.tensor_parallel_pace import report
        result = report(args.models, args.concurrency, args.repeats)
    elif mode == "limits":
        from loadtests.engine.machine_limits import report
        result = report(args.models[0], args.input_len, args.dtype or "auto")
    else:
        result = {"core": core_mode, "matrix": matrix_mode, "process": process_mode,
                  "prefix": prefix_mode}[mode](args)
    path = os.path.join(args.result_dir, "bench_engine.json" if mode == "core"
                        else f"bench_engine_{mode}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
