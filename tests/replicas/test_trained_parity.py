"""Correctness on trained weights: our engine on the converted SmolLM2 GGUF against
transformers loading the same file (greedy tokens, at N=1 and N=8, with and
without prefix caching and chunked prefill)."""
from __future__ import annotations

import functools

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from tests import trained_model

pytestmark = pytest.mark.slow  # the trained model and transformers' own load: not in `make test-fast`

NUM_NEW_TOKENS = 64
# A float32 reduction in another order moves a logit by ~1e-5; a real bug moves it
# by far more than this.
NEAR_TIE = 1e-3


@functools.lru_cache(maxsize=1)
def _prompts() -> list[list[int]]:
    from deltas.tokenization import Tokenizer
    tokenizer = Tokenizer.from_dir(trained_model.model_dir())
    prompts = [tokenizer.encode(text) for text in trained_model.COMPLETION_PROMPTS]
    prompts += [tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)
                for chat in trained_model.CHATS]
    return prompts


@functools.lru_cache(maxsize=1)
def _reference() -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens and logits for every prompt, EOS not stopping."""
    model = trained_model.hf_model()
    out = []
    with torch.inference_mode():
        for prompt in _prompts():
            ids = torch.tensor([prompt])
            # NOTE: the mask given: inferred, it would hide every <|im_end|> of the
            # prompt (the pad token's id)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=2,
                                 output_logits=True, return_dict_in_generate=True)
            out.append((gen.sequences[0, len(prompt):].tolist(), [l[0] for l in gen.logits]))
    return out


def _first_difference(ours: list[int], theirs: list[int], logits: list[torch.Tensor]):
    """None when equal, else (index, logit margin of transformers' top two there)."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top2 = logits[j].topk(2).values
            return j, float(top2[0] - top2[1])
    assert len(ours) == len(theirs)
    return None


CONFIGS = {
    "N=1": dict(num_scheduler_steps=1, enable_prefix_caching=False),
    "N=8": dict(num_scheduler_steps=8, enable_prefix_caching=False),
    # NOTE: 24 tokens a step: every chat prompt (their shared system prompt
    # included) is prefilled in chunks, and the second pass meets its cached blocks
    "N=8, prefix caching, chunked prefill": dict(num_scheduler_steps=8, enable_prefix_caching=True,
                                                 max_num_batched_tokens=24),
    "N=1, prefix caching, chunked prefill": dict(num_scheduler_steps=1, enable_prefix_caching=True,
                                                 max_num_batched_tokens=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_transformers_on_trained_weights(name):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(model=trained_model.PRESET, dtype="float32", **CONFIGS[name])
    with Engine(config) as engine:
        runs = [engine.generate(_prompts(), params)]
        if config.enable_prefix_caching:
            runs.append(engine.generate(_prompts(), params))
            assert engine.stats().num_prefix_cache_hit_tokens > 0
    for outs in runs:
        for i, (out, (theirs, logits)) in enumerate(zip(outs, _reference())):
            difference = _first_difference(out.token_ids, theirs, logits)
            if difference is not None:
                j, margin = difference
                assert margin < NEAR_TIE, (f"prompt {i}, token {j}: ours {out.token_ids[j]}, "
                                           f"transformers {theirs[j]}, logit margin {margin:.2e}")
