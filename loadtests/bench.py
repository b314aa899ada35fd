"""The serving benchmark: `python -m loadtests.bench [flags]` runs one benchmark with
vLLM benchmark_serving's flags (loadtests/serving/serving_run.py);

    python -m loadtests.bench compare|http|routing [flags]   # loadtests/serving/serving_matrix.py
    python -m loadtests.bench noisy-neighbours [flags]         # loadtests/serving/noisy_neighbours.py
    python -m loadtests.bench sharegpt-sample [flags]          # rewrites the bundled sample
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loadtests.serving import datasets
from loadtests.serving.serving_run import BenchConfig, make_parser, run_benchmark  # noqa: F401 (library use)

MATRIX_MODES = ("compare", "http", "routing")


def make_sample_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench sharegpt-sample",
                                     description="Write the synthetic ShareGPT-format sample.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-conversations", type=int, default=200)
    parser.add_argument("--output", type=Path, default=datasets.DEFAULT_SHAREGPT_PATH)
    return parser


def write_sample(argv: list[str]) -> None:
    args = make_sample_parser().parse_args(argv)
    text = datasets.render(datasets.build_conversations(args.seed, args.num_conversations))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.num_conversations} conversations, {len(text.encode())} bytes, to {args.output}")


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sharegpt-sample"]:
        return write_sample(argv[1:])
    if argv[:1] == ["noisy-neighbours"]:
        from loadtests.serving import noisy_neighbours
        return noisy_neighbours.main(argv[1:])
    if argv[:1] and argv[0] in MATRIX_MODES:
        from loadtests.serving import serving_matrix
        return serving_matrix.main(argv[0], argv[1:])
    result = asyncio.run(run_benchmark(make_parser().parse_args(argv)))
    for key in ("result_path", "plot_path"):
        if key in result:
            print(f"wrote {result[key]}")
    return result


if __name__ == "__main__":
    main()
