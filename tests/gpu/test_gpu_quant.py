"""Quantized weights on a GPU: the Triton kernel compiled (bfloat16 on the tensor
cores) against the dequantized product, and a GGUF file served in its own types."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_the_compiled_kernel_multiplies_as_stored(name, rows):
    from replicas.quant.gguf_blocks import repack
    from replicas.quant.linear import QuantLinear
    from tests.replicas.test_quant_gguf_blocks import raw_tensor

    weight = repack(name, raw_tensor(name, (512, 1024)), (512, 1024))
    layer = QuantLinear([weight]).to_device(torch.device("cuda"))
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ weight.dequantize().cuda().to(torch.bfloat16).float().T
    got = layer(x).float()
    assert (got - expected).norm() / expected.norm() < 1e-2


def test_a_gguf_file_in_its_own_types_answers_as_the_dequantized_one():
    from replicas import Engine, EngineConfig, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=16)
    answers = {}
    for quantization in ("gguf", "none"):
        config = EngineConfig(model="smollm2-135m", device="cuda", dtype="bfloat16",
                              quantization=quantization, kv_cache_gib=1.0)
        with Engine(config) as engine:
            answers[quantization] = engine.generate(["The capital of France is"], params)[0].text
    assert "Paris" in answers["gguf"] and "Paris" in answers["none"]
