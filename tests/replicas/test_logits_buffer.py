"""Below float32 on a CPU the runner widens each step's logits into one reused buffer
(replicas/model_runner.py): tokens and logprobs are what fresh logits give, across
multi-step windows, prefills beside decodes, and seeded sampling."""
import torch

from replicas import Engine, EngineConfig, SamplingParams


def _run(buffered: bool) -> list[tuple[list[int], list[float]]]:
    # NOTE: 16 tokens a step: the 40-token prompt prefills in chunks while the
    # others decode, so steps mix prefill chunks with decodes
    config = EngineConfig(model="tiny", dtype="bfloat16", max_num_seqs=8, num_threads=1,
                          max_num_batched_tokens=16)
    with Engine(config) as engine:
        runner = engine.core.runner
        assert runner._float_logits is not None
        if not buffered:
            runner._float_logits = None
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=1.0, seed=7, max_tokens=17, ignore_eos=True,
                                 logprobs=0),
                  SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=30,
                                 ignore_eos=True, logprobs=1)]
        prompts = [list(range(5, 5 + n)) for n in (9, 40, 3)]
        outs = engine.generate(prompts, params)
    return [(o.token_ids, o.logprobs) for o in outs]


def test_reused_logits_buffer_gives_what_fresh_logits_give():
    assert _run(buffered=True) == _run(buffered=False)


def test_float32_and_the_buffer_s_absence_are_the_same_path():
    with Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=4)) as engine:
        runner = engine.core.runner
        assert runner._float_logits is None and runner._logits_buffer(3) is None


def test_the_buffer_grows_to_the_rows_and_keeps_its_storage_below_that():
    with Engine(EngineConfig(model="tiny", dtype="bfloat16", max_num_seqs=4)) as engine:
        runner = engine.core.runner
        vocab = runner.model_config.vocab_size
        big = runner._logits_buffer(6)
        assert big.shape == (6, vocab) and big.dtype == torch.float32
        small = runner._logits_buffer(2)
        assert small.shape == (2, vocab) and small.data_ptr() == big.data_ptr()
