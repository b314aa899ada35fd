"""Sampling and structured outputs on a GPU: the sampler's draws on CUDA follow the
adjusted distribution and a seeded row draws the same tokens in any batch; in the
engine (Triton backend, decode CUDA graphs, the pipelined host copy), constrained
rows' masks come from their previous token, so every constrained output matches its
grammar, and unconstrained neighbours keep their tokens. Skipped without CUDA."""
from __future__ import annotations

import json
import random

import pytest
import torch

from deltas.types import FinishReason
from replicas import Engine, EngineConfig, SamplingParams
from replicas.sampling.sampler import sampling_probs
from tests.model_dirs import make_model_dir
from tests.sampling_support import chi_square, chi_square_limit, sampled_counts, seeded_row_tokens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")

ENUM_SCHEMA = {"type": "object", "required": ["color", "size"], "additionalProperties": False,
               "properties": {"color": {"enum": ["red", "green", "blue"]},
                              "size": {"type": "string", "enum": ["S", "M", "L"]}}}


@pytest.mark.parametrize("kwargs", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20},
                                    {"temperature": 1.3, "top_p": 0.8}])
def test_cuda_draws_follow_the_adjusted_distribution(kwargs):
    vocab = 200
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 2.0
    counts, sb = sampled_counts(SamplingParams(**kwargs), logits, 2048 * 60, device=CUDA)
    probs = sampling_probs(logits.to(CUDA).unsqueeze(0).expand(sb.num_rows, -1), sb)[0].cpu()
    stat, dof = chi_square(counts, probs)
    assert stat < chi_square_limit(dof), (stat, dof)
    assert int(counts[probs == 0].sum()) == 0


def test_a_seeded_row_draws_the_same_tokens_in_any_batch_on_cuda():
    alone = seeded_row_tokens(1, seed=1234, device=CUDA)
    assert seeded_row_tokens(5, seed=1234, device=CUDA) == alone
    assert seeded_row_tokens(33, seed=1234, device=CUDA) == alone
    assert seeded_row_tokens(5, seed=99, device=CUDA) != alone


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


@pytest.mark.parametrize("num_steps", [1, 8])
def test_constrained_rows_match_their_grammar_beside_free_rows(tmp_path_factory, num_steps):
    pytest.importorskip("triton")
    model_dir = make_model_dir(tmp_path_factory.mktemp("models"), "llama")
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                          max_model_len=512, max_num_seqs=16, num_scheduler_steps=num_steps)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                                  structured_output={"json": ENUM_SCHEMA}) for i in range(3)]
    regex = SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                           structured_output={"regex": "[a-c]{3}-[0-9]{2}"})
    prompts = _prompts(7, seed=13)
    with Engine(config) as engine:
        runner = engine.core.runner
        assert runner.decode_graphs is not None
        outs = engine.generate(prompts, [free] * 3 + constrained + [regex])
        alone = engine.generate(prompts[:3], free)
        replays = runner.decode_graphs.num_replays
    assert replays > 0
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in alone]
    for out in outs[3:6]:
        assert out.finish_reason == FinishReason.STOP, out.text
        value = json.loads(out.text)
        assert set(value) == {"color", "size"}, value
        assert value["color"] in ("red", "green", "blue") and value["size"] in ("S", "M", "L")
    assert outs[6].finish_reason == FinishReason.STOP
    text = outs[6].text
    assert len(text) == 6 and text[3] == "-" and set(text[:3]) <= set("abc") and text[4:].isdigit(), text
