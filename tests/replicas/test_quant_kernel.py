"""The quantized-weight kernel computes the integer arithmetic it promises, on every
path a CPU may take (the 512-bit loop, AVX2, portable C), for every layout: a
torch emulation of that arithmetic (activations quantized per 16 values, one
integer dot per group) is the reference, and the float product with the
dequantized weights bounds what the activations' rounding may move."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from replicas.quant import kernel as quant_kernel
from replicas.quant.float_quantize import quantize_weight
from replicas.quant.gguf_blocks import BLOCK_TYPES, repack
from replicas.quant.linear import KERNEL_MAX_ROWS, QuantEmbedding, QuantLinear
from tests.native_kernel_support import why_not_built
from tests.replicas.test_quant_gguf_blocks import raw_tensor

_problem = why_not_built("quant_linear", quant_kernel.SOURCE)
pytestmark = pytest.mark.skipif(_problem is not None, reason=f"kernel not built: {_problem}")

# (N, K): rows not a multiple of 4 (the leftover-row loop), and an odd number of
# 32-value blocks (the 256-bit loop after the 512-bit one)
SHAPES = [(37, 96), (64, 256)]
BATCH_ROWS = [1, 2, 5, 8]


def emulate(x: torch.Tensor, weight) -> torch.Tensor:
    """The kernel's arithmetic in float64: per 16 values of x, d = max|x| / 127,
    hi = round(x / d) and lo = round((x - d hi) 256 / d) (in float32, as the kernel
    rounds them), so x is d/256 (256 hi + lo); each weight group's codes dotted with
    those, scaled, plus each group's min times the sum of the rounded activations."""
    M, K = x.shape
    xf = x.float().view(M, K // 16, 16)
    d = xf.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    hi = torch.round(xf * inv)
    lo = torch.round((xf - d * hi) * inv * 256).clamp(-127, 127)
    x_rounded = ((256 * hi.double() + lo.double()) * (d.double() / 256)).view(M, K)
    codes = weight.unpacked_codes().double()
    scales = weight.scales.double().repeat_interleave(weight.group, dim=1)
    out = x_rounded @ (codes * scales).T
    if weight.mins is not None:
        out += x_rounded @ weight.mins.double().repeat_interleave(weight.group, dim=1).T
    return out


def _weights():
    for type_name in sorted(BLOCK_TYPES):
        values = BLOCK_TYPES[type_name].values
        for N, K in SHAPES:
            if K % values == 0:
                yield f"{type_name}-{N}x{K}", repack(type_name, raw_tensor(type_name, (N, K)), (N, K))
    for scheme in ("int8", "int4"):
        yield f"{scheme}-37x96", quantize_weight(torch.randn(37, 96), scheme)


WEIGHTS = dict(_weights())


def run(kernels, x: torch.Tensor, weight, entry: str = "linear") -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.out_features), dtype=x.dtype)
    desc = quant_kernel.WeightDesc.of(weight)
    code = getattr(kernels, entry)(x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0],
                                   ctypes.addressof(desc), out.data_ptr(),
                                   out.dtype == torch.bfloat16, out.shape[1], 2)
    assert code == 0
    return out


def check_against_emulation(kernels):
    """The integer kernel against its emulation; the batch kernel against the float
    product with the dequantized weights (float32 activations: exact but for order,
    bfloat16: with the weights rounded to bfloat16 as the kernel rounds them)."""
    for name, weight in WEIGHTS.items():
        for M in BATCH_ROWS:
            x = torch.randn(M, weight.in_features)
            expected = emulate(x, weight)
            got = run(kernels, x, weight).double()
            scale = expected.abs().max()
            assert (got - expected).abs().max() <= 1e-4 * scale, (name, M)
            for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                xd = x.to(dtype)
                expected = xd.float() @ weight.dequantize().to(dtype).float().T
                got = run(kernels, xd, weight, "gemm").float()
                assert (got - expected).norm() / expected.norm() < tolerance, (name, M, dtype)


