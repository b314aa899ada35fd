"""The HTTP matrix: the serving benchmark against several servers side by side in one
run, one table. `python -m loadtests.bench compare|http|routing [flags]`.

The presets, their rows and defaults are in loadtests/README.md. Each launched server
is a LocalServer (its own process group, stopped whatever happens); `routing` runs
its app on a local Ray in this process. The machine is shared: quote ratios.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shlex
import signal
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from loadtests.serving.serving_run import BenchConfig, make_parser, run_benchmark
from loadtests.serving.local_server import LocalServer, free_port, wait_healthy
from loadtests.serving.metrics import format_table, median_rows, ratio
from loadtests.serving.process_cpu import SHOWN as CPU_ROLES

APP_NAME = "stepstream"


@dataclass(slots=True, frozen=True)
class Server:
    name: str
    flags: tuple[str, ...] = ()  # launcher flags
    env: tuple[tuple[str, str], ...] = ()
    app_args: tuple[tuple[str, object], ...] | None = None  # an app on a Ray in this process
    # Another checkout to launch from (its cwd: Ray's workers import the driver's
    # directory first), e.g. the revision before a change, beside this one.
    tree: str | None = None


@dataclass(slots=True)
class Row:
    name: str
    server: Server | None  # None: the offline engine
    bench: dict = field(default_factory=dict)  # BenchConfig fields over the preset's


# -- running rows ------------------------------------------------------------------------
def _served(args, row: Row, base_url: str, pid: int | None, result_dir: Path) -> dict:
    values = {**vars(args), "result_dir": str(result_dir), **row.bench}
    cfg = BenchConfig.from_any({**values, "base_url": base_url, "server_pid": pid})
    result = asyncio.run(run_benchmark(cfg))
    out = {k: v for k, v in result.items() if k != "requests"}
    out.update({f"cpu_us {role}": us for role, us in result["cpu_us_per_output_token"].items()})
    return out


def _offline(args, row: Row) -> dict:
    from loadtests.engine.engine_runner import engine_config, greedy, random_prompts, run_engine, sessions_of
    b = {**vars(args), **row.bench}
    t = 1.0 if b["temperature"] is None else b["temperature"]
    prompts = random_prompts(b["num_prompts"], b["random_input_len"])
    return run_engine(engine_config(args.model), sessions_of(prompts, greedy(
        b["random_output_len"], temperature=t)), b["max_concurrency"] or b["num_prompts"])


@contextlib.contextmanager
def _app_in_process(app_args: dict):
    """The app on a Ray of this process: (base URL, None, every engine replica's stats)."""
    import ray
    from ray import serve

    from cluster.app import AppArgs, make_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(make_app(AppArgs.model_validate(app_args)), name=APP_NAME, route_prefix="/",
                  blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 300)

        def stats() -> list[dict]:
            handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
            prefix = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"
            ids = [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == "serve" and a["name"].startswith(prefix)]
            return [handle.stats.remote(pin_replica_id=rid).result(timeout_s=60) for rid in ids]
        yield base, None, stats
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def _start(server: Server, args, result_dir: Path):
    if server.app_args is not None:
        with _app_in_process({"model": args.model, **dict(server.app_args)}) as up:
            yield up
        return
    flags = list(server.flags) + (["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else [])
    log = result_dir / f"server-{server.name.replace(' ', '-')}.log"
    with LocalServer(flags, module=args.launcher, model=args.model, log_path=log,
                     startup_timeout_s=args.startup_timeout, env=dict(server.env) or None,
                     cwd=server.tree, session_nice=args.server_session_nice) as srv:
        print(f"\n[{server.name}] {shlex.join(srv.command[1:])}", flush=True)
        yield srv.base_url, srv.process.pid, None


def run_round(rows: list[Row], args, result_dir: Path) -> dict[str, dict]:
    """Each server started once, its rows run in order; the offline rows in between."""
    out: dict[str, dict] = {}
    for server, group in itertools.groupby(rows, key=lambda r: r.server):
        group = list(group)
        if server is None:
            out.update({row.name: _offline(args, row) for row in group})
            continue
        try:
            with _start(server, args, result_dir) as (base_url, pid, stats):
                out.update({row.name: _served(args, row, base_url, pid, result_dir) for row in group})
                if stats is not None:
                    for row in group:
                        out[row.name]["replica_stats"] = stats()
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"[{server.name}] failed: {exc}", flush=True)
            out.update({row.name: {"error": str(exc)} for row in group})
    return out


# -- presets -------------------------------------------------------------------------------
RELEASE_ROWS = {  # name -> (launcher flags, streamed)
    "N1": (("--num-scheduler-steps", "1"), True),
    "N8-window": (("--num-scheduler-steps", "8", "--release-per-window"), True),
    "N8-step": (("--num-scheduler-steps", "8"), True),
    # NOTE: without streaming TTFT is the whole latency and ITL is empty.
    "non-stream": (("--num-scheduler-steps", "8"), False),
}
COLUMNS = [("output_throughput", "out tok/s", ".2f"), ("median_tpot_ms", "TPOT med ms", ".2f"),
           ("p99_tpot_ms", "TPOT p99 ms", ".2f"), ("median_itl_ms", "ITL med ms", ".2f"),
           ("p99_itl_ms", "ITL p99 ms", ".2f"), ("median_ttft_ms", "TTFT med ms", ".2f"),
           ("mean_tokens_per_chunk", "tok/chunk", ".2f")]
# NOTE: shown, not plotted: how much of the run the client waited for a CPU; a large
# share means the row's ITL and TTFT include the client's own wait.
CLIENT_WAIT = ("client_cpu_wait_share", "client CPU wait", ".1%")
RATIOS = [("output_throughput", "tok/s x"), ("median_tpot_ms", "TPOT x"),
          ("median_itl_ms", "ITL x"), ("median_ttft_ms", "TTFT x")]
DEFAULT_VARIANTS = ("default=", "serve proxy=--front-door serve-proxy")
POLICIES = {"by load": 0, "prefix-aware": 256}  # prefix_routing_tokens
# NOTE: the servers this starts share the cores with the client. At an even share a
# saturated server's session kept the client off the CPU for up to seconds, and its
# per-step events arrived in bursts (median ITL 0.01 ms; loadtests/serving/client_wait.py).
# At 5 the client's session outweighs the server's 3:1 when both want a core; it
# wants ~10% of one, so the server loses only what the client uses anyway.
SERVER_SESSION_NICE = 5


def compare_rows(args) -> list[Row]:
    unknown = [c for c in args.configs if c not in RELEASE_ROWS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(RELEASE_ROWS)}")
    return [Row(name, Server(name, RELEASE_ROWS[name][0]), {
        "disable_stream": not RELEASE_ROWS[name][1], "save_result": True,
        "result_filename": f"bench-{name}.json"}) for name in args.configs]


def compare_table(rows: dict[str, dict], baseline: str) -> str:
    """Ratios against `baseline`; a failed row says so; a non-streamed answer is one
    chunk: its TPOT (0) and ITL (none) mean nothing and show as "-"."""
    shown = {}
    for name, row in rows.items():
        if row.get("error"):
            shown[name] = {"ok": "failed"}
            continue
        # NOTE: counts are medians over the rounds (floats): shown as whole requests
        completed, failed = round(row.get("completed", 0)), round(row.get("failed", 0))
        shown[name] = {**row, "ok": f"{completed}/{completed + failed}"}
        if not row.get("stream", True):
            shown[name].update({k: None for k, _, _ in COLUMNS if "tpot" in k or "itl" in k})
    columns = [("ok", "ok", "")] + COLUMNS + [CLIENT_WAIT]
    return format_table(shown, columns, name_header="config", baseline=baseline,
                        ratio_columns=RATIOS)


def report_compare(rows: dict[str, dict], args, result_dir: Path) -> dict:
    base = rows.get(args.baseline) or {}
    for row in rows.values():
        row["ratios"] = {k: ratio(row.get(k), base.get(k)) for k, _ in RATIOS} if not row.get("error") else {}
    table = compare_table(rows, args.baseline)
    print("\n" + table, flush=True)
    out = {"date": datetime.now().isoformat(timespec="seconds"), "baseline": args.baseline,
           "settings": vars(args), "rows": rows, "table": table}
    (result_dir / "compare.json").write_text(json.dumps(out, indent=1, default=str))
    ok_rows = {n: r for n, r in rows.items() if not r.get("error")}
    if ok_rows:
        from loadtests.serving.plots import plot_comparison  # matplotlib only here
        plot_comparison(ok_rows, [(k, h) for k, h, _ in COLUMNS], result_dir / "compare.png",
                        f"{args.model}: {args.num_prompts} prompts, {args.random_input_len} in / "
                        f"{args.random_output_len} out")
    print(f"wrote {result_dir / 'compare.json'} and {result_dir / 'compare.png'}")
    return out


def parse_variant(spec: str) -> Server:
    """'NAME=[@CHECKOUT] [VAR=value ...] [flags]' -> a launched server with that
    environment, started from that checkout (default: this one)."""
    name, _, rest = spec.partition("=")
    words = shlex.split(rest)
    tree = words.pop(0)[1:] if words and words[0].startswith("@") else None
    env = []
    while words and "=" in words[0] and not words[0].startswith("-"):
        env.append(tuple(words.pop(0).split("=", 1)))
    return Server(name.strip(), tuple(words), tuple(env), tree=tree)


def http_rows(args) -> list[Row]:
    # NOTE: each run on one server takes prompts of its own seed: the same prompts again
    # would hit the prefix cache and skip their prefill. 1.0 is sent as none, as clients do.
    variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    rows = [Row(f"offline, t={t:g}", None, {"temperature": t}) for t in args.temperatures]
    for i, server in enumerate(variants):
        rows += [Row(f"http {server.name}, t={t:g}", server, {
            "temperature": None if t == 1.0 else t, "seed": j}) for j, t in enumerate(args.temperatures)]
        if i == 0:
            rows.append(Row(f"http {server.name}, c=1", server, {
                "num_prompts": 10, "max_concurrency": 1, "temperature": None,
                "seed": len(args.temperatures)}))
    rows.append(Row("offline, c=1", None, {"num_prompts": 10, "max_concurrency": 1, "temperature": 1.0}))
    return rows


def report_http(rows: dict[str, dict], args, result_dir: Path) -> dict:
    variants = [parse_variant(v).name for v in args.variant or DEFAULT_VARIANTS]
    for name, row in rows.items():  # each served row against the offline engine at its temperature
        offline = rows.get(f"offline, {name.rsplit(', ', 1)[-1]}", {})
        row["x_offline"] = ratio(row.get("output_throughput"), offline.get("output_throughput"))
        if "cpu_us server" in row:
            row["cpu_us front door + ingress"] = row["cpu_us front door"] + row["cpu_us ingress"]
    print(f"\n{args.model}, {args.num_prompts} prompts, {args.random_input_len} in / "
          f"{args.random_output_len} out, streaming; medians of {args.repeats} round(s)")
    print(format_table(rows, [c for c in COLUMNS if c[0] != "p99_tpot_ms"]
                       + [("x_offline", "tok/s x offline", ".2f"), ("failed", "failed", "g"),
                          CLIENT_WAIT]))
    print("\nCPU us per output token")
    shown = (*CPU_ROLES, "server", "front door + ingress")
    print(format_table({n: r for n, r in rows.items() if "cpu_us server" in r},
                       [(f"cpu_us {role}", role, ".1f") for role in shown]))
    if "offline, t=0" in rows and "offline, t=1" in rows:
        print(f"offline t=1 vs greedy: {ratio(rows['offline, t=1']['output_throughput'], rows['offline, t=0']['output_throughput']) or 0:.2f}x")
    added = (rows[f"http {variants[0]}, c=1"].get("median_ttft_ms", float("nan"))
             - rows["offline, c=1"]["median_ttft_ms"])
    print(f"http {variants[0]}: +{added:.1f} ms median TTFT at concurrency 1")
    out = {"rows": rows, "variants": variants}
    (result_dir / "bench_http.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def routing_rows(args) -> list[Row]:
    app = {"num_engine_replicas": 2, "engine_num_cpus": 0.5, "ingress_num_cpus": 0.5,
           "num_threads": 1, "max_model_len": 2048}
    return [Row(name, Server(name, app_args=tuple({**app, "prefix_routing_tokens": tokens}.items())))
            for name, tokens in POLICIES.items()]


def report_routing(rows: dict[str, dict], args, result_dir: Path) -> dict:
    for row in rows.values():
        stats = row.pop("replica_stats", [])
        query = sum(s["num_prefix_cache_query_tokens"] for s in stats)
        row["cache_hit_rate"] = sum(s["num_prefix_cache_hit_tokens"] for s in stats) / query if query else 0.0
        row["requests_per_replica"] = sorted(s["num_requests_admitted"] for s in stats)
    print(f"\n{args.model}, 2 engine replicas, {args.num_prompts} prompts: {args.num_prefixes} shared "
          f"prefixes of {args.prefix_len} tokens + {args.suffix_len}-token suffixes, "
          f"{args.random_output_len} out, concurrency {args.max_concurrency}")
    print(format_table(rows, [("median_ttft_ms", "TTFT p50 ms", ".1f"), ("p99_ttft_ms", "p99", ".1f"),
                              ("output_throughput", "tok/s", ".0f"),
                              ("cache_hit_rate", "cache hit rate", ".3f"),
                              ("requests_per_replica", "requests per replica", "")], name_header="routing"))
    (result_dir / "bench_routing.json").write_text(json.dumps(rows, indent=1, default=str))
    return rows


_WORKLOAD = dict(model="tiny", dataset_name="random", random_input_len=128, random_output_len=128,
                 ignore_eos=True)
PRESETS = {  # name -> (rows, report, the workload's defaults)
    "compare": (compare_rows, report_compare, dict(
        _WORKLOAD, num_prompts=256, max_concurrency=256, timeout=600.0, run_timeout=1800.0)),
    "http": (http_rows, report_http, dict(
        _WORKLOAD, num_prompts=200, tokenizer="replicas/assets", disable_tqdm=True,
        result_dir="results")),
    "routing": (routing_rows, report_routing, dict(
        _WORKLOAD, dataset_name="prefix", num_prompts=96, num_prefixes=8, random_output_len=32,
        max_concurrency=8, tokenizer="replicas/assets", disable_tqdm=True, result_dir="results")),
}


def make_preset_parser(preset: str):
    p = make_parser(prog=f"python -m loadtests.bench {preset}",
                    description=__doc__.split("\n\n")[0] + f" Preset: {preset}.")
    p.set_defaults(**PRESETS[preset][2])
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians")
    p.add_argument("--launcher", default="cluster.serve_local",
                   help="server module (tests: loadtests.fake_server)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to every launched server")
    p.add_argument("--server-session-nice", type=int, default=SERVER_SESSION_NICE,
                   help="autogroup niceness of each launched server's session (Linux): the "
                        "client on the same cores then reads events as they arrive; 0 "
                        "shares the CPU evenly between the two sessions")
    if preset == "compare":
        p.add_argument("--configs", default=",".join(RELEASE_ROWS),
                       type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
                       help=f"comma-separated subset of {', '.join(RELEASE_ROWS)}")
        p.add_argument("--baseline", default="N8-window")
    if preset == "http":
        p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
        p.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS",
                       help="a server row: a name, then @CHECKOUT (launch from another "
                            "checkout, e.g. a git worktree of an earlier revision), environment "
                            "variables and launcher flags, e.g. "
                            "'2 engine cpus=OMP_WAIT_POLICY=passive --engine-num-cpus 2' "
                            f"(repeatable; default: {' and '.join(map(repr, DEFAULT_VARIANTS))})")
    return p


def _sigterm_exits(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so finally blocks and atexit stop the servers


def main(preset: str, argv: list[str]) -> dict:
    args = make_preset_parser(preset).parse_args(argv)
    make_rows, report, _ = PRESETS[preset]
    rows = make_rows(args)
    result_dir = Path(args.result_dir or f"results/{preset}-{datetime.now():%Y%m%d-%H%M%S}")
    result_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm_exits)
    return report(median_rows([run_round(rows, args, result_dir) for _ in range(args.repeats)]),
                  args, result_dir)
