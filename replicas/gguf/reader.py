"""Open a GGUF file and check, before any tensor is dequantized, that stepstream
can serve it: a whole file (the reader fails on one cut short), its architecture
and every tensor's quantization type.

Every problem is a GgufError whose message names the file and what is wrong, in
one line, so the launcher can print it before Ray starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# NOTE: the architectures whose tensors and metadata keys replicas/gguf/llama_layout.py
# maps; llama.cpp writes Llama 2/3, Mistral and SmolLM checkpoints as "llama".
SUPPORTED_ARCHITECTURES = ("llama",)
_MAGIC = b"GGUF"
# Metadata arrays that hold one entry per token or merge: read only on demand.
_LONG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.scores")


class GgufError(ValueError):
    """A GGUF file stepstream cannot serve; the message names the file."""


@dataclass(slots=True)
class GgufTensor:
    name: str  # llama.cpp's name, e.g. blk.0.attn_q.weight
    type_name: str  # ggml quantization type, e.g. Q4_1
    shape: tuple[int, ...]  # row-major, as the dequantized array has it (out, in)
    data: Any  # np.memmap view of the raw bytes (or elements, for float types)
    qtype: Any  # gguf.GGMLQuantizationType


@dataclass(slots=True)
class GgufFile:
    path: str
    architecture: str
    metadata: dict[str, Any]  # scalars and short arrays as Python values
    tensors: dict[str, GgufTensor]
    _reader: Any

    def array(self, key: str) -> list | None:
        """A long metadata array (tokens, merges, token types) as a Python list."""
        field = self._reader.fields.get(key)
        return None if field is None else list(field.contents())

    def fail(self, problem: str) -> GgufError:
        return GgufError(f"{self.path}: {problem}")


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Open and check `path`; tensors stay memory-mapped, nothing is dequantized."""
    import gguf  # NOTE: here, so that importing replicas.gguf costs nothing

    path = str(Path(path).expanduser())
    if not os.path.isfile(path):
        raise GgufError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GgufError(f"{path}: not a GGUF file (it does not start with {_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - the reader raises whatever numpy does on a short file
        raise GgufError(f"{path}: truncated or damaged GGUF file ({type(error).__name__}: "
                        f"{error})") from None
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if key not in _LONG_ARRAYS}
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GgufError(f"{path}: architecture {architecture!r} is not supported "
                        f"(stepstream serves GGUF files of {', '.join(SUPPORTED_ARCHITECTURES)})")
    # NOTE: a file cut short fails in the reader above (its memory map of a tensor
    # comes up short), so every tensor here has all its bytes.
    tensors: dict[str, GgufTensor] = {}
    for tensor in reader.tensors:
        tensors[tensor.name] = GgufTensor(
            name=tensor.name, type_name=tensor.tensor_type.name,
            shape=tuple(int(n) for n in reversed(tensor.shape.tolist())),
            data=tensor.data, qtype=tensor.tensor_type)
    _check_types(path, tensors.values())
    return GgufFile(path, architecture, metadata, tensors, reader)


def _check_types(path: str, tensors) -> None:
    """Every tensor's type must be one the gguf package dequantizes."""
    import gguf

    checked: dict[str, bool] = {}
    for tensor in tensors:
        if tensor.type_name not in checked:
            _, type_size = gguf.GGML_QUANT_SIZES[tensor.qtype]
            try:  # NOTE: one block of zeros tells whether this type dequantizes at all
                gguf.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor.qtype)
                checked[tensor.type_name] = True
            except NotImplementedError:
                checked[tensor.type_name] = False
        if not checked[tensor.type_name]:
            raise GgufError(f"{path}: tensor {tensor.name} has quantization type "
                            f"{tensor.type_name}, which stepstream cannot dequantize")
