"""The conformance suite any drafter can be run through."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Mapping, Sequence

from .models import repetitive_prompts
from .reference import naive_penalized_greedy, plain_greedy
from .stats import SIGNIFICANCE, sampled_joint_pvalue


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

    from ..decoder import SpeculativeDecoder
    from ..verifier import check_draft
    from ..sampling import SamplingParams

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

    if getattr(dec.drafter, "never_drafts", False):  # ``none``: plain steps, and never asked
        assert not proposals, f"{who} sets never_drafts but was asked to propose {len(proposals)} times"
        return
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
    samples: int | None = None,
    sampled_depth: int = 3,
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
      min-p, repetition, presence and frequency penalties; a prompt with repeats), drafting
      ``K = min(max(spec_lengths), sampled_depth)`` tokens: the first ``K + 1`` tokens of
      ``samples`` runs (default: the power calculation's size, see
      :mod:`specdraft.testing.stats`; 0 turns the check off) follow the target's exact
      distribution, enumerated independently of specdraft's sampling code (chi-square tests at
      :data:`SIGNIFICANCE`), and every distribution the drafter reports passes the
      pipeline's filters (at most top-k tokens, none below min-p times the most likely).
      Whether a drafter conditions its own guesses on the penalties' context changes how
      often they are accepted, never the output, so no black-box test can tell.
    """
    import torch

    from ..decoder import SpeculativeDecoder
    from ..sampling import SamplingParams
    from ..verifier import check_draft

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
    if samples != 0:
        # the enumeration grows as top_k ** (K + 1): deeper drafts are checked greedily above
        depth = min(k, sampled_depth)
        dec = SpeculativeDecoder(model, None, drafter=drafter, spec_length=depth, drafter_options=drafter_options,
                                 adaptive=False, max_batch=512)
        with recorded_proposals(dec) as proposals:
            pvalue, _ = sampled_joint_pvalue(dec, prompts[0], pipeline, n=samples, seed=0)
        for draft, ctx, kk in proposals:
            _, lengths, probs, _ = check_draft(draft, ctx.batch_size, kk, vocab, repr(dec.drafter.name), model.device)
            if probs is None:
                continue
            valid = torch.arange(probs.shape[1], device=lengths.device) < lengths[:, None]  # [batch, k']
            rows = probs[valid].double()  # [n_valid, vocab]
            kept = rows > 0
            # beyond the top_k most likely, only ties with the k-th (top-k keeps ties, as transformers'
            # does: a draft model's logits after a token whose embedding is zero are all equal)
            ranked = rows.sort(-1, descending=True).values  # [n_valid, vocab]
            beyond = ranked[:, pipeline.top_k:]
            kth = ranked[:, pipeline.top_k - 1 : pipeline.top_k]
            assert not bool(((beyond > 0) & (beyond < kth * (1 - 1e-6))).any()), \
                f"drafter {dec.drafter.name!r} reported a distribution with more than top_k={pipeline.top_k} tokens"
            floor = pipeline.min_p * rows.amax(-1, keepdim=True) * (1 - 1e-6)
            assert not bool((kept & (rows < floor)).any()), \
                f"drafter {dec.drafter.name!r} reported a distribution with tokens below min_p={pipeline.min_p}"
        assert pvalue > SIGNIFICANCE, f"drafter {dec.drafter.name!r}: sampled output does not follow the target's " \
                                      f"distribution (chi-square p = {pvalue:.3g} under {PIPELINE})"



