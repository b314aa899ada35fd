"""The CPU backend's paged decode kernel against the torch backend (the reference),
and a whole engine run with it against one on plain torch. Where the kernel builds,
it is loaded and called (no silent fall back to torch), on torch's OpenMP runtime;
a cached build is loaded without compiling; only a private build is loaded."""
import ctypes
import functools
import os
import re
import shlex
import stat
import subprocess

import pytest
import torch

from replicas.attention import native_kernels
from replicas.attention.base import AttentionMetadata
from replicas.attention.cpu_backend import CpuAttentionBackend
from replicas.attention.native_kernels import (build, kernel_cache_dir, load_paged_decode_attention,
                                               openmp_runtimes)
from replicas.attention.private_files import make_private_dir
from replicas.attention.torch_backend import TorchAttentionBackend
from tests.native_kernel_support import why_not_built

KERNEL = "paged_decode_attention"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


# the kernel is built for this CPU (-march=native): its bfloat16 q.K path exists where
# the CPU has AVX512-BF16
CPU_FLAGS = _cpu_flags()


# NOTE: a machine that cannot build the kernel runs the torch backend (tested
# elsewhere). Only that skips: a kernel that builds but is not loaded fails here.
WHY_NOT_BUILT = why_not_built(KERNEL)
pytestmark = pytest.mark.skipif(WHY_NOT_BUILT is not None, reason=str(WHY_NOT_BUILT))


def _load_fresh():
    return native_kernels._load(KERNEL)  # not the per-process cache


def _decode_case(B, h, kvh, d, bs, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens) + 1  # one spare column, as windows have
    num_blocks = B * width + 3
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:B * width].view(B, width).to(torch.int32)
    q = torch.randn(B, h, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_prefills=0, num_prefill_tokens=0,
        prefill_query_start_loc=[0], prefill_seq_lens=[], prefill_block_tables=None,
        num_decodes=B, decode_seq_lens=seq_lens, decode_block_tables=tables,
        max_decode_seq_len=max(lens))
    return q, k_cache, v_cache, meta


# NOTE: head size 64 takes the AVX-512 P.V path where the CPU has it, four q heads
# at a time (8 and 7 per KV head: two chunks); other head sizes the portable loops.
@pytest.mark.parametrize("h,kvh,d,bs", [(4, 2, 64, 16), (4, 4, 32, 16), (8, 1, 64, 8), (6, 3, 16, 32),
                                        (9, 3, 64, 16), (4, 2, 128, 16), (4, 4, 64, 16),
                                        (8, 2, 64, 16), (14, 2, 64, 16)])
def test_decode_matches_the_torch_backend(h, kvh, d, bs):
    # lengths at, below and above block edges, and a single token
    lens = [1, bs - 1, bs, bs + 1, 3 * bs, 5 * bs + 7, 2, 4 * bs - 1]
    q, k_cache, v_cache, meta = _decode_case(len(lens), h, kvh, d, bs, lens)
    scale = d ** -0.5
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    got = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,kvh,d,bs", [(9, 3, 64, 16), (4, 2, 128, 16), (6, 3, 16, 32)])
def test_bfloat16_caches_match_the_torch_backend_in_float32(h, kvh, d, bs):
    """A bfloat16 cache's values widen exactly to float32, so the kernel over it equals
    float32 attention over the same (rounded) values; q and out round to bfloat16."""
    lens = [1, bs - 1, bs + 1, 3 * bs, 5 * bs + 7]
    q, k_cache, v_cache, meta = _decode_case(len(lens), h, kvh, d, bs, lens)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    scale = d ** -0.5
    ref = TorchAttentionBackend().forward(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.bfloat16().float(), atol=1e-2, rtol=1e-2)


# NOTE: a block size of 6 leaves two tokens of each block to q.K's one-token tail
@pytest.mark.parametrize("h,kvh,d,bs", [(9, 3, 64, 16), (4, 2, 128, 16), (6, 3, 16, 32),
                                        (8, 2, 64, 16), (4, 4, 64, 16), (4, 2, 64, 6)])
def test_bfloat16_q_and_output_are_the_float32_path_rounded(h, kvh, d, bs):
    """bfloat16 q and output go through the kernel's own widening and narrowing: what
    widening q, running the float32-output kernel and rounding its output gives (the
    copies the backend made before), up to a bfloat16 rounding step where AVX512-BF16
    dot products sum q.K in another order; a padded row still gets zeros."""
    lens = [1, bs - 1, 0, 3 * bs, 5 * bs + 7]
    q, k_cache, v_cache, meta = _decode_case(len(lens), h, kvh, d, bs, lens)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
    B, width, scale = len(lens), tables.shape[1], d ** -0.5

    def run(kernel, q_in, out):
        rc = kernel(q_in.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    seq_lens.data_ptr(), out.data_ptr(), B, h, kvh, d, bs, width, scale, 2)
        assert rc == 0
        return out

    float_out = run(load_paged_decode_attention("bfloat16")[0], q.float(),
                    torch.empty(B, h, d, dtype=torch.float32))
    got = run(load_paged_decode_attention("bfloat16_io")[0], q,
              torch.full((B, h, d), 7.0, dtype=torch.bfloat16))
    if d == 64 and "avx512_bf16" in CPU_FLAGS:
        torch.testing.assert_close(got.float(), float_out.bfloat16().float(), atol=1e-2, rtol=1e-2)
    else:
        assert torch.equal(got, float_out.bfloat16())
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    backend_out = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    assert backend_out.dtype == torch.bfloat16 and torch.equal(backend_out, got)


