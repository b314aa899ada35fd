"""Every GGUF block type the kernels read repacks losslessly: its layout dequantizes
to exactly the `gguf` package's values, bit for bit (a zero's sign aside), for tensors the tests write
(the package's own quantizer where it has one, random blocks with sane scales
where it does not: K-quants)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from replicas.quant.gguf_blocks import BLOCK_TYPES, repack  # noqa: E402
from replicas.quant.layouts import QuantizedWeight, can_concatenate, concatenate  # noqa: E402

# where each K-quant keeps its float16 super-block scales (d, and dmin where it has one)
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def raw_tensor(type_name: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """(N, K / values * nbytes) uint8 blocks of a tensor of `type_name`."""
    rng = np.random.default_rng(seed)
    kind = BLOCK_TYPES[type_name]
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name not in _K_SCALE_OFFSETS:
        weights = rng.standard_normal(shape).astype(np.float32) * 0.05
        return gguf.quantize(weights, qtype)
    N, K = shape
    raw = rng.integers(0, 256, size=(N, K // kind.values * kind.nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, kind.nbytes)
    scales = rng.uniform(1e-4, 1e-2, size=blocks.shape[0]).astype(np.float16)
    for offset in _K_SCALE_OFFSETS[type_name]:
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_each_type_repacks_to_exactly_the_gguf_package_s_values(type_name):
    shape = (24, 512)
    raw = raw_tensor(type_name, shape)
    reference = gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name))
    weight = repack(type_name, raw, shape)
    assert weight.layout == BLOCK_TYPES[type_name].layout
    assert weight.source == type_name
    ours = weight.dequantize().numpy()
    assert ours.shape == shape
    # NOTE: equal as values: bit for bit but for the sign of a zero (Q4_0's d * (8 - 8)
    # is -0 for a negative d in the package, +0 as d * 8 - 8 * d here)
    assert np.array_equal(ours, reference.reshape(shape))
    nonzero = reference.reshape(shape) != 0
    assert np.array_equal(ours[nonzero].view(np.uint32), reference.reshape(shape)[nonzero].view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_types_with_float16_scales_keep_them_float16(type_name):
    """Their scales and mins are float16 in the file: the repack keeps the bytes."""
    weight = repack(type_name, raw_tensor(type_name, (8, 64)), (8, 64))
    assert weight.scales.dtype == torch.float16


def test_a_repacked_q4_1_takes_the_file_s_bytes():
    raw = raw_tensor("Q4_1", (16, 256))
    assert repack("Q4_1", raw, (16, 256)).nbytes == raw.nbytes


def test_rows_select_and_stack_losslessly():
    a = repack("Q4_1", raw_tensor("Q4_1", (8, 64), 1), (8, 64))
    b = repack("Q4_1", raw_tensor("Q4_1", (4, 64), 2), (4, 64))
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(a.select_rows(order).dequantize(), a.dequantize()[order])
    assert can_concatenate([a, b])
    assert torch.equal(concatenate([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert not can_concatenate([a, repack("Q8_0", raw_tensor("Q8_0", (4, 64)), (4, 64))])


def test_a_layout_refuses_shapes_its_kernel_cannot_read():
    codes = torch.zeros(4, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight("u4", 32, 4, 48, codes, torch.zeros(4, 1), None, "Q4_0")
    with pytest.raises(ValueError, match="codes must be"):
        QuantizedWeight("u4", 32, 4, 64, codes, torch.zeros(4, 2), None, "Q4_0")
