"""loadtests.bench_prefix runs end to end at toy sizes (figures are not checked:
tests assert correctness, never speed)."""
from loadtests import bench_prefix
from replicas import EngineConfig


def test_shared_prefix_and_chat_rows():
    prompts = bench_prefix.shared_prefix_prompts(3, 48, 8, seed=1)
    assert all(p[:48] == prompts[0][:48] for p in prompts) and len({tuple(p) for p in prompts}) == 3
    convs = bench_prefix.chat_conversations("replicas/assets", 600)[:2]
    assert all(len(c) >= 2 and len(c[1][0]) > len(c[0][0]) for c in convs)
    on = EngineConfig(model="tiny", enable_prefix_caching=True)
    off = EngineConfig(model="tiny", enable_prefix_caching=False)
    shared = bench_prefix.run_shared_prefix(on, prompts, 1, 2)
    chat = bench_prefix.run_chat(off, convs, 2, 2)
    for row in (shared, chat):
        assert row["median_ttft_ms"] > 0 and row["output_tokens_per_s"] > 0
    assert shared["prefix_cache_hit_rate"] > 0 and chat["prefix_cache_hit_rate"] == 0
    assert {"median_ttft_turn1_ms", "median_ttft_turn2_ms"} <= set(chat)
