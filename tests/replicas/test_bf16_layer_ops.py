"""The bfloat16 layer ops' C kernel (replicas/models/bf16_layer_ops.py) against the
torch expressions it stands for, and the model with it against the model on torch's
operators. Where the kernel builds it is used; without a compiler the model keeps
torch's operators (tested here by taking the kernel away)."""
import pytest
import torch
import torch.nn.functional as F

from replicas.models import bf16_layer_ops
from replicas.models.bf16_layer_ops import SOURCE, load_bf16_layer_ops
from replicas.models.layers import RMSNorm, RotaryEmbedding
from tests.native_kernel_support import why_not_built


WHY_NOT_BUILT = why_not_built("bf16_layer_ops", SOURCE)
needs_kernel = pytest.mark.skipif(WHY_NOT_BUILT is not None, reason=str(WHY_NOT_BUILT))


def _ops():
    ops, problem = load_bf16_layer_ops()
    assert ops is not None, problem
    return ops


def _norm(dim: int, seed: int) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.rand(dim, generator=g) + 0.5
    return norm.bfloat16()


def _steps_apart(got: torch.Tensor, ref: torch.Tensor, steps: int = 1) -> float:
    """Share of elements that differ, after checking none differs by more than
    `steps` bfloat16 steps (2**-7 of its magnitude each)."""
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * steps * 2 ** -7 + 1e-30).all()), diff.max()
    return float((got != ref).float().mean())


@needs_kernel
@pytest.mark.parametrize("T,D", [(1, 64), (7, 576), (256, 576), (300, 130)])
def test_rms_norm_and_its_residual_add_are_torch_s(T, D):
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, D, generator=g) * 3).bfloat16()
    residual = torch.randn(T, D, generator=g).bfloat16()
    norm = _norm(D, T)
    # NOTE: a row's float32 sum of squares in another order can move the normalized
    # value one step, which the weight's product can make two
    normed, h = _ops().rms_norm(x, norm.weight, norm.eps)
    assert h is x and _steps_apart(normed, norm(x), steps=2) < 1e-3
    normed, h = _ops().rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(h, x + residual)
    assert _steps_apart(normed, norm(x + residual), steps=2) < 1e-3
    assert normed.dtype == h.dtype == torch.bfloat16 and normed.shape == (T, D)


@needs_kernel
def test_extreme_values_give_what_torch_gives_and_no_nan():
    """exp(-v) overflows below about -88.7: SiLU is then -0, not NaN; a row whose sum
    of squares overflows normalizes to zeros, as torch's exact 1 / sqrt(inf) gives."""
    gate = torch.tensor([-1e4, -1000.0, -120.0, -88.0, -20.0, 0.0, 20.0, 100.0, 1e30] * 4)
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1).bfloat16()
    gate, up = gate_up.split(gate.numel(), dim=-1)
    got = _ops().silu_mul(gate_up)
    assert not bool(got.isnan().any()), got
    ref = F.silu(gate) * up
    # NOTE: with -ffast-math the division is a reciprocal, which flushes below 2**-126:
    # where 1 + exp(-v) passes 2**126 (v about -87.3 to -88.7) SiLU is -0 instead of a
    # value under 2e-36 on CPUs without AVX-512 (AVX2: the -88s here); none differs
    # by more than 1e-30 (in _steps_apart), and every larger value is torch's
    large = ref.float().abs() > 1e-30
    assert _steps_apart(got, ref, steps=2) < 0.15
    assert _steps_apart(got[large], ref[large], steps=2) < 0.1
    norm = _norm(64, 0)
    rows = torch.stack([torch.full((64,), 1e20), torch.linspace(-3, 3, 64)]).bfloat16()
    normed, _ = _ops().rms_norm(rows, norm.weight, norm.eps)
    assert torch.equal(normed, norm(rows)), (normed, norm(rows))


@needs_kernel
# NOTE: 300 leaves a tail after the vector loop and a short last chunk of 256
@pytest.mark.parametrize("T,I", [(1, 96), (5, 1536), (256, 1536), (3, 300)])
def test_silu_mul_is_torch_s_but_for_exp_s_last_bit(T, I):
    gate_up = (torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(I)) * 4).bfloat16()
    gate, up = gate_up.split(I, dim=-1)
    got = _ops().silu_mul(gate_up)
    assert got.shape == (T, I)
    # NOTE: SiLU's own last step, doubled by the product with up
    assert _steps_apart(got, F.silu(gate) * up, steps=2) < 1e-2


