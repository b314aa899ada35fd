"""The trained preset (SmolLM2-135M-Instruct from its registry package) and
transformers loading the very same GGUF file: the oracle on trained weights.

Loaded once per test session: the conversion is cached in the model cache, and
transformers' own load (dequantizing every tensor) takes seconds.
"""
from __future__ import annotations

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


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer
    path = gguf_file()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=1)
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    path = gguf_file()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return model
