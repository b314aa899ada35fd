"""The full HTTP path through Ray Serve beside the offline engine, in one run:
`python -m loadtests.bench_http`.

Rows, each at every `--temperatures` value (0: greedy, sent as 0; 1: sent as
nothing, so the server's default 1.0, what OpenAI clients and vLLM's benchmark
client send):
- the offline AsyncEngine (no HTTP), with the engine's defaults: torch's own thread
  count (every core), where the served engine gets `engine_num_cpus` threads;
- the app through the local launcher (`python -m cluster.serve_local`) once per
  `--variant`: by default `make serve`'s own defaults, and Serve's Python proxy
  (`--front-door serve-proxy`), the fallback;
- concurrency 1 for the offline engine and the first variant (the TTFT HTTP adds).

Workload: the `tiny` preset, N prompts of 128 tokens, 128 output tokens,
ignore_eos, all sent at once, streaming. `--repeats R` runs R interleaved rounds
(each server started once per round) and reports medians. Each HTTP row also has
the CPU time per output token of the server's processes by role (front door,
ingress, engine, ray) and of the benchmark client, read from /proc
(`loadtests/process_cpu.py`).

`tok/event` is output tokens per SSE event; at least `2 - tok/event` of the
events carry exactly one token (every event carries one or more).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics

from loadtests.bench import BenchConfig, run_benchmark
from loadtests.bench_engine import _cfg, run_engine
from loadtests.local_server import LocalServer

KEYS = ("output_tokens_per_s", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "mean_tokens_per_chunk")
CPU_ROLES = ("front door", "ingress", "engine", "ray", "client")
DEFAULT_VARIANTS = ("default=", "serve proxy=--front-door serve-proxy")


def _temperature_sent(t: float) -> float | None:
    return None if t == 1.0 else t  # 1.0: send none, as clients do


def _served(srv: LocalServer, model: str, n: int, input_len: int, output_len: int,
            concurrency: int | None, temperature: float, seed: int) -> dict:
    """NOTE: each run on one server takes prompts of its own `seed`: the same prompts
    again would hit the prefix cache and skip their prefill."""
    cfg = BenchConfig(base_url=srv.base_url, model=model, dataset_name="random", seed=seed,
                      num_prompts=n, random_input_len=input_len, random_output_len=output_len,
                      ignore_eos=True, disable_tqdm=True, max_concurrency=concurrency,
                      tokenizer="replicas/assets", temperature=_temperature_sent(temperature),
                      server_pid=srv.process.pid, print_result=False)
    r = asyncio.run(run_benchmark(cfg))
    out = {"output_tokens_per_s": r["output_throughput"], **{k: r[k] for k in KEYS[1:] if k in r},
           "failed": r.get("failed", 0)}
    out.update({f"cpu_us {role}": us for role, us in r["cpu_us_per_output_token"].items()})
    return out


def _offline(model: str, n: int, concurrency: int, input_len: int, output_len: int,
             temperature: float) -> dict:
    r = run_engine(_cfg(model), n, concurrency, input_len, output_len, temperature=temperature)
    r["mean_tokens_per_chunk"] = r.pop("mean_tokens_per_delta")
    return r


def _variant(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """'NAME=[VAR=value ...] [flags]' -> (name, launcher flags, environment)."""
    name, _, rest = spec.partition("=")
    words = shlex.split(rest)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name.strip(), words, env


def _median_rows(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    rows = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
        rows[name] = {k: statistics.median(run[k] for run in runs) for k in keys}
        rows[name]["rounds_tokens_per_s"] = [run["output_tokens_per_s"] for run in runs]
    return rows


def run_round(args, variants: list[tuple[str, list[str]]], log: str) -> dict[str, dict]:
    n, il, ol, m = args.num_prompts, args.input_len, args.output_len, args.model
    rows = {}
    for t in args.temperatures:
        rows[f"offline, t={t:g}"] = _offline(m, n, n, il, ol, t)
    for name, flags, env in variants:
        with LocalServer(["--model", m] + flags, log_path=log, env=env) as srv:
            for i, t in enumerate(args.temperatures):
                rows[f"http {name}, t={t:g}"] = _served(srv, m, n, il, ol, None, t, seed=i)
            if name == variants[0][0]:
                rows[f"http {name}, c=1"] = _served(srv, m, 10, il, ol, 1, 1.0,
                                                    seed=len(args.temperatures))
    rows["offline, c=1"] = _offline(m, 10, 1, il, ol, 1.0)
    return rows


def print_report(rows: dict[str, dict], args, variants) -> None:
    print(f"\n{args.model}, {args.num_prompts} prompts, {args.input_len} in / {args.output_len} "
          f"out, streaming; medians of {args.repeats} round(s)")
    print("| row | " + " | ".join(KEYS) + " |\n|" + "---|" * (len(KEYS) + 1))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in KEYS) + " |")
    print("\nCPU us per output token")
    print("| row | " + " | ".join(CPU_ROLES) + " | server |\n|" + "---|" * (len(CPU_ROLES) + 2))
    for name, r in rows.items():
        if "cpu_us server" in r:
            print(f"| {name} | " + " | ".join(f"{r.get('cpu_us ' + role, 0.0):.1f}"
                                              for role in (*CPU_ROLES, "server")) + " |")
    print()
    for t in args.temperatures:
        offline = rows[f"offline, t={t:g}"]["output_tokens_per_s"]
        if t != 0 and "offline, t=0" in rows:
            print(f"offline t={t:g} vs greedy: {offline / rows['offline, t=0']['output_tokens_per_s']:.2f}x")
        for name, _, _ in variants:
            r = rows[f"http {name}, t={t:g}"]
            per_event = r["mean_tokens_per_chunk"]
            doors = r.get("cpu_us front door", 0.0) + r.get("cpu_us ingress", 0.0)
            print(f"http {name}, t={t:g}: {r['output_tokens_per_s'] / offline:.2f}x offline tok/s; "
                  f"front door + ingress {doors:.1f} us/token; {per_event:.3f} tok/event; "
                  f"failed {r['failed']:g}")
    first = variants[0][0]
    added = rows[f"http {first}, c=1"]["median_ttft_ms"] - rows["offline, c=1"]["median_ttft_ms"]
    print(f"http {first}: +{added:.1f} ms median TTFT at concurrency 1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS",
                    help="a server row: a name, then environment variables and `serve_local` "
                         "flags, e.g. '2 engine cpus=OMP_WAIT_POLICY=passive --engine-num-cpus 2' "
                         "(repeatable; default: "
                         f"{' and '.join(repr(v) for v in DEFAULT_VARIANTS)})")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians")
    ap.add_argument("--result-dir", default="results")
    args = ap.parse_args()
    os.makedirs(args.result_dir, exist_ok=True)
    log = os.path.join(args.result_dir, "bench_http_server.log")
    variants = [_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    rounds = [run_round(args, variants, log) for _ in range(args.repeats)]
    rows = _median_rows(rounds)
    print_report(rows, args, variants)
    with open(os.path.join(args.result_dir, "bench_http.json"), "w") as f:
        json.dump({"rows": rows, "rounds": rounds, "variants": variants}, f, indent=1)


if __name__ == "__main__":
    main()
