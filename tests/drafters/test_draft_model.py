"""draft-model: two models, two caches, exact greedy and sampled output."""

from __future__ import annotations

import pytest
import torch

from specdraft import ConfigError, ModelLoadError, SamplingParams, SpeculativeDecoder
from specdraft.drafters.draft_model import check_tokenizers
from specdraft.runner import load_runner
from specdraft.testing import SIGNIFICANCE as ALPHA
from specdraft.testing import (
    gated_draft,
    plain_greedy,
    repetitive_prompts,
    sampled_joint_pvalue,
    tiny_llama,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Save models to folders, as the drafter loads its model by path."""

    def _save(model, name):
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        return str(path)

    return _save


@pytest.fixture(scope="module")
def draft_dir(saved):
    return saved(tiny_llama(vocab_size=64, seed=7, layers=1), "draft")


def _decoder(target, draft_dir, k=3, min_confidence=0.0, options=None, **kw):
    """The tiny random drafts are unsure of every guess: min_confidence 0 keeps them drafting."""
    return SpeculativeDecoder(target, None, drafter="draft-model", spec_length=k, **kw,
                              drafter_options={"model": draft_dir, "dtype": "float64", "min_confidence": min_confidence,
                                               **(options or {})})


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity(tiny_model, draft_dir, k):
    prompts = repetitive_prompts(64, seed=11)
    results = _decoder(tiny_model, draft_dir, k).generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 30)
        assert r.stats.drafted_tokens > 0


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_parity_compiled(tiny_model, draft_dir, k):
    """Target and draft both compiled (width buckets, padding): still plain greedy decoding."""
    prompts = repetitive_prompts(64, seed=11)
    dec = SpeculativeDecoder(tiny_model, None, drafter="draft-model", spec_length=k, compile=True,
                             drafter_options={"model": draft_dir, "dtype": "float64", "min_confidence": 0.0,
                                              "compile": True})
    assert dec.runner_info["compiled"] and dec.drafter.runner.info["compiled"]
    results = dec.generate_ids(prompts, max_new_tokens=30)
    for p, r in zip(prompts, results):
        assert r.token_ids == plain_greedy(tiny_model, p, 30)
        assert r.stats.drafted_tokens > 0


def test_padded_draft_vocabulary(tiny_model, saved):
    """Embedding rows beyond the target's vocabulary (common padding) are never drafted."""
    padded = saved(tiny_llama(vocab_size=72, seed=8, layers=1), "padded")
    prompts = repetitive_prompts(64, seed=2)
    for r, p in zip(_decoder(tiny_model, padded).generate_ids(prompts, max_new_tokens=20, temperature=1.0, seed=1),
                    prompts):
        assert max(r.token_ids) < 64


def test_target_as_its_own_draft_accepts_everything(tiny_model, saved):
    same = saved(tiny_model, "same")
    dec = _decoder(tiny_model, same, k=3, adaptive=False)
    prompt = repetitive_prompts(64)[1]
    r = dec.generate_ids([prompt], max_new_tokens=24)[0]
    assert r.token_ids == plain_greedy(tiny_model, prompt, 24)
    assert r.stats.acceptance_rate == 1.0 and r.stats.target_passes == 24 // 4  # K accepted, K+1 emitted


def test_own_draft_accepts_everything_in_a_ragged_batch(tiny_model, saved):
    """Rows of different lengths: the draft reads its logits at each row's own last position."""
    dec = _decoder(tiny_model, saved(tiny_model, "same-ragged"), k=3, adaptive=False)
    prompts = repetitive_prompts(64)
    assert len({len(p) for p in prompts}) > 1
    for p, r in zip(prompts, dec.generate_ids(prompts, max_new_tokens=16)):
        assert r.token_ids == plain_greedy(tiny_model, p, 16)
        assert r.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("threshold", [0.05, 0.12])
def test_greedy_drafting_stops_at_the_first_doubtful_token(tiny_model, draft_dir, threshold):
    """With min_confidence, a greedy proposal is the confident prefix of the full one: it ends
    just before the first token the draft gives less than the threshold; parity still holds."""
    from specdraft.types import DraftContext

    prompts = repetitive_prompts(64, seed=3)
    full, cut = (_decoder(tiny_model, draft_dir, k=5, min_confidence=t) for t in (0.0, threshold))
    ctx = DraftContext(token_ids=[list(p) for p in prompts], prompt_lengths=[len(p) for p in prompts],
                       active=[True] * len(prompts), vocab_size=64, device=torch.device("cpu"), sampling=SamplingParams())
    whole, part = full.drafter.propose(ctx, 5), cut.drafter.propose(ctx, 5)
    assert whole.lengths.tolist() == [5] * len(prompts)
    stopped = 0
    for b, p in enumerate(prompts):
        n = int(part.lengths[b])
        assert part.token_ids[b, :n].tolist() == whole.token_ids[b, :n].tolist()
        probs = [plain_probs(full.drafter, p + whole.token_ids[b, :i].tolist()) for i in range(min(n + 1, 5))]
        assert all(float(q.max()) >= threshold for q in probs[:n])
        if n < 5:
            assert float(probs[n].max()) < threshold
            stopped += 1
    assert 0 < stopped
    for p, r in zip(prompts, cut.generate_ids(prompts, max_new_tokens=20)):
        assert r.token_ids == plain_greedy(tiny_model, p, 20)


def plain_probs(drafter, tokens):
    """The draft model's next-token distribution after ``tokens``, from a fresh forward."""
    with torch.no_grad():
        logits = drafter.model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return logits.double().softmax(-1)


@pytest.mark.parametrize("same,tree", [(True, False), (False, False), (False, True)])
def test_draft_cache_equals_a_fresh_prefill(tiny_model, draft_dir, saved, same, tree):
    """After rollbacks (different draft) or catch-ups (same model), the cache is a fresh prefill;
    after tree rounds too (the tree's nodes lie past the fed tokens and are rolled back)."""
    dec = _decoder(tiny_model, saved(tiny_model, "same2") if same else draft_dir, k=4, adaptive=False,
                   options={"tree_budget": 8, "tree_width": 2} if tree else None)
    prompt = repetitive_prompts(64)[0]
    drafter = dec.drafter
    seen, leave = {}, drafter.on_leave

    def on_leave(seq_id):  # the sequence's state as it leaves (then it is dropped)
        seen["fed"] = list(drafter._fed[seq_id])
        seen["drafts"] = drafter._drafts_fed.get(seq_id, 0)  # fed last round: not copied to the host, kept on
        seen["length"] = int(drafter.runner.cache.lengths[drafter._slots.slot[seq_id]])
        leave(seq_id)

    drafter.on_leave = on_leave
    result = dec.generate_ids([prompt], max_new_tokens=21)[0]
    fed = seen["fed"]
    assert len(fed) > len(prompt) and fed == (prompt + result.token_ids)[: len(fed)]
    if tree:
        assert result.stats.drafted_tokens > 4 * result.stats.drafts  # more nodes than levels
        assert seen["length"] >= len(fed)  # the last tree's nodes, if any, past the fed tokens
    else:
        assert seen["length"] == len(fed) + seen["drafts"]
    fresh = load_runner(drafter.model)
    fresh.cache.reset(1, len(fed))
    fresh.forward(torch.tensor([fed]))
    ours, ref = drafter.runner.cache.kv, fresh.cache.kv
    for mine, theirs in zip(ours.keys + ours.values, ref.keys + ref.values):
        assert torch.allclose(mine[:, :, : len(fed)], theirs[:, :, : len(fed)], atol=1e-10)


def _check_sampling_exactness(target, draft_path, params, seed, prompt=(3, 5, 3, 5, 3)):
    """The first K + 1 = 4 tokens of speculative samples against the target's exact distribution
    (chi-square at ALPHA, the power calculation's sample size); every row must have drafted."""
    dec = SpeculativeDecoder(target, None, drafter="draft-model", spec_length=3, max_batch=512,
                             drafter_options={"model": draft_path, "dtype": "float64"})
    pvalue, results = sampled_joint_pvalue(dec, list(prompt), params, seed=seed)
    assert sum(r.stats.drafted_tokens for r in results) >= len(results)  # every row drafted
    assert pvalue > ALPHA


class FakeTokenizer:
    def __init__(self, size=100, eos=2, rename=None):
        self.size, self.eos_token_id, self.rename = size, eos, rename or {}
        self.bos_token_id, self.pad_token_id, self.unk_token_id = 1, 0, 3

    def __len__(self):
        return self.size

    def convert_ids_to_tokens(self, ids):
        return [self.rename.get(i, f"tok{i}") for i in ids]


@pytest.mark.parametrize("draft, message", [
    (FakeTokenizer(size=101), "vocabulary of 100 vs 101 tokens"),
    (FakeTokenizer(eos=5), "eos_token_id is 2 vs 5"),
    (FakeTokenizer(rename={97: "other"}), "id 97 is 'tok97' vs 'other'"),
])
def test_tokenizer_mismatch_names_both_models(draft, message):
    with pytest.raises(ConfigError, match=rf"draft model 'small' cannot draft for target 'big'.*{message}"):
        check_tokenizers(FakeTokenizer(), draft, "big", "small")
    check_tokenizers(FakeTokenizer(), FakeTokenizer(), "big", "small")  # identical: no error


def test_missing_draft_weights_say_which_and_how(tiny_model, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"draft model: model 'meta-llama/Llama-3.2-1B-Instruct' is not .*in "
                                             r"the Hugging Face cache.*--drafter-option model=/path/to/folder"):
        SpeculativeDecoder(tiny_model, None, drafter="llama-1b")


def test_target_fingerprint_ignores_precision_but_not_the_weights():
    from specdraft.drafters.common.compact_draft import target_fingerprint

    w = torch.randn(3000, 24)
    fp = target_fingerprint(w)
    assert {target_fingerprint(w.to(d)) for d in (torch.float64, torch.bfloat16, torch.float16)} == {fp}
    changed = w.clone()
    changed[97 * 5, 3] *= -1  # one sampled value of another model
    assert target_fingerprint(changed) != fp
    assert target_fingerprint(w[:2999]) != fp


@pytest.fixture(scope="module")
def gated_dir(tiny_model, tmp_path_factory):
    return gated_draft(tiny_model, tmp_path_factory.mktemp("gated"), head_tokens=48)


def test_copy_gate_changes_the_drafts(tiny_model, gated_dir):
    """The copy mixture is really drafted from: on a repetitive context the gated draft proposes
    what followed the trailing n-gram where the draft alone proposes something else."""
    from specdraft.types import DraftContext

    prompts = repetitive_prompts(64, seed=5)
    proposals = {}
    for on in (True, False):
        dec = SpeculativeDecoder(tiny_model, None, drafter="draft-model", spec_length=3,
                                 drafter_options={"model": gated_dir, "dtype": "float64", "copy_gate": on})
        assert (dec.drafter.copier is not None) == on
        ctx = DraftContext(token_ids=[list(p) for p in prompts], prompt_lengths=[len(p) for p in prompts],
                           active=[True] * len(prompts), vocab_size=64, device=torch.device("cpu"),
                           sampling=SamplingParams())
        proposals[on] = dec.drafter.propose(ctx, 3).token_ids
    from specdraft.drafters.api import prompt_lookup

    copied = [prompt_lookup(p, 1, 2, 3) for p in prompts]
    assert any(c and int(proposals[True][b, 0]) == c[0] != int(proposals[False][b, 0]) for b, c in enumerate(copied))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_with_a_copy_gate(tiny_model, gated_dir, k):
    prompts = repetitive_prompts(64, seed=11)
    dec = SpeculativeDecoder(tiny_model, None, drafter="draft-model", spec_length=k,
                             drafter_options={"model": gated_dir, "dtype": "float64", "min_confidence": 0.0})
    assert dec.drafter.copier is not None
    for p, r in zip(prompts, dec.generate_ids(prompts, max_new_tokens=30)):
        assert r.token_ids == plain_greedy(tiny_model, p, 30)
        assert r.stats.drafted_tokens > 0


def test_sampling_with_a_copy_gate_matches_target_joint_distribution(small_vocab_model, tmp_path):
    """The drafts come from the copy mixture (head of 12 of the 16 tokens, so the candidate is
    sometimes a token the draft itself gives probability 0); the output is still the target's."""
    path = gated_draft(small_vocab_model, tmp_path / "gated", head_tokens=12, seed=3)
    # the prompt 3 5 3 5 3: "3" was followed by "5", so a candidate exists from the first round on
    _check_sampling_exactness(small_vocab_model, path, SamplingParams(temperature=0.8, top_k=4), seed=7)
