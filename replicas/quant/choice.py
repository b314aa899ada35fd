"""Resolves `quantization` at start-up to what the engine runs.

- `auto` (the default): a GGUF file's quantized matrices run in their own types
  (`gguf`), on CPU; any other checkpoint runs as stored (`none`).
- `none`: every weight dequantized to the run's dtype at load: the exact path the
  parity tests hold against transformers.
- `int8` / `int4`: a checkpoint's float weights quantized at load
  (replicas/quant/float_quantize.py).
The quantized kernels are CPU kernels: on CUDA `auto` runs `none` (logged), and
an explicit `int8`/`int4` is refused.

NOTE: torch-free (the ingress and the launcher resolve models without torch).
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("stepstream")

SCHEMES = ("int8", "int4")  # quantized at load (replicas/quant/float_quantize.py)
QUANTIZATIONS = ("auto", "none", *SCHEMES)
GGUF_NATIVE = "gguf"  # what `auto` resolves to for a GGUF file on CPU


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
    if requested in SCHEMES and not on_cpu:
        raise ValueError(f"quantization {requested} runs on CPU only (the quantized-weight "
                         f"kernels are CPU kernels); on {device} use quantization none")
    source = gguf_source_file(model_dir)
    if requested == GGUF_NATIVE and (source is None or not on_cpu):
        raise ValueError(f"quantization {GGUF_NATIVE} needs a GGUF file served on CPU "
                         f"(use one of {', '.join(QUANTIZATIONS)})")
    if requested != "auto":
        mode, why = requested, "requested explicitly"
    elif source is None:
        mode, why = "none", "auto: the checkpoint is not a GGUF file"
    elif not on_cpu:
        mode, why = "none", f"auto: quantized-weight kernels are CPU kernels (device {device})"
    else:
        mode, why = GGUF_NATIVE, f"auto: {os.path.basename(source)}'s own quantized types"
    logger.info("quantization: %s (%s)", mode, why)
    return mode, why
