"""Shared-prefix and multi-turn datasets, and `loadtests.bench --dataset-name
prefix|multiturn` against the fake server (no engine, no Ray)."""
import asyncio

import pytest

from loadtests.serving import datasets
from loadtests.serving.serving_run import BenchConfig, make_parser, run_benchmark
from loadtests.fake_server import FakeServerConfig, FakeServerThread


@pytest.fixture(scope="module")
def tokenizer():
    """The presets' tokenizer: what the benchmark is run with against `tiny`."""
    return datasets.HFTokenizer("replicas/assets")


def _common_prefix_len(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prefix_prompts_share_their_prefix_token_for_token(tokenizer):
    requests = datasets.sample_prefix_requests(12, 256, 32, 16, tokenizer, num_prefixes=2, seed=4)
    ids = [tokenizer.encode(r.prompt) for r in requests]
    for i, r in enumerate(requests):
        assert r.prompt_len == len(ids[i]) and abs(r.prompt_len - (256 + 1 + 32)) <= 3
        assert r.expected_output_len == 16
        same = ids[(i + 2) % 12]  # the same prefix (round robin over 2)
        other = ids[(i + 1) % 12]
        assert _common_prefix_len(ids[i], same) >= 256
        assert _common_prefix_len(ids[i], other) < 8
    assert len({r.prompt for r in requests}) == 12  # suffixes are unique
    again = datasets.sample_prefix_requests(12, 256, 32, 16, tokenizer, num_prefixes=2, seed=4)
    assert [r.prompt for r in again] == [r.prompt for r in requests]


def test_prefix_prompts_without_tokenizer_count_words():
    requests = datasets.sample_prefix_requests(4, 50, 10, 8, None, seed=1)
    assert {r.prompt.split("\n")[0] for r in requests} == {requests[0].prompt.split("\n")[0]}
    assert all(len(r.prompt.split()) == r.prompt_len == 60 for r in requests)
    with pytest.raises(ValueError):
        datasets.sample_prefix_requests(4, 50, 0, 8)


def test_multiturn_prompts_extend_the_turn_before(tokenizer):
    conversations = datasets.load_sharegpt_conversations(datasets.DEFAULT_SHAREGPT_PATH)
    assert conversations and all(len(c) >= 2 for c in conversations)
    prompts = datasets.conversation_prompts(conversations[0])
    for (prev, reply), (cur, _) in zip(prompts, prompts[1:]):
        assert cur.startswith(prev + " " + reply + "\n")
    requests = datasets.sample_multiturn_requests(None, 60, tokenizer, seed=2)
    assert len(requests) == 60
    by_prompt = {r.prompt for r in requests}
    # every later turn follows the turn before it, which is sent earlier
    position = {}
    for i, r in enumerate(requests):
        position.setdefault(r.prompt, i)
    later = [r for r in requests if r.prompt.count("User: ") > 1]
    assert later
    for r in later:
        # the turn before: up to the "Assistant:" that precedes the last reply
        earlier = r.prompt[:r.prompt.rindex("User: ")].rsplit("\nAssistant:", 1)[0] + "\nAssistant:"
        assert earlier in by_prompt and position[earlier] < position[r.prompt]
        assert r.prompt_len == len(tokenizer.encode(r.prompt))
        assert datasets.is_valid_sequence(r.prompt_len, r.expected_output_len)


def test_bench_flags_reach_the_datasets():
    args = make_parser().parse_args(["--dataset-name", "prefix", "--prefix-len", "300",
                                     "--suffix-len", "20", "--num-prefixes", "3"])
    cfg = BenchConfig.from_any(args)
    assert (cfg.dataset_name, cfg.prefix_len, cfg.suffix_len, cfg.num_prefixes) == ("prefix", 300, 20, 3)
    with pytest.raises(ValueError, match="multiturn"):
        BenchConfig(dataset_name="nope")


@pytest.mark.parametrize("name", ["prefix", "multiturn"])
def test_bench_runs_the_new_datasets(name):
    with FakeServerThread(FakeServerConfig(step_ms=1.0)) as srv:
        result = asyncio.run(run_benchmark(BenchConfig(
            base_url=srv.base_url, model="fake", dataset_name=name, num_prompts=10,
            prefix_len=64, suffix_len=8, random_output_len=5, sharegpt_output_len=5,
            max_concurrency=4, ready_check_timeout_sec=0, timeout=20.0, run_timeout=60.0,
            disable_tqdm=True, print_result=False)))
    assert result["completed"] == 10 and result["dataset_name"] == name
    assert result["total_output_tokens"] == 50
