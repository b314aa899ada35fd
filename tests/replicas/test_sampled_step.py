"""StepOutput: the host copy of a step's packed sample tensor, unpacked once."""
import pytest

from replicas.sampling.sampled_step import StepOutput


def test_ids_alone_stay_as_they_are():
    out = StepOutput.from_host([5, 7])
    assert (out.token_ids, out.logprobs, out.top_ids, out.has_logprobs) == ([5, 7], None, None, False)
    assert StepOutput.from_host([]).token_ids == []


def test_packed_rows_unpack_into_named_lists():
    # per row: [id, logprob, top ids (width 2)..., top logprobs...] as floats
    out = StepOutput.from_host([[5.0, -0.5, 5.0, 9.0, -0.5, -1.5],
                                [7.0, -0.25, 7.0, 3.0, -0.25, -2.0]])
    assert out.token_ids == [5, 7] and all(type(t) is int for t in out.token_ids)
    assert out.logprobs == [-0.5, -0.25]
    assert out.top_ids == [[5, 9], [7, 3]] and out.top_logprobs == [[-0.5, -1.5], [-0.25, -2.0]]
    no_top = StepOutput.from_host([[4.0, -1.0]])
    assert (no_top.token_ids, no_top.logprobs, no_top.top_ids) == ([4], [-1.0], None)


@pytest.mark.parametrize("kwargs", [
    {"token_ids": [1, 2], "logprobs": [0.0]},
    {"token_ids": [1], "logprobs": [0.0], "top_ids": [[1]]},
    {"token_ids": [1], "top_ids": [[1]], "top_logprobs": [[0.0]]},
    {"token_ids": [1], "logprobs": [0.0], "top_ids": [], "top_logprobs": []},
])
def test_inconsistent_rows_are_refused(kwargs):
    with pytest.raises(ValueError):
        StepOutput(**kwargs)
