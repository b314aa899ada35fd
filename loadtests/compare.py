"""The seed's experiment, rerunnable: one local server per configuration, one table.

    python -m loadtests.compare --model tiny --num-prompts 256 --input-len 128 \\
        --output-len 128 --baseline N8-window --result-dir results/compare-tiny

For each row of the matrix it starts `python -m cluster.serve_local` with that row's
flags (its own process group, stopped at the end whatever happens), waits for
/health, runs the same benchmark (random prompts, ignore_eos, fixed lengths), and
prints one markdown table with ratios against the baseline row, plus JSON and PNG.
Side by side in one run, because this machine is shared and noisy: quote ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from loadtests.bench import BenchConfig, run_benchmark
from loadtests.local_server import LocalServer


@dataclass(slots=True, frozen=True)
class ConfigRow:
    name: str
    server_args: tuple[str, ...]
    stream: bool = True


MATRIX = (
    ConfigRow("N1", ("--num-scheduler-steps", "1")),
    ConfigRow("N8-window", ("--num-scheduler-steps", "8", "--release-per-window")),
    ConfigRow("N8-step", ("--num-scheduler-steps", "8")),
    # NOTE: without streaming TTFT is the whole latency and ITL is empty.
    ConfigRow("non-stream", ("--num-scheduler-steps", "8"), stream=False),
)
ROWS_BY_NAME = {row.name: row for row in MATRIX}

# (summary key, column header); ratios are taken for the RATIO_KEYS.
COLUMNS = (
    ("output_throughput", "out tok/s"),
    ("median_tpot_ms", "TPOT med ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("median_itl_ms", "ITL med ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("median_ttft_ms", "TTFT med ms"),
    ("mean_tokens_per_chunk", "tok/chunk"),
)
RATIO_KEYS = (
    ("output_throughput", "tok/s x"),
    ("median_tpot_ms", "TPOT x"),
    ("median_itl_ms", "ITL x"),
    ("median_ttft_ms", "TTFT x"),
)


def ratios_against(summary: dict, baseline: dict | None) -> dict[str, float | None]:
    out = {}
    for key, _ in RATIO_KEYS:
        base, value = (baseline or {}).get(key), summary.get(key)
        out[key] = value / base if base and value is not None else None
    return out


def _cell(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_table(rows: dict[str, dict], baseline: str) -> str:
    """Markdown table; rows maps name -> {"summary": {...}, "ratios": {...}, "error": str}."""
    header = ["config", "ok"] + [h for _, h in COLUMNS] + [f"{h} vs {baseline}" for _, h in RATIO_KEYS]
    lines = [header]
    for name, row in rows.items():
        s = row.get("summary") or {}
        if row.get("error"):
            lines.append([name, "failed"] + ["-"] * (len(header) - 2))
            continue
        ok = f"{s.get('completed', 0)}/{s.get('completed', 0) + s.get('failed', 0)}"
        # NOTE: a non-streamed answer is one chunk: its TPOT (0) and ITL (none) mean nothing.
        shown = lambda k: row.get("stream", True) or not ("tpot" in k or "itl" in k)  # noqa: E731
        cells = [_cell(s.get(k)) if shown(k) else "-" for k, _ in COLUMNS]
        cells += [_cell(row["ratios"].get(k), 3) if shown(k) else "-" for k, _ in RATIO_KEYS]
        lines.append([name, ok] + cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(line) for line in lines[1:]])


def _bench_config(args, row: ConfigRow, base_url: str, result_dir: Path) -> BenchConfig:
    return BenchConfig(
        base_url=base_url, endpoint=args.endpoint, model=args.model, tokenizer=args.tokenizer,
        dataset_name=args.dataset_name, dataset_path=args.dataset_path,
        num_prompts=args.num_prompts, random_input_len=args.input_len,
        random_output_len=args.output_len, sharegpt_output_len=None,
        ignore_eos=True, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        seed=args.seed, disable_stream=not row.stream, timeout=args.timeout,
        run_timeout=args.run_timeout, save_result=True, result_dir=str(result_dir),
        result_filename=f"bench-{row.name}.json", disable_tqdm=args.disable_tqdm)


def run_row(args, row: ConfigRow, result_dir: Path) -> dict:
    server_args = list(row.server_args)
    if args.max_num_seqs:
        server_args += ["--max-num-seqs", str(args.max_num_seqs)]
    server = LocalServer(server_args, module=args.launcher, model=args.model,
                         log_path=result_dir / f"server-{row.name}.log",
                         startup_timeout_s=args.startup_timeout)
    print(f"\n[{row.name}] {' '.join(server.command[1:])}", flush=True)
    with server:
        result = asyncio.run(run_benchmark(_bench_config(args, row, server.base_url, result_dir)))
    summary = {k: v for k, v in result.items() if k != "requests"}
    return {"server_args": server_args, "stream": row.stream, "summary": summary,
            "result_path": result.get("result_path")}


def run_matrix(args) -> dict:
    result_dir = Path(args.result_dir or f"results/compare-{datetime.now():%Y%m%d-%H%M%S}")
    result_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for name in args.configs:
        try:
            rows[name] = run_row(args, ROWS_BY_NAME[name], result_dir)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"[{name}] failed: {exc}", flush=True)
            rows[name] = {"error": str(exc), "summary": {}}
    baseline = (rows.get(args.baseline) or {}).get("summary")
    for row in rows.values():
        row["ratios"] = ratios_against(row["summary"], baseline) if not row.get("error") else {}
    table = format_table(rows, args.baseline)
    print("\n" + table, flush=True)
    out = {"date": datetime.now().isoformat(timespec="seconds"), "baseline": args.baseline,
           "settings": {k: v for k, v in vars(args).items() if k != "configs"} | {"configs": args.configs},
           "rows": rows, "table": table}
    (result_dir / "compare.json").write_text(json.dumps(out, indent=1, default=str))
    _plot(rows, result_dir / "compare.png", f"{args.model}: {args.num_prompts} prompts, "
          f"{args.input_len} in / {args.output_len} out")
    print(f"wrote {result_dir / 'compare.json'} and {result_dir / 'compare.png'}")
    return out


def _plot(rows: dict[str, dict], path: Path, title: str) -> None:
    from loadtests.plots import plot_comparison  # matplotlib only here

    ok_rows = {n: r["summary"] for n, r in rows.items() if not r.get("error")}
    if ok_rows:
        plot_comparison(ok_rows, list(COLUMNS), path, title)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the local app across a matrix of configs.")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokenizer", default=None, help="HF dir/tokenizer.json for exact prompt lengths")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to every server")
    p.add_argument("--configs", default=",".join(r.name for r in MATRIX),
                   type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
                   help=f"comma-separated subset of {', '.join(ROWS_BY_NAME)}")
    p.add_argument("--baseline", default="N8-window")
    p.add_argument("--result-dir", default=None, help="default: results/compare-<date>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per benchmark run")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--launcher", default="cluster.serve_local", help="server module (tests: loadtests.fake_server)")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _sigterm_exits(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so finally blocks and atexit stop the servers


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    unknown = [c for c in args.configs if c not in ROWS_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(ROWS_BY_NAME)}")
    signal.signal(signal.SIGTERM, _sigterm_exits)
    return run_matrix(args)


if __name__ == "__main__":
    main()