def test_mixed_prefill_and_decode_matches_the_torch_backend():
    from replicas.attention.base import AttentionMetadata
    bs, h, kvh, d = 16, 4, 2, 32
    q_dec, k_cache, v_cache, dec = _decode_case(3, h, kvh, d, bs, [5, 17, 40], seed=1)
    n_pre = 7
    q = torch.cat([torch.randn(n_pre, h, d), q_dec])
    prefill_table = dec.decode_block_tables[:1].clone()
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_prefills=1, num_prefill_tokens=n_pre,
        prefill_query_start_loc=[0, n_pre], prefill_seq_lens=[12], prefill_block_tables=prefill_table,
        num_decodes=3, decode_seq_lens=dec.decode_seq_lens, decode_block_tables=dec.decode_block_tables,
        max_decode_seq_len=40)
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    got = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_padded_row_of_length_zero_gets_zeros_and_the_others_are_unchanged():
    q, k_cache, v_cache, meta = _decode_case(3, 4, 2, 16, 16, [5, 0, 20])
    got = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    meta.decode_seq_lens[1] = 1
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got[[0, 2]], ref[[0, 2]], atol=1e-5, rtol=1e-5)


def test_a_length_outside_the_block_table_is_refused():
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 16, 16, [3, 20])
    meta.decode_seq_lens[1] = 16 * meta.decode_block_tables.shape[1] + 1
    with pytest.raises(ValueError, match="outside its block table"):
        CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)


def _failing_compiler(tmp_path) -> str:
    """A CC that fails every compile and link, and reports the real compiler's
    version (part of the cache key, so a cached build still matches)."""
    script = tmp_path / "failing-cc"
    script.write_text("#!/bin/sh\n"
                      f'[ "$1" = --version ] && exec {shlex.join(native_kernels._compiler())} --version\n'
                      "exit 1\n")
    script.chmod(0o755)
    return str(script)


def test_a_cached_build_is_loaded_without_compiling_and_a_missing_one_is_compiled(tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("STEPSTREAM_CACHE", str(tmp_path / "cache"))
    first = build(KERNEL)
    assert first.parent == kernel_cache_dir() and first.exists()
    monkeypatch.setenv("CC", _failing_compiler(tmp_path))
    assert build(KERNEL) == first  # would have raised had it compiled
    fn, why = _load_fresh()
    assert why is None and fn is not None
    # the control: without the cached file the same compiler fails the build
    first.unlink()
    with pytest.raises(RuntimeError, match="failing-cc .*-c .*paged_decode_attention.c.* failed"):
        build(KERNEL)
    fn, why = _load_fresh()
    assert fn is None and "failing-cc" in why
    assert not first.exists()


def test_engine_outputs_equal_with_the_cpu_kernel_and_plain_torch():
    from replicas import Engine, EngineConfig, SamplingParams
    prompts = [[(7 * i + j) % 8000 + 5 for j in range(10 + 13 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        with Engine(EngineConfig(model="tiny", attention_backend=backend, num_scheduler_steps=8,
                                 block_size=8)) as engine:
            outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]


def test_a_failing_compiler_is_reported_with_its_command(monkeypatch, tmp_path):
    monkeypatch.setenv("STEPSTREAM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="false .*-c .*paged_decode_attention.c.* failed"):
        build("paged_decode_attention")
    monkeypatch.setenv("CC", "ccache-like-wrapper-that-is-missing gcc")
    with pytest.raises(RuntimeError, match="no C compiler found"):
        build("paged_decode_attention")
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    with pytest.raises(RuntimeError, match="no C compiler found"):
        build("paged_decode_attention")
    assert not list(tmp_path.rglob("*.so"))


def test_a_block_id_outside_the_cache_is_refused():
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 16, 16, [3, 20])
    meta.decode_block_tables[1, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)


def test_a_negative_length_or_block_id_is_refused():
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 16, 16, [3, 20])
    meta.decode_seq_lens[0] = -1
    with pytest.raises(ValueError, match="outside its block table"):
        CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 16, 16, [3, 20])
    meta.decode_block_tables[0, 0] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)


def test_table_entries_past_a_rows_blocks_are_not_read_so_not_checked():
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 16, 16, [3, 20])
    ref = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    meta.decode_block_tables[0, 1:] = k_cache.shape[0] + 7  # row 0 reads its first block only
    got = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    assert torch.equal(got, ref)


