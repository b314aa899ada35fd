"""A bounded soak: steady locust load for --minutes on loopback, then a verdict.

It starts the local app (loadtests/serving/local_server.py) unless --host names one, runs the
locust file headless with `--soak-out`, samples the app's RSS by role and the engines'
KV cache usage meanwhile, and prints the first and the last minute (loadtests/README.md).
Exit code 1 when any request failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from loadtests.serving.local_server import LocalServer
from loadtests.serving.process_cpu import processes

ROLES = ("engine", "ingress", "front door")
# NOTE: Ray's Prometheus exporter prefixes our metric names with "ray_".
KV_LINE = re.compile(r"^(?:ray_)?stepstream_kv_cache_usage(?:\{[^}]*\})?\s+([0-9.eE+-]+)",
                     re.M)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4 / 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--users", type=int, default=16, help="concurrent streams, steady")
    p.add_argument("--input-len", type=int, default=64, help="words per prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens")
    p.add_argument("--chat-ratio", type=float, default=0.25)
    p.add_argument("--model", default="tiny")
    p.add_argument("--host", help="an already running server on loopback (default: start one)")
    p.add_argument("--session-dir", help="its Ray session dir, for the KV gauge (with --host)")
    p.add_argument("--api-key", default=os.environ.get("STEPSTREAM_API_KEY", ""))
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for cluster.serve_local (repeatable)")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--result-dir", default="", help="default: a temporary directory")
    p.add_argument("--json", default="", help="write the result here")
    return p.parse_args(argv)


# ---- sampling the server's processes and metrics ----------------------------

def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_MIB
    except (OSError, IndexError, ValueError):
        return 0.0  # gone meanwhile


def rss_by_role(procs: list[tuple[int, str, str, object]]) -> dict[str, float]:
    """MiB of resident memory per role (summed over its processes)."""
    mib = dict.fromkeys(ROLES, 0.0)
    for pid, _, role, _ in procs:
        if role in mib:
            mib[role] += _rss_mib(pid)
    return mib


def session_dir_of(procs: list[tuple[int, str, str, object]]) -> str | None:
    for _, cmd, _, _ in procs:
        match = re.search(r"--session_dir=(\S+)", cmd)
        if match:
            return match.group(1)
    return None


def metrics_url(session_dir: str | None) -> str | None:
    if not session_dir:
        return None
    ports = sorted(Path(session_dir).glob("metrics_export_port_*"))
    if not ports:
        return None
    return f"http://127.0.0.1:{ports[0].read_text().strip()}/metrics"


def kv_usages(url: str | None) -> list[float]:
    """KV cache usage of each engine replica (fractions), [] when unknown."""
    if url is None:
        return []
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return []
    return [float(v) for v in KV_LINE.findall(text)]


class Sampler(threading.Thread):
    """Every `interval_s`: (seconds since start, RSS MiB by role, KV usage list)."""

    def __init__(self, root_pid: int | None, session_dir: str | None, interval_s: float):
        super().__init__(name="soak-sampler", daemon=True)
        self.root_pid, self.session_dir, self.interval_s = root_pid, session_dir, interval_s
        self.samples: list[tuple[float, dict, list]] = []
        self.metrics_url: str | None = None  # the Ray node's Prometheus endpoint
        self._stop_event = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.is_set():
            procs = processes(self.root_pid)
            if self.metrics_url is None:
                self.metrics_url = metrics_url(self.session_dir or session_dir_of(procs))
            self.samples.append((time.monotonic() - self.started_at, rss_by_role(procs),
                                 kv_usages(self.metrics_url)))
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)

    def minute(self, index: int) -> dict:
        rows = [s for s in self.samples if int(s[0] // 60) == index]
        if not rows:
            return {}
        kv = [v for _, _, usages in rows for v in usages]
        return {"num_samples": len(rows),
                "rss_mib": {role: max(r[role] for _, r, _ in rows) for role in ROLES},
                "kv_usage_mean": sum(kv) / len(kv) if kv else None,
                "kv_usage_max": max(kv) if kv else None}


# ---- the run ------------------------------------------------------------------

def locust_command(args: argparse.Namespace, host: str, csv_prefix: Path, out: Path) -> list[str]:
    seconds = max(1, int(round(args.minutes * 60)))
    cmd = [sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("locustfile.py")), "--headless",
           "-u", str(args.users), "-r", str(args.users), "--run-time", f"{seconds}s",
           "--stop-timeout", "60", "--host", host, "--model", args.model,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--chat-ratio", str(args.chat_ratio), "--csv", str(csv_prefix), "--only-summary",
           "--soak-out", str(out)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def run_soak(args: argparse.Namespace, host: str, root_pid: int | None,
             result_dir: Path) -> dict:
    sampler = Sampler(root_pid, args.session_dir, args.sample_s)
    out = result_dir / "per_minute.json"
    cmd = locust_command(args, host, result_dir / "soak", out)
    sampler.start()
    try:
        with open(result_dir / "locust.log", "wb") as log:
            # NOTE: its own process: locust's gevent patching must not touch this one.
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False,
                           timeout=args.minutes * 60 + 300)
    finally:
        sampler.stop()
    recorded = json.loads(out.read_text()) if out.exists() else {}
    last = max(0, int(args.minutes) - 1)
    return {"minutes": args.minutes, "users": args.users, "host": host,
            "recorded": recorded, "first_minute": sampler.minute(0),
            "last_minute": sampler.minute(last), "metrics_url": sampler.metrics_url,
            "samples": sampler.samples}


def _fmt(value, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def report(result: dict) -> str:
    rec = result["recorded"]
    per_minute = {m["minute"]: m for m in rec.get("per_minute", [])}
    last = max(0, int(result["minutes"]) - 1)
    first_m, last_m = per_minute.get(0, {}), per_minute.get(last, {})
    num_requests, num_failures = rec.get("requests", 0), rec.get("failures", 0)
    first, final = result["first_minute"], result["last_minute"]

    def p99(block: dict, kind: str):
        return (block.get(kind) or {}).get("p99_ms")

    lines = ["{s:=^60}".format(s=" Soak Result "),
             f"{'Duration (min), users:':<36}{result['minutes']:g}, {result['users']}",
             f"{'Requests (failed):':<36}{num_requests} ({num_failures})",
             f"{'Error rate:':<36}{100.0 * num_failures / max(1, num_requests):.3f}%",
             f"{'P99 TTFT (ms) all/first/last min:':<36}{_fmt(p99(rec, 'ttft'))} / "
             f"{_fmt(p99(first_m, 'ttft'))} / {_fmt(p99(last_m, 'ttft'))}",
             f"{'P99 ITL (ms) all/first/last min:':<36}{_fmt(p99(rec, 'itl'))} / "
             f"{_fmt(p99(first_m, 'itl'))} / {_fmt(p99(last_m, 'itl'))}"]
    for role in ROLES:
        a = (first.get("rss_mib") or {}).get(role)
        b = (final.get("rss_mib") or {}).get(role)
        growth = f" ({b - a:+.1f} MiB, {100.0 * (b - a) / a:+.1f}%)" if a and b else ""
        lines.append(f"{f'RSS {role} (MiB) first/last min:':<36}{_fmt(a)} / {_fmt(b)}{growth}")
    for name, key in (("mean", "kv_usage_mean"), ("max", "kv_usage_max")):
        a, b = first.get(key), final.get(key)
        lines.append(f"{f'KV usage {name} first/last min:':<36}"
                     f"{_fmt(None if a is None else 100 * a, '%')} / "
                     f"{_fmt(None if b is None else 100 * b, '%')}")
    lines.append("=" * 60)
    return "\n".join(lines)


def check_loopback(host: str) -> None:
    if urlparse(host).hostname not in _LOOPBACK:
        raise SystemExit(f"--host must be on loopback (127.0.0.1, localhost, ::1), not {host}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="soak-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    if args.host:
        check_loopback(args.host)
        result = run_soak(args, args.host.rstrip("/"), None, result_dir)
    else:
        server_args = list(args.server_arg)
        if args.api_key:
            server_args += ["--api-key", args.api_key]
        with LocalServer(server_args, model=args.model,
                         log_path=result_dir / "server.log") as server:
            print(f"server up at {server.base_url}; soaking {args.minutes:g} min with "
                  f"{args.users} users (results in {result_dir})", flush=True)
            result = run_soak(args, server.base_url, server.process.pid, result_dir)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["recorded"].get("failures", 1) else 0


if __name__ == "__main__":
    sys.exit(main())
