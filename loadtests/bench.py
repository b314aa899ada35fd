"""The serving benchmark: `python -m loadtests.bench [flags]` runs one benchmark with
vLLM benchmark_serving's flags (loadtests/serving_run.py);

    python -m loadtests.bench compare|http|routing [flags]   # loadtests/serving_matrix.py
    python -m loadtests.bench sharegpt-sample [flags]          # loadtests/sharegpt_sample.py
"""
from __future__ import annotations

import asyncio
import sys

from loadtests.serving_run import BenchConfig, make_parser, run_benchmark  # noqa: F401 (library use)

MATRIX_MODES = ("compare", "http", "routing")


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sharegpt-sample"]:
        from loadtests.sharegpt_sample import main as write_sample
        return write_sample(argv[1:])
    if argv[:1] and argv[0] in MATRIX_MODES:
        from loadtests import serving_matrix
        return serving_matrix.main(argv[0], argv[1:])
    result = asyncio.run(run_benchmark(make_parser().parse_args(argv)))
    for key in ("result_path", "plot_path"):
        if key in result:
            print(f"wrote {result[key]}")
    return result


if __name__ == "__main__":
    main()
