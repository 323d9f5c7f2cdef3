"""Helpers for testing drafters, built-in or third-party.

``check_drafter`` is the conformance suite: run any drafter through it with a small
model (see :func:`tiny_llama`) and it checks the Draft contract, rollback after partial
acceptance, greedy parity with plain decoding (in one batch, and as sequences join and leave
a running batch), and that sampling follows the target's distribution::

    from specdraft.testing import check_drafter, tiny_llama
    check_drafter("my-drafter", tiny_llama())
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Mapping, Sequence

#: Significance level of specdraft's statistical tests. Their seeds are fixed, so a run is
#: deterministic; the level says how far from the target a sampler may drift and still pass.
SIGNIFICANCE = 1e-3


def tiny_llama(vocab_size: int = 64, seed: int = 0, layers: int = 2, max_positions: int = 256, dtype=None):
    """A small random Llama (float64 by default, so greedy ties cannot flip between paths)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype or torch.float64).eval()


def tiny_tokenizer(vocab_size: int = 64):
    """A word-level tokenizer over ``vocab_size`` ids for :func:`tiny_llama` models: ids 0-3 are
    ``<pad> <s> </s> <unk>``, id ``i >= 4`` is the word ``t{i}`` (text is space-separated words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"t{i}": i for i in range(len(special), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def trusting_copy_gate(hidden: int, match_bias: float = 2.0, dtype=None):
    """A :class:`~specdraft.drafters.copy_gate.CopyGate` that often trusts its candidate (2- and
    3-gram matches) and mostly not (1-gram matches), so both halves of the mixture get drafted."""
    import torch

    from .drafters.copy_gate import CopyGate

    gate = CopyGate(hidden).to(dtype or torch.float32)
    with torch.no_grad():
        gate.match.weight.fill_(match_bias)
        gate.match.weight[1] = -match_bias
        gate.agree.fill_(0.5)
    return gate


def random_heads(kind: str, model, path, seed: int = 0, head_ids=None, scale: float = 0.5, copy_gate: bool = False,
                 **config):
    """Save randomly initialised heads of ``kind`` for ``model`` into ``path`` (specdraft's format).

    ``scale`` is the std of the random weights (Medusa's blocks start at identity otherwise);
    ``head_ids`` trims the vocabulary; ``copy_gate`` adds a :func:`trusting_copy_gate`. Returns ``path``.
    """
    import torch

    from .drafters.compact_draft import target_fingerprint
    from .drafters.heads.formats import save_heads
    from .drafters.heads.modules import SharedHead, build_heads

    torch.manual_seed(seed)
    module = build_heads(kind, model.config.get_text_config(), **config).to(model.dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale / p.shape[1] ** 0.5 * 3)
    if copy_gate:
        module.copy_gate = trusting_copy_gate(model.config.get_text_config().hidden_size, dtype=model.dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    shared = SharedHead(model.get_output_embeddings(), vocab, head_ids)
    return save_heads(module, shared, path, "tiny", target_fingerprint(model.get_input_embeddings().weight),
                      dtype=model.dtype)


def plain_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy ``generate`` (no specdraft code involved)."""
    import torch

    out = model.generate(
        torch.tensor([list(prompt)], device=model.device), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def naive_penalized_greedy(model, prompt: Sequence[int], max_new_tokens: int, params) -> list[int]:
    """Reference for greedy decoding with penalties, written out token by token with no
    specdraft code: a full forward per step, then transformers' repetition penalty and
    OpenAI's presence and frequency penalties on that step's logits, then the argmax."""
    from collections import Counter

    import torch

    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].double().tolist()
            for t in set(tokens):
                logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
            for t, c in Counter(out).items():
                logits[t] -= params.presence_penalty + params.frequency_penalty * c
            best = max(range(len(logits)), key=lambda i: (logits[i], -i))
            tokens.append(best)
            out.append(best)
    return out


def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (so copy-style drafters get accepted) and of different lengths."""
    import random

    rng = random.Random(seed)
    motif = [rng.randrange(vocab_size) for _ in range(5)]
    return [
        motif * 3 + motif[:2],
        [rng.randrange(vocab_size) for _ in range(11)],
        [rng.randrange(vocab_size)],
        (motif[::-1] * 2)[:7],
    ]


#: The sampling settings the conformance suite checks drafters under: every stage of the pipeline.
PIPELINE = dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                frequency_penalty=0.3)


@contextmanager
def recorded_proposals(decoder):
    """Within the block, every ``propose`` of ``decoder``'s drafter is recorded as ``(draft, ctx, k)``."""
    inner, proposals = decoder.drafter.propose, []

    def spy(ctx, k):
        draft = inner(ctx, k)
        proposals.append((draft, ctx, k))
        return draft

    decoder.drafter.propose = spy
    try:
        yield proposals
    finally:
        del decoder.drafter.propose


def continuous_requests(vocab_size: int) -> list[tuple[list[int], int, str]]:
    """The requests :func:`check_continuous_batching` runs: ``(prompt, max_new_tokens, kind)`` with
    ``kind`` ``"greedy"``, ``"penalized"`` (greedy, penalties on) or ``"sampled"`` (:data:`PIPELINE`);
    prompts of 1 to 17 tokens and budgets of 3 to 19, so sequences finish at different steps."""
    base = repetitive_prompts(vocab_size)
    return [
        (base[0], 13, "greedy"), (base[2], 13, "greedy"), (base[1][:5], 13, "greedy"),  # one generate call
        (base[3], 3, "greedy"), (base[2] + base[3], 19, "greedy"), (base[1], 9, "penalized"),
        (base[0][:6], 6, "sampled"), (base[1][:3], 11, "greedy"),
    ]


def check_continuous_batching(
    drafter: str | Any,
    model,
    drafter_options: Mapping[str, Any] | None = None,
    spec_length: int = 3,
    max_batch: int = 2,
    timeout: float = 600.0,
) -> None:
    """The drafter under continuous batching; raises ``AssertionError`` describing the first violation.

    A decoder with ``max_batch`` slots gets the 8 requests of :func:`continuous_requests` from two
    threads at once: one thread makes a ``generate_ids`` call of three prompts, the other opens a
    stream per request, each with its own ``max_new_tokens`` and settings. So sequences join a
    running batch, leave it early, change rows between rounds, and share rounds with a penalized
    and a sampled batchmate (``ctx.sampling`` then differs between rows). Each greedy request must
    equal plain greedy decoding (:func:`plain_greedy`; :func:`naive_penalized_greedy` with the
    penalties on), and every proposal must be a valid Draft.

    An API-version-2 drafter must have seen sequences join mid-flight; a version-1 drafter runs
    in waves (rows keep their sequence until the wave has finished) and must be exact all the same.
    """
    import threading

    from .decoder import SpeculativeDecoder
    from .engine import check_draft
    from .sampling import SamplingParams

    vocab = model.get_output_embeddings().weight.shape[0]
    requests = continuous_requests(vocab)
    penalized = SamplingParams(**{**PIPELINE, "temperature": 0.0})
    settings = {"greedy": {}, "penalized": penalized.model_dump(), "sampled": dict(PIPELINE, seed=0)}
    together, alone = requests[:3], requests[3:]
    dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=spec_length, drafter_options=drafter_options,
                             adaptive=False, max_batch=max_batch)
    version = getattr(dec.drafter, "api_version", 1)
    got: list = [None] * len(requests)
    errors: list = []
    start = threading.Barrier(2)

    def call():  # one generate call: its sequences share the call's settings and budget
        start.wait()
        results = dec.generate_ids([p for p, _, _ in together], max_new_tokens=together[0][1])
        for i, r in enumerate(results):
            got[i] = r

    def streams():  # a stream per request, each with its own budget and settings
        start.wait()
        opened = [dec.stream_ids(p, max_new_tokens=n, **settings[kind]) for p, n, kind in alone]
        for i, stream in enumerate(opened, len(together)):
            for _ in stream:
                pass
            got[i] = stream.result

    def guarded(work):
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    try:
        with recorded_proposals(dec) as proposals:
            threads = [threading.Thread(target=guarded, args=(w,), daemon=True) for w in (call, streams)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout)
            assert not any(th.is_alive() for th in threads), \
                f"continuous batching (max_batch={max_batch}): requests still unfinished after {timeout:g} s"
    finally:
        dec.close()
    if errors:
        raise AssertionError(f"continuous batching (max_batch={max_batch}, K={spec_length}, drafter API version "
                             f"{version}) failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]

    who = repr(dec.drafter.name or type(dec.drafter).__name__)
    for draft, ctx, kk in proposals:
        check_draft(draft, ctx.batch_size, kk, vocab, who, model.device)
    for i, ((prompt, n, kind), r) in enumerate(zip(requests, got)):
        if kind == "sampled":
            assert len(r.token_ids) == n or r.finish_reason == "eos", f"request {i} (sampled) ended early: {r}"
            continue
        expected = plain_greedy(model, prompt, n) if kind == "greedy" else naive_penalized_greedy(model, prompt, n,
                                                                                                 penalized)
        assert r.token_ids == expected, (
            f"continuous batching (max_batch={max_batch}, K={spec_length}, drafter API version {version}): request "
            f"{i} ({kind}, a {len(prompt)}-token prompt, max_new_tokens={n}) differs from plain greedy decoding\n"
            f"  got      {r.token_ids}\n  expected {expected}")

    rounds = [list(ctx.seq_ids) for _, ctx, _ in proposals]
    seen: set[int] = set()
    joined_mid_flight = False
    for before, now in zip([[]] + rounds, rounds):
        if version >= 2:
            joined_mid_flight |= bool(set(now) & seen) and not set(now) <= seen
        else:
            assert now == before or not set(now) & seen, \
                f"a version-1 drafter's rows changed within a wave: {before} then {now}"
        seen |= set(now)
    assert version < 2 or joined_mid_flight, \
        f"continuous batching: no sequence joined a running batch (rounds' sequence ids: {rounds})"


def check_drafter(
    drafter: str | Any,
    model,
    drafter_options: Mapping[str, Any] | None = None,
    spec_lengths: Sequence[int] = (1, 3, 5),
    max_new_tokens: int = 24,
    samples: int = 8_000,
) -> None:
    """Conformance suite; raises ``AssertionError`` describing the first violation.

    * every proposal is a valid Draft (shape, dtype, token range, probability rows); a tree
      (``Draft.parents``, for a drafter with a ``tree_budget`` option, passed in
      ``drafter_options``) also has its parents before its children, depth at most K and no more
      nodes than ``ctx.tree_budget``, and every check below runs through the tree verifier
      (greedy walk, multi-draft rejection);
    * batched greedy speculative decoding equals transformers' plain greedy decoding for
      every K in ``spec_lengths`` -- which also covers rollback after partial acceptance --
      and equals a naive reference with the penalties on (:func:`naive_penalized_greedy`);
    * a second call on the same decoder gives the same output (``reset`` works);
    * under continuous batching (:func:`check_continuous_batching`: two slots, eight requests
      from two threads, joining and leaving at different steps, with different settings) every
      greedy request still equals plain greedy decoding, for drafter API version 1 or 2;
    * sampling with every pipeline stage on (:data:`PIPELINE`: temperature, top-k, top-p,
      min-p, repetition, presence and frequency penalties; a prompt with repeats): the first
      two tokens of ``samples`` runs follow the target's exact joint distribution (chi-square
      at :data:`SIGNIFICANCE`), and every distribution the drafter reports passes the
      pipeline's filters (at most top-k tokens, none below min-p times the most likely).
      Whether a drafter conditions its own guesses on the penalties' context changes how
      often they are accepted, never the output, so no black-box test can tell.
    """
    import torch

    from .decoder import SpeculativeDecoder
    from .sampling import SamplingParams
    from .engine import check_draft

    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = repetitive_prompts(vocab)
    expected = [plain_greedy(model, p, max_new_tokens) for p in prompts]
    pipeline = SamplingParams(**PIPELINE)
    penalized = pipeline.model_copy(update={"temperature": 0.0})
    for k in spec_lengths:
        dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=k, drafter_options=drafter_options)
        with recorded_proposals(dec) as proposals:
            got = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=max_new_tokens)]
        for draft, ctx, kk in proposals:
            _, lengths, _, parents = check_draft(draft, ctx.batch_size, kk, vocab, repr(dec.drafter.name), model.device)
            if parents is not None:
                assert (int(lengths.max()) if lengths.numel() else 0) <= ctx.tree_budget, \
                    f"drafter {dec.drafter.name!r} returned a tree of {int(lengths.max())} nodes; ctx.tree_budget " \
                    f"was {ctx.tree_budget}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"K={k}, prompt {i}: speculative output differs from plain greedy\n  got      {g}\n  expected {e}"
        again = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=max_new_tokens)]
        assert again == got, f"K={k}: a second generate call on the same decoder gave different output"

    k = max(spec_lengths)
    check_continuous_batching(drafter, model, drafter_options, spec_length=k)
    dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=k, drafter_options=drafter_options,
                             adaptive=False)
    n = max_new_tokens // 2
    got = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=n, **penalized.model_dump())]
    for i, p in enumerate(prompts):
        e = naive_penalized_greedy(model, p, n, penalized)
        assert got[i] == e, f"K={k}, prompt {i}, penalties on: speculative greedy output differs from the naive " \
                            f"reference\n  got      {got[i]}\n  expected {e}"
    if samples:
        with recorded_proposals(dec) as proposals:
            pvalue, _ = sampled_joint_pvalue(dec, prompts[0], pipeline, n=samples, seed=0)
        for draft, ctx, kk in proposals:
            _, lengths, probs, _ = check_draft(draft, ctx.batch_size, kk, vocab, repr(dec.drafter.name), model.device)
            if probs is None:
                continue
            valid = torch.arange(probs.shape[1], device=lengths.device) < lengths[:, None]  # [batch, k']
            rows = probs[valid].double()  # [n_valid, vocab]
            kept = rows > 0
            assert int(kept.sum(-1).max()) <= pipeline.top_k, \
                f"drafter {dec.drafter.name!r} reported a distribution with more than top_k={pipeline.top_k} tokens"
            floor = pipeline.min_p * rows.amax(-1, keepdim=True) * (1 - 1e-6)
            assert not bool((kept & (rows < floor)).any()), \
                f"drafter {dec.drafter.name!r} reported a distribution with tokens below min_p={pipeline.min_p}"
        assert pvalue > SIGNIFICANCE, f"drafter {dec.drafter.name!r}: sampled output does not follow the target's " \
                                      f"distribution (chi-square p = {pvalue:.3g} under {PIPELINE})"