def test_the_native_build_computes_the_integer_arithmetic():
    check_against_emulation(quant_kernel.need_kernels())


def _build_with(flags: list[str], tmp_path) -> quant_kernel.QuantKernels:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    obj, lib = tmp_path / "quant_linear.o", tmp_path / "quant_linear.so"
    # NOTE: -ffast-math when compiling only, as native_kernels.build does: linked with
    # it, the library would flush denormals for the whole test process on load
    subprocess.run([cc, "-O3", *flags, "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-c",
                    str(quant_kernel.SOURCE), "-o", str(obj)], check=True, capture_output=True)
    subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"], check=True,
                   capture_output=True)
    return quant_kernel.QuantKernels(ctypes.CDLL(str(lib)))


def test_the_portable_build_computes_the_same_arithmetic(tmp_path):
    """What a CPU without AVX2 runs (built here with -march=x86-64 or none)."""
    import platform
    flags = ["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else []
    check_against_emulation(_build_with(flags, tmp_path))


def test_the_avx2_build_computes_the_same_arithmetic(tmp_path):
    """What an AVX2 machine without AVX-512 runs, also on one that has AVX-512."""
    from replicas.checkpoints.dtype_choice import cpu_flags as flags_of_this_cpu
    if not {"avx2", "fma", "f16c"} <= flags_of_this_cpu():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    check_against_emulation(_build_with(["-mavx2", "-mfma", "-mf16c"], tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_matches_the_float_product_within_the_activations_rounding(dtype):
    weight = WEIGHTS["Q4_1-64x256"]
    layer = QuantLinear([weight])
    reference = weight.dequantize()
    for M in (1, 3, 16, 17, 40):  # both sides of the kernel's row bound
        x = torch.randn(M, 256).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (M, 64)
        expected = x.float() @ reference.T
        assert (y.float() - expected).norm() / expected.norm() < 2e-2, M


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["Q6_K-64x256", "Q4_1-64x256", "Q8_0-37x96"])
def test_above_the_kernel_s_rows_a_layer_multiplies_the_exact_weights(name, dtype):
    """The batch kernel and the GEMM path: the dequantized weights (rounded to
    bfloat16 for bfloat16 activations, as a bfloat16 model's are), float sums."""
    weight = WEIGHTS[name]
    layer = QuantLinear([weight])
    reference = weight.dequantize().to(dtype).float()
    for rows in (KERNEL_MAX_ROWS[dtype] + 1, layer.gemm_max_rows, layer.gemm_max_rows + 1):
        x = torch.randn(rows, weight.in_features).to(dtype)
        y = layer(x)
        assert y.dtype == dtype
        expected = x.float() @ reference.T
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
        assert (y.float() - expected).norm() / expected.norm() < tolerance, rows


def test_parts_of_different_types_fill_their_own_columns_and_the_bias_is_added():
    parts = [WEIGHTS["Q4_1-64x256"], WEIGHTS["Q6_K-64x256"], WEIGHTS["Q8_0-64x256"]]
    bias = torch.randn(192)
    layer = QuantLinear(parts, bias)
    whole = torch.cat([p.dequantize() for p in parts])
    for M in (1, 4, 40):
        x = torch.randn(M, 256)
        expected = x @ whole.T + bias
        assert (layer(x) - expected).norm() / expected.norm() < 2e-2


def test_an_embedding_reads_exact_rows_and_refuses_ids_out_of_range():
    weight = WEIGHTS["Q8_0-64x256"]
    embedding = QuantEmbedding(weight, torch.float32)
    ids = torch.tensor([[0, 63], [5, 5]])
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    with pytest.raises(IndexError):
        embedding(torch.tensor([64]))
    rows = QuantEmbedding(weight, torch.bfloat16)(torch.tensor([7]))
    assert torch.equal(rows, weight.dequantize()[[7]].to(torch.bfloat16))


def test_a_layer_refuses_activations_it_cannot_read():
    layer = QuantLinear([WEIGHTS["Q4_0-64x256"]])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        layer(torch.randn(1, 256, dtype=torch.float16))
