"""The trained preset (SmolLM2-135M-Instruct from its registry package) and
transformers loading the very same GGUF file: the oracle on trained weights.

Loaded once per test session: the conversion is cached in the model cache, and
transformers' own load (dequantizing every tensor) takes seconds.
"""
from __future__ import annotations

import contextlib
import functools
import os

PRESET = "smollm2-135m"

# Completions and chats, English and not, short and long: the prompts the
# trained-weight parity tests run.
COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea, there lived",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Translate to French: good morning"},
     {"role": "assistant", "content": "Bonjour"},
     {"role": "user", "content": "And how do I say 'thank you very much', in 2024?"}],
]


@functools.lru_cache(maxsize=1)
def gguf_file() -> str:
    from replicas.checkpoints.presets import trained_preset_file
    return trained_preset_file(PRESET)


@functools.lru_cache(maxsize=1)
def model_dir() -> str:
    from replicas.checkpoints.presets import ensure_model_dir
    return ensure_model_dir(PRESET)


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers loads: one parse of a GGUF file per process, and one
    tensor-name map per (architecture, block count).

    Why: transformers parses the file anew for the config, the weights and the
    tokenizer (each parse walks the 49k-entry vocabulary field by field), and builds
    the same name map again for every tensor; these were most of the oracle's load.
    Both are read-only and pure, so sharing them changes nothing transformers
    computes."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = _shared_reader(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _shared_reader(reader_class):
    @functools.wraps(reader_class, updated=())
    def shared(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in _READERS:
            _READERS[key] = reader_class(path, mode)
        return _READERS[key]
    return shared


_READERS: dict = {}  # (path, mode) -> gguf.GGUFReader, for _gguf_parsed_once


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer
    path = gguf_file()
    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=1)
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    path = gguf_file()
    with _gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