def exact_joint_distribution(model, prompt: Sequence[int], params, steps: int = 2):
    """P(first ``steps`` tokens) under plain sampling from ``model``, by enumeration.

    The model computes its logits in its own dtype (bfloat16 stays bfloat16); the sampling
    pipeline and the products run in float64, penalties reading each step's own context.
    Returns a ``[vocab] * steps`` tensor; practical for vocabularies of a few dozen tokens.
    """
    import itertools

    import torch

    from .sampling import TokenCounts, logits_to_probs

    vocab = model.config.vocab_size
    joint = torch.zeros([vocab] * steps, dtype=torch.float64)
    start = TokenCounts.of([list(prompt)], [len(prompt)], vocab)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=steps - 1):
            ids = torch.tensor([list(prompt) + list(seq)], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 :].cpu().double()  # [steps, vocab]
            counts = start.along(torch.tensor([list(seq)], dtype=torch.long))
            probs = logits_to_probs(logits[None], params, counts)[0]  # [steps, vocab]
            prefix = 1.0
            for i, t in enumerate(seq):
                prefix *= float(probs[i, t])
            joint[seq] = prefix * probs[steps - 1]
    return joint


def sampled_joint_pvalue(decoder, prompt: Sequence[int], params, n: int = 12_000, seed: int = 0,
                         exact=None, steps: int = 2, max_new_tokens: int | None = None):
    """p-value of the first ``steps`` tokens of ``n`` speculative samples from ``decoder`` (one
    batched call, ``prompt`` repeated) against the target's exact joint distribution.

    Chi-square tests of the joint and of each token's marginal (a marginal has far fewer cells,
    so far more power against a skewed distribution; the joint catches dependence between the
    tokens), combined by Bonferroni: ``min(1, tests * smallest p)``. Returns
    ``(p_value, results)``; compare the p-value with :data:`SIGNIFICANCE`. ``exact`` may pass a
    joint computed once by :func:`exact_joint_distribution`. ``max_new_tokens`` (default
    ``steps``): generate more, so that the first round may draft deeper than ``steps - 1``.
    """
    import torch

    exact = exact_joint_distribution(decoder.model, prompt, params, steps) if exact is None else exact
    results = decoder.generate_ids([list(prompt)] * n, max_new_tokens=max(steps, max_new_tokens or steps), seed=seed,
                                   **params.model_dump())
    counts = torch.zeros_like(exact)
    for r in results:
        counts[tuple(r.token_ids[:steps])] += 1
    pvalues = [chi_square_pvalue(counts, exact)]
    for i in range(steps):
        others = [d for d in range(steps) if d != i]
        pvalues.append(chi_square_pvalue(counts.sum(others), exact.sum(others)))
    return min(1.0, len(pvalues) * min(pvalues)), results


def chi_square_pvalue(observed, expected_probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value (cells with small expectation are pooled)."""
    import torch

    observed = torch.as_tensor(observed, dtype=torch.float64).flatten()
    probs = torch.as_tensor(expected_probs, dtype=torch.float64).flatten()
    n = observed.sum()
    expected = probs * n
    if bool((observed[expected == 0] > 0).any()):
        return 0.0  # a sample where the target puts no mass: certainly wrong
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
