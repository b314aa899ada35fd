"""What quantized execution does to a model's predictions, on a fixed text.

For each `--quantization` mode the model reads the same text (the GNU FDL 1.3,
shipped in loadtests/data, 5,201 tokens with the trained preset's tokenizer) in
windows of `--window` tokens, teacher-forced: perplexity over every predicted
token, and top-1 agreement with `none` (the dequantized float path): how often
the mode's most likely next token is `none`'s. Every row of every window runs
through the integer kernel, as a decode step's rows do (the quantized layers'
batch and GEMM paths multiply the exact dequantized weights: they agree with
`none` but for float rounding); `--path batch|gemm` measures those.

    python -m loadtests.bench_engine --accuracy --quantizations none auto int8 int4

Prints one row per mode.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TEXT_PATH = Path(__file__).resolve().parents[1] / "data" / "gfdl-1.3.txt"
DEFAULT_WINDOW = 512


@dataclass(slots=True)
class ModeAccuracy:
    mode: str
    num_tokens: int  # predicted tokens
    perplexity: float
    top1_agreement: float | None  # with `none`'s argmax; None for none itself
    weight_bytes: int


def text_ids(model_dir: str) -> list[int]:
    from deltas.tokenization import Tokenizer
    return Tokenizer.from_dir(model_dir).encode(TEXT_PATH.read_text(encoding="utf-8"))


@torch.inference_mode()
def window_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of one prefill over `ids`, from position 0."""
    from replicas.attention.torch_backend import TorchAttentionBackend
    from replicas.kv_cache.memory_profile import allocate_kv_caches, profile_step_inputs

    T, block_size = len(ids), 16
    _, positions, meta, _, num_blocks = profile_step_inputs(T, 1, block_size, torch.device("cpu"))
    dtype = next(p.dtype for p in model.parameters())
    caches = allocate_kv_caches(num_blocks, block_size, model.config, dtype, torch.device("cpu"))
    return model(torch.tensor(ids), positions, caches, meta, TorchAttentionBackend(),
                 torch.arange(T))


PATHS = ("kernel", "batch", "gemm")


def route_rows(model, path: str) -> None:
    """Send every row of the quantized layers through one path: the integer kernel,
    the batch kernel, or the dequantized weights' GEMM (replicas/quant/linear.py)."""
    from replicas.quant.linear import QuantLinear
    everything = 1 << 30
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.kernel_max_rows = everything if path == "kernel" else 0
            module.gemm_max_rows = everything if path == "batch" else 0


def measure(model_name: str, modes: list[str], dtype: str = "float32",
            window: int = DEFAULT_WINDOW, max_tokens: int | None = None,
            path: str = "kernel") -> list[ModeAccuracy]:
    """One ModeAccuracy per mode; `none` is measured first (the reference)."""
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.loader import load_model
    from replicas.quant.choice import resolve_quantization
    from replicas.quant.summary import weight_bytes

    model_dir = ensure_model_dir(model_name)
    ids = text_ids(model_dir)[:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    reference: list[torch.Tensor] = []
    results = []
    for mode in ["none"] + [m for m in modes if m != "none"]:
        resolved, _ = resolve_quantization(mode, "cpu", model_dir)
        model = load_model(model_dir, dtype, torch.device("cpu"), window + 1, resolved)
        route_rows(model, path)
        nll, count, agree = 0.0, 0, 0
        for k, chunk in enumerate(windows):
            logits = window_logits(model, chunk)[:-1].float()
            targets = torch.tensor(chunk[1:])
            nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            count += len(targets)
            top1 = logits.argmax(-1)
            if mode == "none":
                reference.append(top1)
            else:
                agree += int((top1 == reference[k]).sum())
        results.append(ModeAccuracy(mode, count, math.exp(nll / count),
                                    None if mode == "none" else agree / count,
                                    weight_bytes(model)))
        del model
    return [r for r in results if r.mode in modes] if "none" in modes else results[1:]


def report(models: list[str], modes: list[str], dtype: str = "float32",
           window: int = DEFAULT_WINDOW, path: str = "kernel") -> dict:
    """Print one table per model (a row per mode) and return the rows."""
    result = {}
    for model in models:
        rows = measure(model, modes, dtype, window, path=path)
        base = next((r for r in rows if r.mode == "none"), None)
        print(f"\n{model}, {dtype}, {path} path\n{'mode':<6} {'tokens':>6} {'perplexity':>10} "
              f"{'vs none':>8} {'top-1 agree':>11} {'weights MB':>10}")
        for r in rows:
            ratio = f"{r.perplexity / base.perplexity - 1:+.2%}" if base and r is not base else ""
            agree = f"{r.top1_agreement:.2%}" if r.top1_agreement is not None else ""
            print(f"{r.mode:<6} {r.num_tokens:>6} {r.perplexity:>10.3f} {ratio:>8} {agree:>11} "
                  f"{r.weight_bytes / 1e6:>10.1f}", flush=True)
        result[model] = [asdict(r) for r in rows]
    return result
