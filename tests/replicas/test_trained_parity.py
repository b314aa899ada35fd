"""Correctness on trained weights: our engine on the converted SmolLM2 GGUF against
transformers loading the same file: every greedy token is transformers' argmax
after the same prefix (at N=1, and at N=1 and N=8 with prefix caching and chunked
prefill)."""
from __future__ import annotations

import functools

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from tests import trained_model

pytestmark = pytest.mark.slow  # the trained model and transformers' own load: not in `make test-fast`

# NOTE: every answer crosses two or more KV blocks (16 tokens each) past its prompt
NUM_NEW_TOKENS = 40
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


def _transformers_logits(prompt: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' logits before each token of `answer`, given the prompt and the
    answer's tokens before it: one forward pass over prompt + answer (teacher forcing).

    Why not transformers' own greedy generate: a greedy answer equals it exactly when
    every token is transformers' argmax after the same prefix, which one causal
    forward pass checks for every position at once (a one-token pass per token
    took most of this module's time), and past a near-tie it keeps checking the
    rest of the answer where a comparison of two sequences would have to stop."""
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        # NOTE: the mask given: inferred, it would hide every <|im_end|> of the
        # prompt (the pad token's id)
        logits = trained_model.hf_model()(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(answer)]


@functools.lru_cache(maxsize=None)
def _disagreements(prompt: tuple[int, ...], answer: tuple[int, ...]):
    """((index, transformers' token there, its logit margin over ours), ...) where an
    answer token is not transformers' argmax after the same prefix; once per answer
    (the configs mostly give the same ones)."""
    logits = _transformers_logits(list(prompt), list(answer))
    theirs = logits.argmax(dim=-1).tolist()
    return tuple((j, theirs_j, float(logits[j, theirs_j] - logits[j, ours_j]))
                 for j, (ours_j, theirs_j) in enumerate(zip(answer, theirs))
                 if ours_j != theirs_j)


def _first_disagreement(prompt: list[int], answer: list[int]):
    """None when every answer token is transformers' argmax after the same prefix (or
    within NEAR_TIE of it), else (index, transformers' token there, its logit margin
    over ours)."""
    for j, theirs_j, margin in _disagreements(tuple(prompt), tuple(answer)):
        if margin >= NEAR_TIE:
            return j, theirs_j, margin
    return None


# NOTE: quantization none, the dequantized float path: the exact oracle. The file's
# own types (auto, the default) run the integer kernels; the last config holds them
# to the same answers.
_NONE = dict(quantization="none")
CONFIGS = {
    "N=1": dict(num_scheduler_steps=1, enable_prefix_caching=False, **_NONE),
    # NOTE: 24 tokens a step: every chat prompt (their shared system prompt
    # included) is prefilled in chunks, and the second pass meets its cached blocks
    "N=8, prefix caching, chunked prefill": dict(num_scheduler_steps=8, enable_prefix_caching=True,
                                                 max_num_batched_tokens=24, **_NONE),
    "N=1, prefix caching, chunked prefill": dict(num_scheduler_steps=1, enable_prefix_caching=True,
                                                 max_num_batched_tokens=24, **_NONE),
    "N=8, the file's own quantized types": dict(num_scheduler_steps=8, quantization="auto"),
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
        for i, (prompt, out) in enumerate(zip(_prompts(), outs)):
            assert len(out.token_ids) == NUM_NEW_TOKENS
            disagreement = _first_disagreement(prompt, out.token_ids)
            if disagreement is not None:
                j, theirs, margin = disagreement
                raise AssertionError(f"prompt {i}, token {j}: ours {out.token_ids[j]}, "
                                     f"transformers {theirs}, logit margin {margin:.2e}")


def test_the_oracle_catches_one_wrong_token():
    """The check above has teeth: an answer with one token changed disagrees there."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with Engine(EngineConfig(model=trained_model.PRESET, dtype="float32",
                             quantization="none")) as engine:
        answer = engine.generate(_prompts()[:1], params)[0].token_ids
    assert _first_disagreement(_prompts()[0], answer) is None
    wrong = list(answer)
    wrong[10] = (wrong[10] + 1) % 49152
    j, theirs, margin = _first_disagreement(_prompts()[0], wrong)
    assert (j, theirs) == (10, answer[10]) and margin >= NEAR_TIE
