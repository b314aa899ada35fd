"""Resolves `quantization` at start-up to what the engine runs.

- `auto` (the default): a GGUF file's quantized matrices run in their own types
  (`gguf`), on CPU; any other checkpoint runs as stored (`none`).
- `none`: every weight dequantized to the run's dtype at load: the exact path the
  parity tests hold against transformers.
- `gguf`: a GGUF file's own types, asked for explicitly (on a GPU, say).
- `int8` / `int4`: a checkpoint's float weights quantized at load
  (replicas/quant/float_quantize.py).
On CUDA `auto` runs `none` (logged): the GPU kernel (a Triton kernel,
replicas/quant/triton_matmul.py) runs when asked for explicitly (`gguf` for a GGUF
file's own types, `int8`, `int4`) until it is measured against bfloat16 on a GPU.

NOTE: torch-free (the ingress and the launcher resolve models without torch).
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("stepstream")

SCHEMES = ("int8", "int4")  # quantized at load (replicas/quant/float_quantize.py)
GGUF_NATIVE = "gguf"  # a GGUF file's own types: what `auto` resolves to for one on CPU
QUANTIZATIONS = ("auto", "none", GGUF_NATIVE, *SCHEMES)


def gguf_source_file(model_dir: str) -> str | None:
    """The GGUF file a converted directory came from, where it still exists."""
    from replicas.gguf.convert import SOURCE_FILE
    try:
        with open(os.path.join(model_dir, SOURCE_FILE)) as f:
            path = json.load(f).get("file")
    except (OSError, ValueError):
        return None
    return path if path and os.path.isfile(path) else None


def resolve_quantization(requested: str, device: str, model_dir: str) -> tuple[str, str]:
    """(one of gguf, none, int8, int4; why); logs both."""
    on_cpu = device.split(":")[0] == "cpu"
    if requested in SCHEMES + (GGUF_NATIVE,) and not on_cpu:
        problem = _gpu_kernel_problem()
        if problem:
            raise ValueError(f"quantization {requested} on {device} needs the Triton kernel: "
                             f"{problem}; use quantization none")
    source = gguf_source_file(model_dir)
    if requested == GGUF_NATIVE and source is None:
        raise ValueError(f"quantization {GGUF_NATIVE} needs a GGUF file "
                         f"(use one of {', '.join(QUANTIZATIONS)})")
    if requested != "auto":
        mode, why = requested, "requested explicitly"
    elif source is None:
        mode, why = "none", "auto: the checkpoint is not a GGUF file"
    elif not on_cpu:
        mode, why = "none", (f"auto: the GPU kernel runs only when asked for until measured "
                             f"(quantization {GGUF_NATIVE} runs the file's own types on {device})")
    else:
        mode, why = GGUF_NATIVE, f"auto: {os.path.basename(source)}'s own quantized types"
    logger.info("quantization: %s (%s)", mode, why)
    return mode, why


def _gpu_kernel_problem() -> str | None:
    """None where Triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed ({error})"
    return None
