"""Serving metrics on per-request timelines, with vLLM benchmark_serving's definitions.

TTFT = first content chunk - send; latency = last content chunk - send;
TPOT = (latency - TTFT) / (output tokens - 1), only for requests with >= 2 tokens;
ITL = every gap between consecutive content chunks (per chunk, not per token).
Percentiles are numpy's (linear interpolation), as vLLM's. Every tool of this
package summarises with `summarize` and prints with `format_result_block` or
`format_table`; rounds of a run are merged by `median_rows`. Pure functions: no I/O.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

BLOCK_WIDTH = 50  # the result block's '=' and '-' rules
LABEL_WIDTH = 40  # value starts at column 42: label padded to 40, then one space


@dataclass(slots=True)
class RequestTimeline:
    """One request as the client saw it; times in seconds on one monotonic clock."""
    send_time: float
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    num_output_tokens: int = 0
    chunk_num_tokens: list[int] | None = None  # per chunk, when the server tells
    prompt_len: int = 0
    success: bool = True
    error: str = ""

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times)


def ttft_s(t: RequestTimeline) -> float:
    return t.chunk_times[0] - t.send_time


def latency_s(t: RequestTimeline) -> float:
    return t.chunk_times[-1] - t.send_time


def tpot_s(t: RequestTimeline) -> float | None:
    """None for requests with fewer than 2 output tokens (vLLM skips them)."""
    if t.num_output_tokens < 2 or not t.chunk_times:
        return None
    return (latency_s(t) - ttft_s(t)) / (t.num_output_tokens - 1)


def itls_s(t: RequestTimeline) -> list[float]:
    times = t.chunk_times
    return [b - a for a, b in zip(times, times[1:])]


@dataclass(slots=True)
class Distribution:
    """mean/median/std and chosen percentiles of one metric, in milliseconds."""
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]
    count: int
    max_ms: float = 0.0

    @classmethod
    def from_seconds(cls, values_s: list[float], percentiles: tuple[float, ...]) -> "Distribution":
        # NOTE: `values or 0` mirrors vLLM: an empty metric reports 0, not NaN.
        arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
        return cls(mean_ms=float(np.mean(arr)), median_ms=float(np.median(arr)),
                   std_ms=float(np.std(arr)),
                   percentiles_ms={p: float(np.percentile(arr, p)) for p in percentiles},
                   count=len(values_s), max_ms=float(np.max(arr)))

    def to_dict(self) -> dict:
        """{"count", "mean_ms", "median_ms", "p99_ms", ..., "max_ms"}."""
        return {"count": self.count, "mean_ms": self.mean_ms, "median_ms": self.median_ms,
                **{f"p{_percentile_word(p)}_ms": v for p, v in self.percentiles_ms.items()},
                "max_ms": self.max_ms}


@dataclass(slots=True)
class BenchmarkSummary:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_chunks: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution

    @property
    def request_throughput(self) -> float:
        return self.num_completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        total = self.total_input_tokens + self.total_output_tokens
        return total / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_tokens_per_chunk(self) -> float:
        return self.total_output_tokens / self.total_chunks if self.total_chunks else 0.0

    def to_dict(self) -> dict:
        """Flat dict with vLLM's result-JSON key names (mean_ttft_ms, p99_itl_ms, ...)."""
        out = {
            "completed": self.num_completed, "failed": self.num_failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "total_chunks": self.total_chunks,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "mean_tokens_per_chunk": self.mean_tokens_per_chunk,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution = getattr(self, name)
            out[f"mean_{name}_ms"] = dist.mean_ms
            out[f"median_{name}_ms"] = dist.median_ms
            out[f"std_{name}_ms"] = dist.std_ms
            for p, value in dist.percentiles_ms.items():
                out[f"p{_percentile_word(p)}_{name}_ms"] = value
        return out


def summarize(timelines: list[RequestTimeline], duration_s: float,
              percentiles: tuple[float, ...] = (99.0,)) -> BenchmarkSummary:
    """Failed requests count only in num_failed (and add no tokens), as in vLLM."""
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = total_chunks = num_completed = 0
    for t in timelines:
        if not t.success or not t.chunk_times:
            continue
        num_completed += 1
        total_input += t.prompt_len
        total_output += t.num_output_tokens
        total_chunks += t.num_chunks
        ttfts.append(ttft_s(t))
        e2els.append(latency_s(t))
        itls.extend(itls_s(t))
        tpot = tpot_s(t)
        if tpot is not None:
            tpots.append(tpot)
    dist = lambda values: Distribution.from_seconds(values, percentiles)  # noqa: E731
    return BenchmarkSummary(
        num_completed=num_completed, num_failed=len(timelines) - num_completed,
        duration_s=duration_s, total_input_tokens=total_input,
        total_output_tokens=total_output, total_chunks=total_chunks,
        ttft=dist(ttfts), tpot=dist(tpots), itl=dist(itls), e2el=dist(e2els))


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _row(label: str, value) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    # NOTE: vLLM prints "{:<40} {:<10}"; the seed block has no trailing spaces.
    return f"{label:<{LABEL_WIDTH}} {text}"


def _section(title: str, fill: str) -> str:
    return f"{title:{fill}^{BLOCK_WIDTH}}"


_METRIC_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
)


