"""GGUF block types as rows of a table: how each one's blocks repack, losslessly,
into a layout of replicas/quant/layouts.py.

A row decodes a tensor's raw blocks into codes (in value order), one scale per
group and, where the type has one, one min per group, all such that
scale * code + min is, bit for bit, the value the `gguf` package dequantizes
(tests/replicas/test_quant_gguf_blocks.py holds each row to that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from replicas.quant.layouts import QuantizedWeight, from_arrays

# (blocks (n, block_bytes) uint8) -> (codes (n, values), scales (n, groups), mins or None)
Decoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]


@dataclass(frozen=True, slots=True)
class BlockType:
    name: str  # the GGUF type name
    values: int  # values per block
    nbytes: int  # bytes per block
    layout: str  # the layout it repacks into
    group: int  # values per scale in that layout
    decode: Decoder


def _f16(raw: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n, 1) float32, the float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16*j) bytes -> (n, 32*j) codes: each 16 bytes' low nibbles, then high ones."""
    n = qs.shape[0]
    blocks = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (blocks & 0x0F).reshape(n, -1)


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _fifth_bits(b: np.ndarray, qh_at: int, qs_at: int) -> np.ndarray:
    qh = np.ascontiguousarray(b[:, qh_at:qh_at + 4]).view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, qs_at:]) | (high << 4)


def _q5_0(b):
    return _fifth_bits(b, 2, 6).astype(np.int16) - 16, _f16(b[:, :2]), None


def _q5_1(b):
    return _fifth_bits(b, 4, 8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K sub-block scales -> 8 6-bit scales and 8 6-bit mins."""
    n = raw.shape[0]
    s = raw.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_scale_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, m = _k_scales(b[:, 4:16])
    return _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * m)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant order: each 32 bytes' low nibbles are one sub-block, high the next."""
    n = qs.shape[0]
    blocks = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (blocks & 0x0F).reshape(n, -1)


def _q4_k(b):
    scales, mins = _k_scale_min(b)
    return _k_nibbles(b[:, 16:]), scales, mins


def _q5_k(b):
    scales, mins = _k_scale_min(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & 1).reshape(b.shape[0], -1)
    return _k_nibbles(b[:, 48:]) | (high << 4), scales, mins


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    codes = (ql | (qh << 4)).astype(np.int16).reshape(n, 256) - 32
    sub_scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _f16(b[:, 208:210]) * sub_scales, None


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", 32, 18, "u4", 32, _q4_0),
    BlockType("Q4_1", 32, 20, "u4", 32, _q4_1),
    BlockType("Q5_0", 32, 22, "s8", 32, _q5_0),
    BlockType("Q5_1", 32, 24, "s8", 32, _q5_1),
    BlockType("Q8_0", 32, 34, "s8", 32, _q8_0),
    BlockType("Q4_K", 256, 144, "u4", 32, _q4_k),
    BlockType("Q5_K", 256, 176, "s8", 32, _q5_k),
    BlockType("Q6_K", 256, 210, "s8", 16, _q6_k),
)}
NATIVE_TYPES = tuple(BLOCK_TYPES)


def repack(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The (N, K) tensor of GGUF type `type_name` whose raw bytes are `raw` (its
    memory-mapped data: (N, K / values * nbytes) uint8), in its kernel layout."""
    kind = BLOCK_TYPES[type_name]
    N, K = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(N * K // kind.values, kind.nbytes)
    codes, scales, mins = kind.decode(blocks)
    groups = K // kind.group
    return from_arrays(kind.layout, kind.group, codes.reshape(N, K),
                       scales.reshape(N, groups).astype(np.float32),
                       None if mins is None else mins.reshape(N, groups).astype(np.float32),
                       type_name)