class _RopeConfig:
    head_dim, rope_theta, rope_scaling = 64, 10000.0, None


@needs_kernel
# NOTE: head size 48 (halves of 24) takes the scalar loop beside the vector one
@pytest.mark.parametrize("T,heads,kv_heads,d", [(1, 9, 3, 64), (33, 4, 2, 64), (256, 9, 3, 64),
                                                (5, 4, 2, 48)])
def test_rotary_is_torch_s_bit_for_bit(T, heads, kv_heads, d):
    """Each product and the sum round to bfloat16 where torch rounds them."""
    g = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    cfg = _RopeConfig()
    cfg.head_dim = d
    cos, sin = RotaryEmbedding(cfg, 4096).tables(torch.randint(0, 4096, (T,), generator=g),
                                                 torch.bfloat16)
    qk = RotaryEmbedding.rotate(qkv[:, :(heads + kv_heads) * d].view(T, heads + kv_heads, d),
                                cos, sin)
    q, k = _ops().rotary(qkv, cos, sin, heads, kv_heads, d)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert q.is_contiguous() and k.is_contiguous()


@needs_kernel
def test_wrong_dtypes_and_shapes_are_refused_before_the_kernel_reads_them():
    ops = _ops()
    weight = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.rms_norm(torch.ones(2, 8), weight, 1e-5)
    with pytest.raises(TypeError, match="contiguous"):
        ops.silu_mul(torch.ones(8, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="shapes"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16),
                     1e-5)


def _tiny_bf16_model():
    from replicas.checkpoints import presets
    from replicas.models.loader import load_model
    return load_model(presets.ensure_model_dir("tiny"), "bfloat16", torch.device("cpu"),
                      max_positions=512)


def _forward(model, ids):
    from replicas.attention.base import AttentionMetadata
    from replicas.attention.torch_backend import TorchAttentionBackend
    cfg = model.config
    T = len(ids)
    caches = [(torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16),
               torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16))
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), num_prefills=1, num_prefill_tokens=T,
        prefill_query_start_loc=[0, T], prefill_seq_lens=[T],
        prefill_block_tables=torch.arange(4, dtype=torch.int32).view(1, 4), num_decodes=0,
        decode_seq_lens=None, decode_block_tables=None, max_decode_seq_len=0)
    return model(torch.tensor(ids), torch.arange(T), caches, meta, TorchAttentionBackend(),
                 None)


@needs_kernel
def test_the_model_with_the_kernel_computes_what_it_does_on_torch_s_operators():
    model = _tiny_bf16_model()
    ids = list(range(3, 40))
    assert model.layer_ops(torch.zeros(1, dtype=torch.bfloat16)) is not None
    with_kernel = _forward(model, ids)
    model.native_layer_ops = False
    on_torch = _forward(model, ids)
    assert with_kernel.dtype == on_torch.dtype == torch.float32
    torch.testing.assert_close(with_kernel, on_torch, atol=0.05, rtol=0.02)
    agree = (with_kernel.argmax(-1) == on_torch.argmax(-1)).float().mean()
    assert agree >= 0.9, agree


def test_without_the_kernel_the_model_runs_torch_s_operators(monkeypatch):
    monkeypatch.setattr(bf16_layer_ops, "_ops", None)
    monkeypatch.setattr(bf16_layer_ops, "_problem", None)
    monkeypatch.setattr(bf16_layer_ops, "load_library", lambda name, source: (None, "no compiler"))
    assert load_bf16_layer_ops() == (None, "no compiler")
    model = _tiny_bf16_model()
    assert model.layer_ops(torch.zeros(1, dtype=torch.bfloat16)) is None
    logits = _forward(model, list(range(3, 20)))
    assert logits.shape[0] == 17 and bool(torch.isfinite(logits).all())


def test_float32_and_other_devices_keep_torch_s_operators():
    model = _tiny_bf16_model()
    assert model.layer_ops(torch.zeros(1)) is None
    assert model.layer_ops(torch.zeros(1, dtype=torch.bfloat16, device="meta")) is None
