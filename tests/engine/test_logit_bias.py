"""``logit_bias`` under speculation: the biases change the target's distribution at every verified
position (before the masks and the sampling pipeline), so greedy output equals plain decoding with
the same biases and sampled output follows the biased target's law; drafts of a token the bias has
made unlikely are rejected like any other."""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.errors import ConfigError
from specdraft.testing import (SIGNIFICANCE, TargetDrafter, enumerate_plain_sampling, repetitive_prompts,
                               samples_needed, samples_pvalue, tiny_llama)
from specdraft.testing.drafters import TopTwoTree
from specdraft.testing.stats import family_size

N = 16
PROMPTS = repetitive_prompts(64)[:3]


def naive_biased_greedy(model, prompt, max_new_tokens, bias: dict[int, float]) -> list[int]:
    """Plain greedy decoding written out: transformers' own forward, the biases added, the argmax."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logits[list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, seed=0)


@pytest.mark.parametrize("drafter", ["none", "ngram", "target-chain", "target-tree"])
def test_greedy_with_logit_bias_equals_plain_decoding_with_it(model, drafter):
    """The unbiased greedy first tokens are banned (-100) and two others pushed up (+3): the
    target drafter and the tree draft the unbiased argmax, which the biased target must reject."""
    banned = {int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS}
    bias = {**{t: -100.0 for t in banned}, 7: 3.0, 11: 3.0}
    made = {"target-chain": lambda: TargetDrafter(model, scale=1.0), "target-tree": lambda: TopTwoTree(model)}
    with SpeculativeDecoder(model, None, drafter=made[drafter]() if drafter in made else drafter, spec_length=4,
                            adaptive=False, max_batch=4) as dec:
        biased = dec.generate_ids(PROMPTS, max_new_tokens=N, logit_bias=bias)
        unbiased = dec.generate_ids(PROMPTS[:1], max_new_tokens=N)  # same batch slots, no bias
    for prompt, result in zip(PROMPTS, biased):
        assert result.token_ids == naive_biased_greedy(model, prompt, N, bias)
        assert not banned & set(result.token_ids)
    assert unbiased[0].token_ids[0] in banned  # the bias is what changed the output
    if drafter.startswith("target"):
        assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in biased) > 0


def biased_enumeration(model, prompt, params, steps, bias: dict[int, float]):
    """P(first ``steps`` tokens) under plain sampling with ``bias`` added to the raw logits, every
    prefix enumerated through transformers' processors, no specdraft code."""
    added = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    added[list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float64)
    return enumerate_plain_sampling(model, prompt, params, steps, adjust=lambda level, logits: logits.double() + added)


@pytest.mark.parametrize("drafter", ["target-chain-sampled", "target-tree"])
def test_sampling_with_logit_bias_follows_the_biased_target(drafter):
    """Chi-square at SIGNIFICANCE against the enumerated biased law (and far from the unbiased
    one): the target's two most likely first tokens pushed down by 3, a rare one up by 3."""
    prompt, steps = [3, 5, 3, 5, 3], 3
    params = SamplingParams(temperature=1.0, top_k=6)
    model = tiny_llama(vocab_size=16, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked law: the bias moves a lot of mass
        order = model(torch.tensor([prompt])).logits[0, -1].argsort(descending=True).tolist()
    bias = {order[0]: -3.0, order[1]: -3.0, order[-1]: 3.0}
    exact = biased_enumeration(model, prompt, params, steps, bias)
    drafting = TargetDrafter(model, scale=0.5) if drafter == "target-chain-sampled" else TopTwoTree(model)
    dec = SpeculativeDecoder(model, None, drafter=drafting, spec_length=steps - 1, adaptive=False, max_batch=1024)
    support = max(int((exact.marginal(i) > 0).sum()) for i in range(steps))
    n = samples_needed(support - 1, family_size(steps), effect=0.2)
    results = dec.generate_ids([prompt] * n, max_new_tokens=steps, seed=5, logit_bias=bias, **params.model_dump())
    samples = [r.token_ids for r in results]
    assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in results) > 0
    assert samples_pvalue(samples, exact) > SIGNIFICANCE
    assert samples_pvalue(samples, enumerate_plain_sampling(model, prompt, params, steps)) < SIGNIFICANCE
    dec.close()


@pytest.mark.parametrize("bias, says", [
    ([1, 2], "logit_bias must be a mapping of token ids to numbers, got list"),
    ({"7": 1.0}, "logit_bias has the key '7'; keys must be token ids from 0 to 63"),
    ({64: 1.0}, "logit_bias has the key 64; keys must be token ids from 0 to 63"),
    ({7: 101}, "logit_bias[7] is 101; a bias must be a number from -100 to 100"),
    ({7: float("nan")}, "logit_bias[7] is nan"),
    ({7: True}, "logit_bias[7] is True"),
])
def test_bad_logit_bias_is_one_config_error(model, bias, says):
    with SpeculativeDecoder(model, None, drafter="ngram") as dec, pytest.raises(ConfigError) as caught:
        dec.generate_ids(PROMPTS[:1], max_new_tokens=2, logit_bias=bias)
    assert str(caught.value).startswith(says)
