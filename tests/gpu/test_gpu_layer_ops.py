"""The Triton layer ops compiled on a GPU against llama.py's torch expressions at
an 8B model's widths, and a half-precision engine that runs them inside its decode
graphs. Skipped without CUDA (tests/conftest.py skips the `gpu` marker)."""
import random

import pytest
import torch
import torch.nn.functional as F

from replicas import Engine, EngineConfig, SamplingParams
from tests.model_dirs import make_model_dir

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]


def _ops():
    pytest.importorskip("triton")
    from replicas.models.triton_layer_ops import TritonLayerOps
    return TritonLayerOps()


def _assert_within_two_ulps(got, want):
    """Rounded where torch rounds: equal but where float32's exp, division or a sum's
    order differ in their last bit, and then by an ulp or two (RMSNorm and SiLU x up
    round twice)."""
    eps = torch.finfo(want.dtype).eps
    difference = (got.float() - want.float()).abs()
    assert (difference <= 2 * eps * want.float().abs() + torch.finfo(want.dtype).tiny).all()
    assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("dtype", HALF)
def test_the_start_up_check_passes_on_cuda(dtype):
    from replicas.models.triton_layer_ops import check_against_torch
    assert check_against_torch(_ops(), torch.device("cuda"), dtype) is None


@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_silu_and_rotary_at_8b_widths(dtype):
    from replicas.models.layers import RMSNorm, RotaryEmbedding
    ops = _ops()
    x, residual = torch.randn(2, 256, 4096, device="cuda", dtype=dtype)
    norm = RMSNorm(4096, 1e-5).to(device="cuda", dtype=dtype)
    norm.weight.data.normal_()
    normed, h = ops.rms_norm(x, norm.weight.data, 1e-5, residual)
    assert torch.equal(h, x + residual)
    _assert_within_two_ulps(normed, norm(x + residual))
    gate_up = 4 * torch.randn(256, 2 * 14336, device="cuda", dtype=dtype)
    gate, up = gate_up.split(14336, dim=-1)
    _assert_within_two_ulps(ops.silu_mul(gate_up), F.silu(gate) * up)
    qkv = torch.randn(256, 48 * 128, device="cuda", dtype=dtype)
    cos, sin = torch.randn(2, 256, 1, 128, device="cuda", dtype=dtype)
    q, k = ops.rotary(qkv, cos, sin, 32, 8, 128)
    want = RotaryEmbedding.rotate(qkv[:, :40 * 128].view(256, 40, 128), cos, sin)
    assert torch.equal(q, want[:, :32]) and torch.equal(k, want[:, 32:])


def test_a_bfloat16_engine_runs_the_ops_inside_its_decode_graphs(tmp_path):
    pytest.importorskip("triton")
    from replicas.models.triton_layer_ops import load_triton_layer_ops
    model_dir = make_model_dir(tmp_path, "llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 8192) for _ in range(rng.randrange(1, 100))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", attention_backend="triton",
                          max_model_len=256, max_num_seqs=8, num_scheduler_steps=8)
    with Engine(config) as engine:
        ops = load_triton_layer_ops(torch.device("cuda"), torch.bfloat16)[0]
        assert ops is not None  # "cuda" and "cuda:0" share one check: none runs in a capture
        assert load_triton_layer_ops(torch.device("cuda:0"), torch.bfloat16)[0] is ops
        outs = engine.generate(prompts, params)
        assert engine.core.runner.decode_graphs.num_replays > 0
    assert [len(o.token_ids) for o in outs] == [24] * 6
