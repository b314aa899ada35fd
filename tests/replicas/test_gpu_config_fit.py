"""Every shipped GPU serve config fits the GPU of the instance type its cluster YAML
runs engine replicas on: the weights, the largest step, the sampler's headroom and
the KV budget the config implies (replicas/kv_cache/kv_budget.py's own rule), with memory to
spare for CUDA graphs. Checkpoints are not on this machine: their config.json
fields are below."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from replicas.kv_cache.kv_budget import (DTYPE_BYTES, GIB, DeviceMemory, blocks_per_sequence,
                                         bytes_per_block, gpu_kv_cache_bytes, sampler_headroom_bytes)
from replicas.models.model_config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MIB = 2**20
# The cluster YAML each GPU serve config is deployed with (its header says so).
CLUSTER_OF = {"serve-gpu.yaml": "cluster.yaml"}
# GPU memory per instance type, as torch.cuda.mem_get_info reports the total (what
# gpu_memory_utilization is a share of). g6e.2xlarge: 1x NVIDIA L40S, sold as
# "48 GB"; with ECC on, the device reports 46,068 MiB.
GPU_MEMORY_BYTES = {"g6e.2xlarge": 46068 * MIB}
CPU_INSTANCE_TYPES = {"m7i.4xlarge"}
# config.json of each checkpoint a GPU config names (meta-llama/Llama-3.1-8B-Instruct
# on the Hugging Face hub; the fields the sizes depend on).
CHECKPOINTS = {
    "/models/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "max_position_embeddings": 131072,
    },
}
# What the profile measures beyond the weights, estimated from above: CUDA context
# and library workspaces outside torch, and the largest step's activations (x2 for
# what the estimate misses).
OUTSIDE_TORCH_BYTES = GIB
ACTIVATION_SAFETY = 2
# Left outside gpu_memory_utilization for decode CUDA graphs and fragmentation.
MIN_SPARE_BYTES = GIB


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _gpu_serve_configs() -> list[str]:
    names = []
    for path in sorted(CONFIGS.glob("serve*.yaml")):
        (app,) = _load(path.name)["applications"]
        if app["args"].get("engine_num_gpus", 0) > 0:
            names.append(path.name)
    return names


def weight_bytes(mc: ModelConfig, dtype_bytes: int) -> int:
    """Parameters of a Llama-family checkpoint (no biases) times the dtype's bytes."""
    h, i, kv = mc.hidden_size, mc.intermediate_size, mc.num_kv_heads * mc.head_dim
    per_layer = (h * mc.num_heads * mc.head_dim + 2 * h * kv + mc.num_heads * mc.head_dim * h
                 + 3 * h * i + 2 * h)
    embeddings = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return (mc.num_layers * per_layer + embeddings + h) * dtype_bytes


def largest_step_bytes(mc: ModelConfig, num_tokens: int, num_rows: int, dtype_bytes: int) -> int:
    """One layer's live activations over `num_tokens` (residual, normed input, q/k/v,
    attention out, gate/up, their product) and the sampled rows' logits (the model's
    dtype, then float32)."""
    per_token = (4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                 + 3 * mc.intermediate_size)
    return num_tokens * per_token * dtype_bytes + num_rows * mc.vocab_size * (dtype_bytes + 4)


def test_every_gpu_serve_config_names_its_cluster_and_checkpoint():
    assert sorted(CLUSTER_OF) == _gpu_serve_configs()
    for name in CLUSTER_OF:
        model = _load(name)["applications"][0]["args"]["model"]
        assert model in CHECKPOINTS, f"add {model}'s config.json fields to CHECKPOINTS"


def _gpu_memory_of_cluster(cluster_yaml: str) -> int:
    """The smallest GPU among the cluster's node types (replicas land on any of them)."""
    gpu_bytes = []
    for node_name, node in _load(cluster_yaml)["available_node_types"].items():
        instance = node["node_config"]["InstanceType"]
        assert instance in GPU_MEMORY_BYTES or instance in CPU_INSTANCE_TYPES, \
            f"{node_name}: add {instance}'s GPU memory (or that it has none) to the table"
        if instance in GPU_MEMORY_BYTES:
            gpu_bytes.append(GPU_MEMORY_BYTES[instance])
    assert gpu_bytes, f"{cluster_yaml} has no GPU node type"
    return min(gpu_bytes)


def kv_budget_problems(args: dict, total_bytes: int) -> list[str]:
    """Why the engine would not start, or not get the KV budget it is asked for, with
    these serve config args on a GPU of `total_bytes`; [] when it fits."""
    from cluster.app import AppArgs

    config = AppArgs.model_validate(args).engine_config()
    mc = ModelConfig.from_dict(CHECKPOINTS[config.model])
    dtype = config.dtype if config.dtype != "auto" else CHECKPOINTS[config.model]["torch_dtype"]
    dtype_bytes = DTYPE_BYTES[dtype]
    max_model_len = config.max_model_len or mc.max_position_embeddings
    num_rows = min(config.max_num_seqs, config.max_num_batched_tokens)
    num_tokens = min(config.max_num_batched_tokens, num_rows * (max_model_len - 1))
    peak = (weight_bytes(mc, dtype_bytes) + OUTSIDE_TORCH_BYTES
            + ACTIVATION_SAFETY * largest_step_bytes(mc, num_tokens, num_rows, dtype_bytes))
    free = gpu_kv_cache_bytes(DeviceMemory(total_bytes, peak), config.gpu_memory_utilization,
                              sampler_headroom_bytes(config.max_num_seqs, mc.vocab_size))
    block_bytes = bytes_per_block(dataclasses.replace(config, dtype=dtype), mc)
    one_sequence = blocks_per_sequence(max_model_len, config.num_scheduler_steps,
                                       config.block_size) * block_bytes
    problems = []
    if free < one_sequence:
        problems.append(f"{free / GIB:.2f} GiB left for the KV cache, less than one sequence of "
                        f"max_model_len {max_model_len} ({one_sequence / GIB:.2f} GiB)")
    if config.kv_cache_gib is not None and config.kv_cache_gib * GIB > free:
        problems.append(f"kv_cache_gib {config.kv_cache_gib:g} but only {free / GIB:.2f} GiB fit "
                        f"after {peak / GIB:.2f} GiB of weights and activations")
    spare = total_bytes * (1 - config.gpu_memory_utilization)
    if spare < MIN_SPARE_BYTES:
        problems.append(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                        f"{spare / GIB:.2f} GiB for CUDA graphs (needs {MIN_SPARE_BYTES / GIB:.0f})")
    return problems


@pytest.mark.parametrize("name", sorted(CLUSTER_OF))
def test_the_gpu_serve_config_fits_its_gpu(name):
    args = _load(name)["applications"][0]["args"]
    assert kv_budget_problems(args, _gpu_memory_of_cluster(CLUSTER_OF[name])) == []


def test_the_check_refuses_a_kv_cache_the_gpu_cannot_hold():
    # the old serve-gpu.yaml: 40 GiB of KV cache on top of ~15 GiB of weights on an L40S
    args = {**_load("serve-gpu.yaml")["applications"][0]["args"], "kv_cache_gib": 40}
    (problem,) = kv_budget_problems(args, GPU_MEMORY_BYTES["g6e.2xlarge"])
    assert problem.startswith("kv_cache_gib 40 but only")
    # the weights alone at a low utilization: not one sequence fits
    args["gpu_memory_utilization"] = 0.3
    assert "less than one sequence" in kv_budget_problems(args, GPU_MEMORY_BYTES["g6e.2xlarge"])[0]
