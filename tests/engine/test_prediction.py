"""Predicted Outputs: rows draft from their request's predicted output, with any drafter, and the
output is the target's own (greedy: token for token; sampled: its law, by chi-square at
``specdraft.testing.SIGNIFICANCE``)."""

from __future__ import annotations

import random

import pytest

from specdraft import SpeculativeDecoder
from specdraft.errors import ConfigError
from specdraft.sampling import SamplingParams
from specdraft.testing import SIGNIFICANCE, plain_greedy, repetitive_prompts, sampled_joint_pvalue
from specdraft.verifier.prediction import Prediction

N = 24


def _predictions(expected: list[list[int]]) -> list[list[int] | None]:
    """For each prompt: the right output, one with a substitution and an insertion, a shuffled
    one, an empty one, and none."""
    right, edited, shuffled = list(expected[0]), list(expected[1]), list(expected[2])
    edited[6] = (edited[6] + 1) % 64
    edited[12:12] = [3, 9]
    random.Random(0).shuffle(shuffled)
    return [right, edited, shuffled, [], None]


@pytest.mark.parametrize("drafter, options", [("none", {}), ("ngram", {"tree_budget": 8})])
def test_greedy_parity_with_right_wrong_shuffled_and_empty_predictions(tiny_model, drafter, options, step_clock):
    """(``step_clock``: every pass costs the same, so the draft lengths, and the counts asserted
    on, do not depend on this machine's timings; the output never does.)"""
    prompts = repetitive_prompts(64)
    prompts = prompts + [prompts[0][:7]]  # five prompts
    expected = [plain_greedy(tiny_model, p, N) for p in prompts]
    # two slots for five requests: rows with and without a prediction share passes as they come and go
    dec = SpeculativeDecoder(tiny_model, None, drafter=drafter, spec_length=4, drafter_options=options, max_batch=2)
    results = dec.generate_ids(prompts, max_new_tokens=N, prediction=_predictions(expected))
    assert [r.token_ids for r in results] == expected
    right = results[0].stats
    assert right.accepted_prediction_tokens >= N - right.target_passes and right.rejected_prediction_tokens == 0
    assert right.target_passes <= N // 4  # dozens of tokens per pass where the prediction is right
    assert results[1].stats.rejected_prediction_tokens > 0 and results[1].stats.accepted_prediction_tokens > N // 2
    assert all(r.stats.accepted_prediction_tokens == r.stats.rejected_prediction_tokens == 0 for r in results[3:])


def test_usage_counts_the_predicted_drafts(tiny_model, step_clock):
    """With no drafter every drafted token is a predicted one: accepted + rejected = drafted."""
    prompt = repetitive_prompts(64)[1]
    expected = plain_greedy(tiny_model, prompt, N)
    wrong = list(expected)
    wrong[9] = (wrong[9] + 5) % 64
    dec = SpeculativeDecoder(tiny_model, None, drafter="none", spec_length=4)
    [r] = dec.generate_ids([prompt], max_new_tokens=N, prediction=[wrong])
    st = r.stats
    assert r.token_ids == expected
    assert st.accepted_prediction_tokens == st.accepted_tokens and st.rejected_prediction_tokens > 0
    assert st.accepted_prediction_tokens + st.rejected_prediction_tokens == st.drafted_tokens
    assert st.accepted_prediction_tokens + st.target_passes == N  # every other token is a pass's own


@pytest.mark.parametrize("drafter, options", [("none", {}), ("ngram", {"tree_budget": 6})])
def test_sampling_with_a_prediction_follows_the_target(small_vocab_model, drafter, options):
    """Seeded sampling drafts a fixed ``spec_length`` from the prediction, so the first round
    tests rejection at every position; rows without the prediction's luck use the drafter."""
    prompt = [1, 2, 3, 1, 2]
    prediction = plain_greedy(small_vocab_model, prompt, 8)
    params = SamplingParams(temperature=1.0, top_k=6)
    dec = SpeculativeDecoder(small_vocab_model, None, drafter=drafter, spec_length=3, drafter_options=options,
                             adaptive=False, max_batch=512)
    pvalue, results = sampled_joint_pvalue(dec, prompt, params, seed=3, prediction=prediction)
    accepted = sum(r.stats.accepted_prediction_tokens for r in results)
    rejected = sum(r.stats.rejected_prediction_tokens for r in results)
    assert accepted > 0 and rejected > 0  # rejections happened, at some depth
    assert pvalue > SIGNIFICANCE


def test_the_cursor_follows_insertions_and_deletions():
    p = Prediction(list(range(10, 30)))
    assert p.draft([], 4) == [10, 11, 12, 13]
    assert p.draft([10, 11, 12, 99, 13, 14], 3) == [15, 16, 17]  # an insertion: re-anchored on (13, 14)
    assert p.draft([10, 11, 12, 99, 13, 14, 15, 18, 19], 2) == [20, 21]  # a deletion of 16, 17
    assert p.draft([10, 11, 12, 99, 13, 14, 15, 18, 19, 7], 2) == []  # lost: the drafter's turn
    repeated = Prediction([1, 2, 3, 9, 1, 2, 4])
    assert repeated.draft([1, 2, 3, 9, 5, 1, 2], 1) == [4]  # forward of the old cursor first


def test_bad_predictions_are_refused_with_one_clear_error(tiny_model):
    dec = SpeculativeDecoder(tiny_model, None, drafter="none")
    prompt = repetitive_prompts(64)[0]
    with pytest.raises(ConfigError, match="one entry per prompt"):
        dec.generate_ids([prompt], max_new_tokens=4, prediction=[[1], [2]])
    with pytest.raises(ConfigError, match=r"prediction 0 has token ids outside \[0, 64\)"):
        dec.generate_ids([prompt], max_new_tokens=4, prediction=[[1, 64]])
    with pytest.raises(ConfigError, match="prediction 0 has .* tokens but the model's context holds"):
        dec.generate_ids([prompt], max_new_tokens=4, prediction=[[1] * dec.target.max_context])
    [r] = dec.generate_ids([prompt], max_new_tokens=4, prediction=[[]])  # empty: no prediction
    assert r.token_ids == plain_greedy(tiny_model, prompt, 4)
