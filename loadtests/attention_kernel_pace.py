"""The CPU decode-attention kernel against its source at another revision, side by
side in one run: `python -m loadtests.bench_engine --attention --baseline-ref REF`.

Both builds get the same compiler flags (replicas/attention/native_kernels.py) and
the same inputs: a trained-shape cache (9 query heads over 3 KV heads of 64, blocks
of 16 tokens) with each sequence's blocks at random places, as a busy cache holds
them. Rounds alternate between the two builds; each row is the median over rounds.

Each timed pass runs the kernel over several layers' caches, at least COLD_BYTES in
all, and reports the time per layer: in the engine each layer's cache comes from
memory once per step. One layer's cache timed again and again (a 64-stream layer of
this shape is 4-8 MB) stays in the CPU's last-level cache, and a kernel that only
wins there (seen: 0.67x the time in cache, no change in the engine's step) would
look faster than it is.
"""
from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from loadtests.gemm_roofline import median_seconds
from replicas.attention import native_kernels

KERNEL = "paged_decode_attention"
COLD_BYTES = 256 * 2 ** 20
MAX_LAYERS = 64
SOURCE = f"replicas/attention/csrc/{KERNEL}.c"


def build_at(ref: str, tmp: Path):
    """The kernel compiled from its source at git revision `ref`, as a ctypes function
    (built into `tmp`, a private directory, the way the engine builds its own)."""
    source = tmp / "baseline.c"
    source.write_text(subprocess.run(["git", "show", f"{ref}:{SOURCE}"], check=True,
                                     capture_output=True, text=True).stdout)
    lib = ctypes.CDLL(str(native_kernels.build(KERNEL, tmp, source)))
    return native_kernels.decode_attention_function(lib, KERNEL)


def make_case(batch: int, context_len: int, h: int = 9, kvh: int = 3, d: int = 64, bs: int = 16):
    blocks_per_seq = -(-context_len // bs)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, bs, kvh, d)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    tables = (torch.randperm(num_blocks - 1)[:batch * blocks_per_seq] + 1).view(batch, -1)
    args = dict(q=torch.randn(batch, h, d), k=k_cache, v=v_cache,
                tables=tables.to(torch.int32).contiguous(),
                lens=torch.full((batch,), context_len, dtype=torch.int32),
                out=torch.empty(batch, h, d))
    dims = (batch, h, kvh, d, bs, blocks_per_seq)
    return args, dims


def layer_caches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) of as many layers as make COLD_BYTES (at most MAX_LAYERS), the case's own
    first: a pass over them reads each from memory, as a step over the layers does."""
    per_layer = args["k"].nbytes + args["v"].nbytes
    count = min(MAX_LAYERS, max(1, -(-COLD_BYTES // per_layer)))
    return [(args["k"], args["v"])] + [(torch.randn_like(args["k"]), torch.randn_like(args["v"]))
                                       for _ in range(count - 1)]


def time_call(fn, args, dims, caches) -> float:
    """Median seconds per layer of a pass over `caches`."""
    def one_pass():
        for k, v in caches:
            fn(args["q"].data_ptr(), k.data_ptr(), v.data_ptr(), args["tables"].data_ptr(),
               args["lens"].data_ptr(), args["out"].data_ptr(), *dims, 0.125,
               torch.get_num_threads())
    return median_seconds(one_pass, repeats=9) / len(caches)


def report(baseline_ref: str, batches: list[int], context_len: int, rounds: int) -> dict:
    current, problem = native_kernels.load_paged_decode_attention()
    if current is None:
        raise SystemExit(problem)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_at(baseline_ref, Path(tmp))
        print(f"decode attention, {context_len} tokens of context, 9/3 heads of 64, "
              f"{torch.get_num_threads()} threads, each layer's cache read from memory; "
              f"median of {rounds} interleaved rounds")
        print(f"| streams | now, us per layer | at {baseline_ref}, us per layer | now / then |\n"
              "|---|---|---|---|")
        for batch in batches:
            case, dims = make_case(batch, context_len)
            caches = layer_caches(case)
            now, then = [], []
            for _ in range(rounds):
                now.append(time_call(current, case, dims, caches))
                then.append(time_call(baseline, case, dims, caches))
            a, b = statistics.median(now), statistics.median(then)
            rows[f"{batch} streams"] = {"now_us": a * 1e6, "baseline_us": b * 1e6, "ratio": a / b}
            print(f"| {batch} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}x |", flush=True)
    return rows
