"""Small random checkpoints of each family, built offline, for parity tests."""
from __future__ import annotations

import os

from replicas.checkpoints.random_checkpoint import write_random_checkpoint

_BASE = {
    "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

FAMILIES = {
    "llama": {**_BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
    "qwen2": {**_BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
              "tie_word_embeddings": True, "rope_theta": 1000000.0},
    "qwen3": {**_BASE, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "mistral": {**_BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": None},
}


def make_model_dir(root, family: str, seed: int = 0) -> str:
    path = os.path.join(str(root), f"{family}-{seed}")
    if not os.path.isdir(path):
        write_random_checkpoint(path, dict(FAMILIES[family]), seed=seed, perturb=True)
    return path