def _mapped_file_at(address: int) -> str | None:
    """The file mapped into this process at `address` (/proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def _needed_libraries(path: str) -> list[str]:
    """The libraries `path` asks the dynamic loader for (its DT_NEEDED entries)."""
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                             check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)


def test_the_kernel_is_loaded_and_called_and_shares_torchs_openmp_runtime(monkeypatch):
    kernel, why = load_paged_decode_attention()
    assert kernel is not None, f"fell back to torch: {why}"
    # its code is the cached build's, mapped into this process
    library = _mapped_file_at(ctypes.cast(kernel, ctypes.c_void_p).value)
    assert library == str(build(KERNEL))
    # the backend calls it for decode
    backend = CpuAttentionBackend()
    assert backend._kernels[torch.float32] is kernel
    calls = []
    monkeypatch.setitem(backend._kernels, torch.float32,
                        lambda *args: calls.append(args) or kernel(*args))
    q, k_cache, v_cache, meta = _decode_case(3, 4, 2, 16, 16, [5, 17, 40])
    got = backend.forward(q, k_cache, v_cache, meta, 0.25)
    assert len(calls) == 1
    torch.testing.assert_close(got, TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25),
                               atol=1e-5, rtol=1e-5)
    # one OpenMP runtime in the process, and the kernel links against it: one pool
    runtimes = openmp_runtimes()
    assert len(runtimes) == 1, runtimes
    runtime = os.path.basename(runtimes.pop())
    assert runtime in _needed_libraries(library), f"{library} is not linked against {runtime}"


# -- only a private build is loaded --------------------------------------------------
# Stands in for someone else's code in the cache: loading it leaves a marker file.
PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) fclose(f);
}
int paged_decode_attention(void) { return -1; }
"""


@functools.cache
def _kernel_file_name() -> str:
    """The file name this machine's build of the kernel has in any cache."""
    return build(KERNEL).name


def _plant(tmp_path, monkeypatch, at=None):
    """A cache under tmp_path whose kernel file (or `at`) is a planted library, owned by
    us and mode 0o755: (the kernel's path in the cache, the marker loading writes)."""
    name = _kernel_file_name()  # NOTE: from the default cache: one compile per process
    monkeypatch.setenv("STEPSTREAM_CACHE", str(tmp_path / "cache"))
    make_private_dir(kernel_cache_dir())
    path = kernel_cache_dir() / name
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    target = at or path
    target.unlink(missing_ok=True)
    subprocess.run([*native_kernels._compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"',
                    str(source), "-o", str(target)], check=True)
    os.chmod(target, 0o755)
    return path, marker


def _not_ours(monkeypatch, path, is_dir):
    """os.fstat reports another owner for descriptors of `path` (we cannot chown)."""
    real_fstat, wanted = os.fstat, os.path.realpath(path)

    def fstat(fd):
        st = real_fstat(fd)
        if os.path.realpath(f"/proc/self/fd/{fd}") != wanted \
                or stat.S_ISDIR(st.st_mode) != is_dir:
            return st
        fields = list(st[:10])
        fields[4] = os.geteuid() + 1  # st_uid: neither us nor root
        return os.stat_result(fields)
    monkeypatch.setattr(os, "fstat", fstat)


def test_a_private_cached_build_is_loaded_as_is(tmp_path, monkeypatch):
    # the control: the planted library is what a trusted cache entry would run
    path, marker = _plant(tmp_path, monkeypatch)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # the cache dir we made
    fn, why = _load_fresh()
    assert why is None and fn is not None
    assert marker.exists()


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "not ours"])
def test_a_cached_kernel_in_a_directory_others_can_write_is_not_loaded(tmp_path, monkeypatch,
                                                                        caplog, how):
    path, marker = _plant(tmp_path, monkeypatch)
    if how == "not ours":
        _not_ours(monkeypatch, path.parent, is_dir=True)
    else:
        os.chmod(path.parent, 0o777 if how == "world-writable" else 0o770)
    with caplog.at_level("WARNING", logger="stepstream"):
        fn, why = _load_fresh()
    assert not marker.exists(), "the planted library was loaded"
    assert why is None and fn is not None  # built in a private temporary directory
    assert "kernel cache not used" in caplog.text and str(path.parent) in caplog.text


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "not ours", "a link"])
def test_a_cached_kernel_file_others_could_have_written_is_built_again(tmp_path, monkeypatch,
                                                                        caplog, how):
    at = tmp_path / "elsewhere.so" if how == "a link" else None
    path, marker = _plant(tmp_path, monkeypatch, at=at)
    if how == "a link":
        path.unlink(missing_ok=True)
        path.symlink_to(at)
    elif how == "not ours":
        _not_ours(monkeypatch, path, is_dir=False)
    else:
        os.chmod(path, 0o777 if how == "world-writable" else 0o775)
    with caplog.at_level("WARNING", logger="stepstream"):
        fn, why = _load_fresh()
    assert not marker.exists(), "the planted library was loaded"
    assert why is None and fn is not None
    assert f"cached {KERNEL} kernel not used" in caplog.text
    rebuilt = os.lstat(path)
    assert stat.S_ISREG(rebuilt.st_mode) and not rebuilt.st_mode & 0o022
