"""The Triton layer ops (RMSNorm with its residual add, SiLU x up, rotary) under the
interpreter (CPU) against llama.py's torch expressions: float16 within an ulp;
bfloat16 within four, since the interpreter narrows float32 to bfloat16 by
truncation where a GPU rounds to nearest (tests/gpu/test_gpu_layer_ops.py checks
the compiled kernels)."""
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import interpreted

triton_layer_ops = interpreted("replicas.models.triton_layer_ops", "tests/gpu/test_gpu_layer_ops.py")

from replicas.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402

OPS = triton_layer_ops.TritonLayerOps()


def _randn(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _assert_agrees(got, want, dtype):
    """Within an ulp in float16 (float32's exp and sums may differ in their last bit
    from torch's). In bfloat16, whose every narrowing truncates here, within 4 ulps of
    the tensor's largest value (rotary's sum of two rounded products can cancel)."""
    eps = torch.finfo(dtype).eps
    difference = (got.float() - want.float()).abs()
    if dtype == torch.float16:
        assert (difference <= eps * (want.float().abs() + torch.finfo(dtype).tiny)).all()
        assert (got == want).float().mean() > 0.9
    else:
        assert (difference <= 4 * eps * want.float().abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 1000])  # a power of two, SmolLM2's width, neither
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_and_residual_add_match_torch(dtype, dim, with_residual):
    x, residual = _randn(7, dim, dtype=dtype, seed=1), _randn(7, dim, dtype=dtype, seed=2)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data.copy_(_randn(dim, dtype=dtype, seed=3))
    normed, h = OPS.rms_norm(x, norm.weight.data, 1e-5, residual if with_residual else None)
    want_h = x + residual if with_residual else x
    _assert_agrees(h, want_h, dtype)
    _assert_agrees(normed, norm(want_h), dtype)
    assert with_residual or h is x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [80, 1536, 1100])  # one block, SmolLM2's, a ragged last block
def test_silu_mul_matches_torch(dtype, inter):
    gate_up = _randn(5, 2 * inter, dtype=dtype, scale=4.0)
    gate, up = gate_up.split(inter, dim=-1)
    _assert_agrees(OPS.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 80)])
def test_rotary_matches_torch_for_q_and_k(dtype, num_heads, num_kv_heads, head_dim):
    T = 3
    # qkv rows hold q, k and v side by side; v (and any extra width) is left alone
    qkv = _randn(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    cos = _randn(T, 1, head_dim, dtype=dtype, seed=4)
    sin = _randn(T, 1, head_dim, dtype=dtype, seed=5)
    q, k = OPS.rotary(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(T, num_heads + num_kv_heads, head_dim)
    want = RotaryEmbedding.rotate(qk, cos, sin)
    assert q.shape == (T, num_heads, head_dim) and k.shape == (T, num_kv_heads, head_dim)
    _assert_agrees(q, want[:, :num_heads], dtype)
    _assert_agrees(k, want[:, num_heads:], dtype)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, dtype=torch.float16)
    normed, h = OPS.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-5, x)
    assert normed.shape == h.shape == (0, 64)
    assert OPS.silu_mul(torch.empty(0, 160, dtype=torch.float16)).shape == (0, 80)


def test_wrong_dtypes_and_shapes_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="half-precision"):
        OPS.rms_norm(x, torch.ones(64), 1e-5)
    half = x.half()
    with pytest.raises(TypeError, match="contiguous"):
        OPS.silu_mul(torch.randn(4, 2, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="inconsistent"):
        OPS.rms_norm(half, torch.ones(32, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="inconsistent"):
        table = half[:, :16].reshape(2, 1, 16).contiguous()
        OPS.rotary(half, table, table, 4, 2, 16)  # 64 wide: no room for 4 + 2 heads of 16


def test_the_start_up_check_accepts_the_kernels_and_names_a_broken_one(monkeypatch):
    assert triton_layer_ops.check_against_torch(OPS, torch.device("cpu"), torch.float16) is None
    broken = triton_layer_ops.TritonLayerOps()
    monkeypatch.setattr(broken, "silu_mul", lambda gate_up: gate_up[:, :gate_up.shape[1] // 2])
    problem = triton_layer_ops.check_against_torch(broken, torch.device("cpu"), torch.float16)
    assert problem is not None and "silu_mul" in problem


def test_a_kernel_that_fails_leaves_torch_operators(monkeypatch, caplog):
    def failing(ops, device, dtype=torch.bfloat16):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(triton_layer_ops, "check_against_torch", failing)
    monkeypatch.setattr(triton_layer_ops, "_loaded", {})
    ops, problem = triton_layer_ops.load_triton_layer_ops(torch.device("cpu"))
    assert ops is None and "no compiler" in problem
    assert "run as torch operators" in caplog.text
