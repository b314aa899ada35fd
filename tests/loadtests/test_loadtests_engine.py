"""The offline engine runner and its modes at toy sizes (figures are not checked:
tests assert correctness, never speed), and the GPU check's CPU plumbing."""
import pytest
import argparse
import gc
import json

from loadtests import gpu_check
from loadtests.engine.engine_ceiling import ceiling_run
from loadtests.bench_engine import chat_conversations, chat_sessions
from loadtests.engine.engine_runner import (engine_config, greedy, random_prompts, run_engine,
                                     run_process_engine, sessions_of)

pytestmark = pytest.mark.slow  # engine benchmarks end to end: not in `make test-fast`


def test_shared_prefix_and_chat_rows():
    prompts = random_prompts(3, 8, seed=1, prefix_len=48)
    assert all(p[:48] == prompts[0][:48] for p in prompts) and len({tuple(p) for p in prompts}) == 3
    convs = chat_conversations("replicas/assets", 600)[:2]
    assert all(len(c) >= 2 and len(c[1][0]) > len(c[0][0]) for c in convs)
    on = engine_config("tiny", enable_prefix_caching=True)
    off = engine_config("tiny", enable_prefix_caching=False)
    shared = run_engine(on, sessions_of(prompts, greedy(2)), 1)
    chat = run_engine(off, chat_sessions(convs, 2), 2)
    for row in (shared, chat):
        assert row["median_ttft_ms"] > 0 and row["output_throughput"] > 0
    assert shared["prefix_cache_hit_rate"] > 0 and chat["prefix_cache_hit_rate"] == 0
    assert {"median_ttft_turn1_ms", "median_ttft_turn2_ms"} <= set(chat)
    assert chat["completed"] == sum(map(len, convs))  # every turn of every conversation
    assert gc.get_freeze_count() == 0  # the heap frozen for a run is the collector's again


def test_thread_and_process_engines_stream_every_token():
    # NOTE: four windows of 8 steps (the default): released per window, every chunk
    # would hold 8 tokens at least, in every run. Released per step, a chunk merges
    # tokens only while the reader is behind, and a test process niced beside the
    # suite's other lanes can fall behind a whole answer (a run of 32-token answers
    # once read 16 tokens a chunk): the best of up to three runs counts.
    work = sessions_of(random_prompts(4, 16), greedy(32))
    runs = (lambda: run_engine(engine_config("tiny"), work, 2),
            lambda: run_process_engine(dict(model="tiny", max_num_seqs=256), work, 4))
    for run in runs:
        per_chunk = []
        for _ in range(3):
            row = run()
            assert (row["completed"], row["failed"], row["total_output_tokens"]) == (4, 0, 128)
            per_chunk.append(row["mean_tokens_per_chunk"])
            if per_chunk[-1] < 8.0:
                break
        assert 1.0 <= min(per_chunk) < 8.0, per_chunk


def test_ceiling_run_measures_forward_engine_and_breakdown(tmp_path, capsys):
    args = argparse.Namespace(input_len=8, output_len=4, baseline_ref=None, current_ref=None,
                              repeats=1, result_dir=str(tmp_path))
    result = ceiling_run("tiny", 4, args)
    engine = result["engine"]["current"]  # run by the harness in a fresh interpreter
    assert engine["completed"] == 4 and engine["total_output_tokens"] == 16
    assert result["ceiling"]["output_throughput"] > 0
    assert set(result["breakdown"]["phases_s"]) >= {"schedule", "sampling", "matmuls"}
    assert (tmp_path / "engine_trace_tiny_4.json").stat().st_size > 0
    assert "engine step breakdown" in capsys.readouterr().out


def test_gpu_check_end_to_end_plumbing_runs_on_cpu(tmp_path):
    data = gpu_check.main(["--quick", "--parts", "end_to_end", "--out", str(tmp_path),
                           "--num-requests", "8", "--total-budget-s", "120"])
    part = data["parts"]["end_to_end"]
    assert part["status"] == "ok", part
    workloads = part["result"]["workloads"]
    assert list(workloads) == ["16 x 16/32", "sharegpt-like"]
    assert workloads["sharegpt-like"]["num_requests"] == 8
    for workload in workloads.values():
        for name, _ in gpu_check.E2E_CONFIGS:
            config = workload["configs"][name]
            summary = config["summary"]
            assert summary["completed"] == workload["num_requests"] and summary["failed"] == 0
            mix = config["step_mix"]  # every prompt token went through a prefill step
            assert mix["prefill_or_mixed"]["prefill_tokens"] == workload["total_prompt_tokens"]
            assert mix["decode_windows"]["seconds"] > 0
        # NOTE: the ratios where their medians allow one: beside the other lanes the
        # client once read every event of a config in bursts (median gaps of 0)
        comparison = workload["comparison"]
        step, window = (comparison[name]["median_itl_ms"] for name in
                        ("N=8 per-step streaming", "N=8 per-window release"))
        assert step is not None and window is not None
        if step:
            assert comparison["window_vs_step_median_itl_ratio"] == window / step
    assert json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["end_to_end"]["status"] == "ok"
    assert (tmp_path / "gpu_check_blocks.txt").read_text().count("Serving Benchmark Result") == 6


def test_gpu_check_step_profile_plumbing_runs_on_cpu(tmp_path):
    data = gpu_check.main(["--quick", "--parts", "step_profile", "--out", str(tmp_path)])
    part = data["parts"]["step_profile"]
    assert part["status"] == "ok", part
    windows = part["result"]["windows"]
    assert [w["num_steps"] for w in windows] == [8, 1]
    for w in windows:  # every stream decodes in the timed windows, and a whole window is profiled
        assert w["batch"] == 16 and w["step_ms"] > 0 and w["profiled_steps"] == w["num_steps"]
        assert w["top_host_self_ms_per_step"]
        assert w["eager_step_ms"] is None and w["graph_torch_ops_step_ms"] is None  # no graphs on CPU


def test_gpu_check_quant_decode_plumbing_runs_on_cpu(tmp_path):
    data = gpu_check.main(["--quick", "--parts", "quant_decode", "--out", str(tmp_path)])
    part = data["parts"]["quant_decode"]
    assert part["status"] == "ok", part
    rows = part["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 16, 256]
    assert all(r["int4_step_ms"] > 0 and r["int8_vs_bfloat16"] > 0 for r in rows)
    weights = part["result"]["weights_mb"]
    assert weights["int4"] < weights["int8"] < weights["bfloat16"]


def test_hf_batch_max_0_runs_the_engine_without_the_transformers_reference(tmp_path, capsys):
    from loadtests import bench_engine

    result = bench_engine.main(["--models", "tiny", "--concurrency", "1", "--output-len", "4",
                                "--input-len", "8", "--hf-batch-max", "0",
                                "--result-dir", str(tmp_path)])
    [row] = result.values() if "tiny c=1" in result else result["core"].values()
    assert row["output_throughput"] > 0 and "hf_single" not in row
    assert "HF" not in capsys.readouterr().out