def format_result_block(s: BenchmarkSummary) -> str:
    """The seed's result block, line for line (no trailing newline)."""
    lines = [
        _section(" Serving Benchmark Result ", "="),
        _row("Successful requests:", s.num_completed),
    ]
    if s.num_failed:
        lines.append(_row("Failed requests:", s.num_failed))
    lines += [
        _row("Benchmark duration (s):", float(s.duration_s)),
        _row("Total input tokens:", s.total_input_tokens),
        _row("Total generated tokens:", s.total_output_tokens),
        _row("Request throughput (req/s):", float(s.request_throughput)),
        _row("Output token throughput (tok/s):", float(s.output_throughput)),
        _row("Total Token throughput (tok/s):", float(s.total_token_throughput)),
    ]
    for attr, short, title in _METRIC_SECTIONS:
        dist: Distribution = getattr(s, attr)
        lines.append(_section(title, "-"))
        lines.append(_row(f"Mean {short} (ms):", dist.mean_ms))
        lines.append(_row(f"Median {short} (ms):", dist.median_ms))
        for p, value in dist.percentiles_ms.items():
            lines.append(_row(f"P{_percentile_word(p)} {short} (ms):", value))
    lines.append("=" * BLOCK_WIDTH)
    return "\n".join(lines)


def format_cpu_block(cpu_us: dict[str, float]) -> str:
    """CPU microseconds per output token by process role (loadtests/serving/process_cpu.py),
    in the result block's layout, to print under it."""
    lines = [_section(" CPU us per output token ", "-")]
    lines += [_row(f"{role}:", float(us)) for role, us in cpu_us.items()]
    lines.append(_section("", "="))
    return "\n".join(lines)


# ---- tables of runs side by side ---------------------------------------------------

def _cell(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def ratio(value, base) -> float | None:
    """value / base, None when either is missing or base is 0."""
    if value is None or not base or (isinstance(value, float) and math.isnan(value)):
        return None
    return value / base


def format_table(rows: dict[str, dict], columns, *, name_header: str = "row",
                 baseline: str | None = None, ratio_columns=()) -> str:
    """A markdown table, one line per row name. `columns`: (key, header, format spec);
    `ratio_columns`: (key, header), each row's value / the `baseline` row's. Missing,
    None and NaN show as "-"."""
    base = rows.get(baseline) or {}
    header = [name_header] + [h for _, h, _ in columns] + [f"{h} vs {baseline}" for _, h in ratio_columns]
    lines = [header]
    for name, row in rows.items():
        cells = [_cell(row.get(key), spec) for key, _, spec in columns]
        cells += [_cell(ratio(row.get(key), base.get(key)), ".3f") for key, _ in ratio_columns]
        lines.append([name] + cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(line) for line in lines[1:]])


def median_rows(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Rows of several interleaved rounds -> one row each: the median of every number
    (the first round's value for anything else), plus every round's throughput."""
    rows = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        row = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = statistics.median(run[key] for run in runs if key in run)
        if "output_throughput" in row:
            row["rounds_output_throughput"] = [run.get("output_throughput") for run in runs]
        rows[name] = row
    return rows
