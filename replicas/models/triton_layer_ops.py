"""RMSNorm (with the residual add before it), rotary and SiLU-times-up of a decoder
layer on a GPU, one Triton kernel each, for bfloat16 and float16 activations.

Why: torch runs each of them as a chain of small elementwise kernels with a
half-precision tensor written and read between each (RMSNorm alone is a float32
copy, a square, a mean, an rsqrt, two multiplies and two casts); in a
graph-captured decode step of an 8B-shaped model that chain is the largest GPU time
after the matrix multiplies and attention. Each kernel rounds where torch's
expressions in llama.py round (to the activation dtype after every operator), so
results differ from torch's only where float32 arithmetic differs in its last bit
(a sum's order, exp, division), by an ulp or two.

The same three methods as the CPU's C kernel (`bf16_layer_ops.Bf16LayerOps`), so
llama.py calls either. Runs on CPU tensors under `TRITON_INTERPRET=1` (set before
this module is imported), which is how the CPU tests check it.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger("stepstream")

HALF_DTYPES = (torch.bfloat16, torch.float16)
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, h_ptr, weight_ptr, out_ptr, dim, inv_dim, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + row * dim + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * dim + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's x + residual
        tl.store(h_ptr + row * dim + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    # NOTE: as torch: the mean is the sum times 1/dim, then rsqrt
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) * inv_dim + eps)
    normed = (x32 * inv_rms).to(x.dtype)  # torch: x32 * rsqrt(...), then .to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)  # weight * normed
    tl.store(out_ptr + row * dim + offs, out, mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * 2 * inter + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu in float32, rounded
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * inter + offs, out, mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, stride_qkv, cos_ptr, sin_ptr, q_ptr, k_ptr,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_P2)
    mask = offs < half
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    a = tl.load(src + offs, mask=mask, other=0.0)
    b = tl.load(src + half + offs, mask=mask, other=0.0)
    dtype = a.dtype
    table = token * HEAD_DIM + offs
    cos_a = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + table + half, mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + table + half, mask=mask, other=0.0).to(tl.float32)
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-b, a), each product rounded
    first = ((a32 * cos_a).to(dtype).to(tl.float32) + (-b32 * sin_a).to(dtype).to(tl.float32)).to(dtype)
    second = ((b32 * cos_b).to(dtype).to(tl.float32) + (a32 * sin_b).to(dtype).to(tl.float32)).to(dtype)
    # NOTE: q heads first, then k heads; each program stores into one of the two
    is_q = head < NUM_HEADS
    q_dst = q_ptr + (token * NUM_HEADS + head) * HEAD_DIM
    k_dst = k_ptr + (token * NUM_KV_HEADS + (head - NUM_HEADS)) * HEAD_DIM
    tl.store(q_dst + offs, first, mask=mask & is_q)
    tl.store(q_dst + half + offs, second, mask=mask & is_q)
    tl.store(k_dst + offs, first, mask=mask & (head >= NUM_HEADS))
    tl.store(k_dst + half + offs, second, mask=mask & (head >= NUM_HEADS))


class TritonLayerOps:
    """The three layer ops over contiguous half-precision tensors on one device."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, h): h = x, or x + residual (a new tensor), normed = RMSNorm(h)."""
        _check(x, weight, *(() if residual is None else (residual,)))
        dim = x.shape[-1]
        if weight.shape != (dim,) or (residual is not None and residual.shape != x.shape):
            raise ValueError("rms_norm got inconsistent shapes")
        out = torch.empty_like(x)
        h = x if residual is None else torch.empty_like(x)
        num_rows = x.numel() // dim
        if num_rows:
            _rms_norm_kernel[(num_rows,)](
                x, x if residual is None else residual, h, weight, out, dim, 1.0 / dim, eps,
                HAS_RESIDUAL=residual is not None, BLOCK_D=triton.next_power_of_2(dim))
        return out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of (T, 2 * I) -> (T, I)."""
        _check(gate_up)
        num_tokens, two_inter = gate_up.shape
        out = torch.empty((num_tokens, two_inter // 2), dtype=gate_up.dtype, device=gate_up.device)
        if num_tokens:
            _silu_mul_kernel[(num_tokens, triton.cdiv(two_inter // 2, SILU_BLOCK))](
                gate_up, out, two_inter // 2, BLOCK=SILU_BLOCK)
        return out

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous rotated q (T, heads, d) and k (T, kv heads, d) from the q and k at
        the front of each (T, width) qkv row; cos and sin (T, 1, d) or (T, d)."""
        if qkv.dtype not in HALF_DTYPES or qkv.stride(-1) != 1:
            raise TypeError("rotary needs a half-precision qkv with contiguous rows")
        num_tokens = qkv.shape[0]
        cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
        _check(cos, sin)
        if qkv.shape[1] < (num_heads + num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError("rotary got inconsistent shapes")
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if num_tokens:
            _rotary_kernel[(num_tokens, num_heads + num_kv_heads)](
                qkv, qkv.stride(0), cos, sin, q, k,
                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                HALF_P2=max(2, triton.next_power_of_2(head_dim // 2)))
        return q, k


def _check(*tensors: torch.Tensor) -> None:
    # NOTE: the kernels index raw pointers: wrong dtypes or strides would read garbage
    for t in tensors:
        if t.dtype not in HALF_DTYPES or not t.is_contiguous() or t.dtype != tensors[0].dtype:
            raise TypeError(f"the Triton layer ops need contiguous tensors of one half-precision "
                            f"dtype; got {t.dtype} (contiguous: {t.is_contiguous()})")


_loaded: dict[str, tuple[TritonLayerOps | None, str | None]] = {}


def load_triton_layer_ops(device: torch.device,
                          dtype: torch.dtype = torch.bfloat16) -> tuple[TritonLayerOps | None, str | None]:
    """(ops, None), or (None, why not): the kernels compiled and checked against torch's
    expressions once per device, dtype and process, before any graph capture needs them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # NOTE: "cuda" and "cuda:0" are one device: a second check inside a graph
        # capture (the model's tensors say cuda:0) would sync and break the capture
        device = torch.device("cuda", torch.cuda.current_device())
    key = f"{device} {dtype}"
    if key not in _loaded:
        ops = TritonLayerOps()
        try:
            problem = check_against_torch(ops, device, dtype)
        except Exception as error:  # noqa: BLE001 - a kernel that does not build: torch ops
            problem = f"{type(error).__name__}: {error}"
        _loaded[key] = (ops, None) if problem is None else (None, problem)
        if problem is not None:
            logger.warning("layer ops in %s run as torch operators: %s", key, problem)
    return _loaded[key]


def check_against_torch(ops: TritonLayerOps, device: torch.device,
                        dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None if each op agrees with torch's expressions (llama.py's) on random inputs to
    within two ulps of dtype (compiled Triton's exp, rsqrt and division may differ from
    torch's in float32's last bit, and RMSNorm and SiLU x up round twice); else what
    differs."""
    from replicas.models.layers import RMSNorm, RotaryEmbedding
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, residual, weight = randn(3, 640), randn(3, 640), randn(640)
    norm = RMSNorm(640, 1e-5).to(device=device, dtype=dtype)
    norm.weight.data.copy_(weight)
    normed, h = ops.rms_norm(x, norm.weight.data, 1e-5, residual)
    gate_up = 3 * randn(3, 2 * 1100)
    gate, up = gate_up.split(1100, dim=-1)
    qkv, cos, sin = randn(3, 8 * 128), randn(3, 1, 128), randn(3, 1, 128)
    q, k = ops.rotary(qkv, cos, sin, 4, 2, 128)
    rotated = RotaryEmbedding.rotate(qkv[:, :6 * 128].view(3, 6, 128), cos, sin)
    pairs = {"rms_norm": (normed, norm(x + residual)), "residual add": (h, x + residual),
             "silu_mul": (ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up),
             "rotary q": (q, rotated[:, :4]), "rotary k": (k, rotated[:, 4:])}
    ulp = torch.finfo(dtype).eps
    for name, (got, want) in pairs.items():
        limit = 2 * ulp * want.float().abs() + ulp  # two ulps of the value, or one of 1 near 0
        if not bool(((got.float() - want.float()).abs() <= limit).all()):
            return f"{name} differs from torch's expression by more than two ulps"
    return None
