"""Random and ShareGPT datasets, and the bundled synthetic ShareGPT sample."""
import json

import numpy as np
import pytest

from loadtests.serving import datasets
from loadtests.serving.datasets import build_conversations, render


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small byte-level BPE trained on the sample file: offline, well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [t for pair in datasets.load_sharegpt_pairs(datasets.DEFAULT_SHAREGPT_PATH) for t in pair]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return datasets.HFTokenizer(path.parent)


def test_random_prompts_tokenize_to_the_asked_length(tokenizer):
    requests = datasets.sample_random_requests(30, 64, 16, tokenizer, seed=3)
    assert len(requests) == 30
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt))
        assert abs(r.prompt_len - 64) <= 2
        assert r.expected_output_len == 16
        assert not {0, 1} & set(tokenizer.encode(r.prompt))  # no special tokens
    assert len({r.prompt for r in requests}) == 30  # distinct prompts defeat prefix caching


def test_random_range_ratio_spreads_lengths_and_seed_repeats(tokenizer):
    a = datasets.sample_random_requests(40, 50, 20, tokenizer, range_ratio=0.5, seed=1)
    b = datasets.sample_random_requests(40, 50, 20, tokenizer, range_ratio=0.5, seed=1)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    lens = [r.expected_output_len for r in a]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 5


def test_random_prompts_without_tokenizer_count_words():
    requests = datasets.sample_random_requests(5, 40, 8, None, seed=0)
    assert all(len(r.prompt.split()) == r.prompt_len == 40 for r in requests)


def _write_sharegpt(path, pairs):
    data = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}]}
            for i, (p, c) in enumerate(pairs)]
    data.append({"id": "single", "conversations": [{"from": "human", "value": "w " * 50}]})
    path.write_text(json.dumps(data))


def test_sharegpt_filters_as_vllm(tmp_path):
    words = lambda n: " ".join(["w"] * n)  # noqa: E731  (one token a word without a tokenizer)
    path = tmp_path / "sg.json"
    _write_sharegpt(path, [
        (words(10), words(20)),     # kept
        (words(3), words(20)),      # prompt under 4 tokens
        (words(10), words(3)),      # output under 4 tokens
        (words(1025), words(10)),   # prompt over 1024
        (words(1000), words(1049)), # prompt + output over 2048
        (words(1000), words(1048)), # exactly 2048: kept
    ])
    requests = datasets.sample_sharegpt_requests(path, 10, None, seed=0)
    assert sorted({(r.prompt_len, r.expected_output_len) for r in requests}) == [(10, 20), (1000, 1048)]
    assert len(requests) == 10  # a short pool is cycled
    fixed = datasets.sample_sharegpt_requests(path, 4, None, fixed_output_len=2)
    assert {r.expected_output_len for r in fixed} == {2}
    assert {r.prompt_len for r in fixed} == {10, 1000}  # short output allowed when fixed


def test_sharegpt_uses_the_first_two_turns(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": "first question here please"},
        {"from": "gpt", "value": "first answer goes right here"},
        {"from": "human", "value": "second question"}, {"from": "gpt", "value": "x"}]}]))
    assert datasets.load_sharegpt_pairs(path) == [("first question here please", "first answer goes right here")]


def test_bundled_sample_is_small_seeded_and_long_tailed(tokenizer):
    path = datasets.DEFAULT_SHAREGPT_PATH
    raw = path.read_text(encoding="utf-8")
    assert len(raw.encode()) < 1_000_000
    assert raw == render(build_conversations(seed=0, num_conversations=200))  # the script made it
    data = json.loads(raw)
    assert len(data) == 200
    lens = np.array([len(tokenizer.encode(p)) for p, _ in datasets.load_sharegpt_pairs(path)])
    assert np.percentile(lens, 99) > 4 * np.median(lens)  # a long tail, as ShareGPT
    kept = datasets.sample_sharegpt_requests(path, 1000, tokenizer)
    assert len({r.prompt for r in kept}) > 150
    assert all(datasets.is_valid_sequence(r.prompt_len, r.expected_output_len) for r in kept)
