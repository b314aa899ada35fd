"""The roofline mode's arithmetic, on the `tiny` preset: its step products are
exactly the model's matrix-multiply weights, and a run reports every column (the
figures themselves are not checked: tests assert correctness, never speed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.engine.gemm_roofline import matmul_flops_per_token, report, step_products


def _checkpoint(model: str):
    from safetensors.numpy import load_file

    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig

    model_dir = Path(ensure_model_dir(model))
    return ModelConfig.from_dir(model_dir), load_file(str(model_dir / "model.safetensors"))


def test_step_products_are_the_models_matmul_weights():
    config, tensors = _checkpoint("tiny")
    weights = sum(t.size for name, t in tensors.items() if name.endswith("_proj.weight"))
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied or not
    products = sum(k * n * count for _, k, n, count in step_products(config))
    assert products == weights + head.size
    assert matmul_flops_per_token(config) == 2 * products


@pytest.mark.slow
def test_a_run_reports_the_roofline_and_the_engines_share_of_it():
    result = report(["tiny"], [4], input_len=8, output_len=4, dtypes=("float32",))
    row = result["tiny"]["rows"]["float32, 4 streams"]
    for key in ("gemm_step_ms", "roofline_tok_s", "gemm_gflops", "decode_tok_s",
                "output_throughput"):
        assert row[key] > 0, key
    assert row["share_of_roofline"] == pytest.approx(row["decode_tok_s"] / row["roofline_tok_s"])
    assert 0 < row["lm_head_share"] < 1

