"""The GPU path of quantized weights: the Triton kernel under Triton's interpreter on
CPU tensors, for every layout, against the float product with the dequantized
weights (rounded to the activations' dtype, as the kernel rounds them);
tests/gpu/test_gpu_quant.py runs it compiled."""
from __future__ import annotations

import pytest
import torch

from triton_interpreter import interpreted

triton_matmul = interpreted("replicas.quant.triton_matmul", "tests/gpu/test_gpu_quant.py")

from replicas.quant.float_quantize import quantize_weight  # noqa: E402
from replicas.quant.gguf_blocks import BLOCK_TYPES, repack  # noqa: E402
from tests.replicas.test_quant_gguf_blocks import raw_tensor  # noqa: E402

WEIGHTS = {name: repack(name, raw_tensor(name, (40, 256)), (40, 256)) for name in BLOCK_TYPES}
WEIGHTS["int4 (K=96)"] = quantize_weight(torch.randn(70, 96), "int4")


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_every_layout_as_stored(name, dtype):
    weight = WEIGHTS[name]
    reference = weight.dequantize().to(dtype).float()
    for rows in (1, 17):  # one tile of rows, and a masked second one
        x = torch.randn(rows, weight.in_features).to(dtype)
        out = torch.full((rows, weight.out_features + 8), 7.0, dtype=dtype)
        triton_matmul.quant_matmul_into(x, weight, out, 8)  # the columns of a second part
        expected = x.float() @ reference.T
        got = out[:, 8:].float()
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
        assert (got - expected).norm() / expected.norm() < tolerance
        assert bool((out[:, :8] == 7.0).all())  # the columns before are left alone
