"""PNG plots of benchmark results. Imports matplotlib (Agg): only import this module when plotting."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _metric_values(requests: list[dict]) -> dict[str, list[float]]:
    ok = [r for r in requests if r["success"]]
    return {
        "TTFT (ms)": [r["ttft_ms"] for r in ok],
        "TPOT (ms)": [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None],
        "ITL (ms)": [x for r in ok for x in r["itl_ms"]],
    }


def plot_distributions(requests: list[dict], path: str | Path, title: str = "",
                       clip_percentile: float = 99.0) -> None:
    """Histograms of TTFT, TPOT and ITL from a benchmark's per-request records, each with
    its median marked; the axis stops at `clip_percentile` (outliers would stretch it),
    and the title says how many values lie beyond."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (label, values) in zip(axes, _metric_values(requests).items()):
        name = label.split()[0]
        if not values:
            ax.set_title(f"{name}: no values")
            continue
        cap = float(np.percentile(values, clip_percentile))
        shown = [v for v in values if v <= cap]
        median = float(np.median(values))
        ax.hist(shown, bins=50, color="tab:blue", alpha=0.8)
        ax.axvline(median, color="tab:red", linestyle="--", label=f"median {median:.2f} ms")
        ax.set_xlim(0, cap * 1.02 or 1.0)
        ax.legend(loc="upper right")
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        ax.set_title(f"{name} (n={len(values)}; {len(values) - len(shown)} beyond "
                     f"p{clip_percentile:g} = {cap:.1f} ms, not shown)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_comparison(rows: dict[str, dict], columns: list[tuple[str, str]], path: str | Path,
                    title: str = "") -> None:
    """One bar chart per metric; rows maps a config name to its summary dict."""
    num_cols = min(4, len(columns))
    num_rows = -(-len(columns) // num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(4 * num_cols, 3.6 * num_rows), squeeze=False)
    names = list(rows)
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.flat, columns):
        ax.bar(names, [rows[n].get(key) or 0.0 for n in names], color="tab:blue")
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
