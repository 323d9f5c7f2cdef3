"""The speculative decoding loop: draft, verify in one K+1 pass, accept exactly, roll back.

One round, for every active row ``b`` of the batch::

    draft   d_1..d_k'      <- drafter.propose(ctx, k)            (k' <= k, per row)
    verify  logits         <- target([last_b, d_1..d_k'])        one pass, k'+1 positions
    accept  n_b, next_b    <- greedy_accept / rejection_sample    (n_b <= k')
    emit    d_1..d_{n_b}, next_b   (stop conditions checked token by token)
    cache   length_b += n_b + 1    (rejected slots are simply overwritten later)

The cache always holds every token of a row but its last one, which is fed first in the
next round. A round where nobody drafted anything is a plain one-token decoding step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..cache import KVCache, forward_step
from ..errors import ConfigError, DrafterError, SpecdraftError
from ..fastpath import prepare as prepare_fastpath
from ..sampling import SamplingParams, logits_to_probs
from ..types import Draft, DraftContext, GenerationResult, GenerationStats, TargetInfo
from .adaptive import AdaptiveDraftLength
from .rejection import greedy_accept, rejection_sample


@dataclass
class _Row:
    tokens: list[int]  # prompt + output; the drafter sees this very list
    prompt_len: int
    stats: GenerationStats
    finish_reason: str | None = None

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class _Timer:
    device: torch.device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def check_draft(draft: Any, batch: int, k: int, vocab: int, who: str, device: torch.device):
    """Validate a drafter's output against the :class:`Draft` contract.

    Returns ``(token_ids # [batch, k'], lengths # [batch], probs # [batch, k', vocab] | None)``
    on ``device``; raises :class:`DrafterError` naming ``who`` on any violation.
    """

    def bad(msg: str) -> DrafterError:
        return DrafterError(f"drafter {who} returned an invalid draft: {msg}")

    if not isinstance(draft, Draft):
        raise bad(f"expected a specdraft.Draft, got {type(draft).__name__}")
    ids = draft.token_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise bad("token_ids must be an integer tensor of shape [batch, k']")
    if ids.shape[0] != batch or ids.shape[1] > k:
        raise bad(f"token_ids has shape {tuple(ids.shape)}, expected [{batch}, <= {k}]")
    ids = ids.to(device=device, dtype=torch.long)
    width = ids.shape[1]
    if draft.lengths is None:
        lengths = torch.full((batch,), width, dtype=torch.long, device=device)
    else:
        lengths = torch.as_tensor(draft.lengths).to(device=device, dtype=torch.long)
        if lengths.shape != (batch,) or bool((lengths < 0).any()) or bool((lengths > width).any()):
            raise bad(f"lengths must be [batch] with values in 0..{width}")
    valid = torch.arange(width, device=device) < lengths[:, None]  # [batch, k']
    real = ids[valid]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        raise bad(f"token ids must lie in [0, {vocab}); got {int(real.min())}..{int(real.max())}")
    probs = draft.probs
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise bad("probs must be a floating-point tensor or None")
        if probs.shape != (batch, width, vocab):
            raise bad(f"probs has shape {tuple(probs.shape)}, expected [{batch}, {width}, {vocab}]")
        probs = probs.to(device)
        rows = probs[valid].double()  # [n_valid, vocab]
        if rows.numel():
            if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
                raise bad("probs must be finite and non-negative")
            sums = rows.sum(-1)
            if bool(((sums - 1).abs() > 1e-3).any()):
                raise bad(f"each probs row must sum to 1 (got sums from {float(sums.min()):.4f} to {float(sums.max()):.4f})")
            if bool((rows.gather(1, real[:, None]) <= 0).any()):
                raise bad("a drafted token has probability 0 under its own draft distribution")
    return ids, lengths, probs


class Verifier:
    """Runs speculative decoding of ``model`` with ``drafter`` for a batch of prompts."""

    def __init__(self, model, drafter, spec_length: int, target: TargetInfo, adaptive: bool = True) -> None:
        self.model = model
        self.drafter = drafter
        self.spec_length = spec_length
        self.target = target
        self.cache = KVCache(model.config.get_text_config().num_hidden_layers, slots=0)
        # Verify-pass costs stay learnt across calls; acceptance is relearnt per call.
        self.policy = AdaptiveDraftLength(spec_length) if adaptive else None

    @property
    def wants_hidden(self) -> bool:
        return bool(getattr(self.drafter, "needs_hidden_states", False))

    def _hand_hidden(self, ctx: DraftContext, hidden: torch.Tensor | None, counts: list[int]) -> None:
        """Give the drafter ``hidden[b, :counts[b]]`` for every row (empty where nothing is new)."""
        width = int(self.target.hidden_size or (hidden.shape[-1] if hidden is not None else 0))
        rows = [hidden[b, :n] if hidden is not None and n > 0
                else torch.zeros((0, width), dtype=self.target.dtype, device=self.target.device)
                for b, n in enumerate(counts)]
        self._call_drafter("on_hidden_states", ctx, rows)

    @property
    def _drafter_label(self) -> str:
        name = getattr(self.drafter, "name", "") or type(self.drafter).__name__
        plugin = getattr(self.drafter, "plugin", "")
        return f"{name!r}" + (f" (plugin {plugin!r})" if plugin else "")

    def _call_drafter(self, method: str, *args):
        try:
            return getattr(self.drafter, method)(*args)
        except SpecdraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - a drafter's own failure, named
            raise DrafterError(
                f"drafter {self._drafter_label} raised {type(exc).__name__} in {method}(): {exc}"
            ) from exc

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> list[GenerationResult]:
        target, device = self.target, self.target.device
        tokenizer = target.tokenizer
        if stop and tokenizer is None:
            raise ConfigError("stop strings need a tokenizer to decode the output; this decoder has none")
        eos = set(target.eos_token_ids)
        timer = _Timer(torch.device(device))
        start = timer.now()

        rows = [_Row(tokens=list(p), prompt_len=len(p), stats=GenerationStats(prompt_tokens=len(p))) for p in prompts]
        batch = len(rows)
        max_len = min(target.max_context, max(r.prompt_len for r in rows) + max_new_tokens)
        self.cache.reset(batch, slots=max_len + self.spec_length + 1)
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        ctx = DraftContext(
            token_ids=[r.tokens for r in rows],
            prompt_lengths=[r.prompt_len for r in rows],
            active=[True] * batch,
            vocab_size=target.vocab_size,
            device=device,
            sampling=sampling,
            generator=generator,
        )
        if torch.device(device).type == "cpu":  # choose the few-row kernels before anything is timed
            prepare_fastpath(self.model, [batch * w for w in range(1, self.spec_length + 2)])
        self._call_drafter("reset")
        policy = self.policy
        if policy is not None:
            policy.reset_acceptance()
            # Seeded sampling must not depend on timings: the draft lengths change which
            # random numbers are drawn, so they may follow acceptance (a function of the seed) only.
            policy.measure_costs = sampling.greedy or seed is None

        # Prefill everything but each prompt's last token (right-padded; padding is never read).
        longest = max(r.prompt_len for r in rows) - 1
        hidden = None
        if longest > 0:
            prefill = torch.zeros((batch, longest), dtype=torch.long)
            for b, r in enumerate(rows):
                prefill[b, : r.prompt_len - 1] = torch.tensor(r.tokens[: r.prompt_len - 1])
            out = forward_step(self.model, self.cache, prefill.to(device), logits_to_keep=1,
                               return_hidden=self.wants_hidden)
            hidden = out[1] if self.wants_hidden else None  # [batch, longest, hidden_size]
            self.cache.rollback([r.prompt_len - 1 for r in rows])
        if self.wants_hidden:
            self._hand_hidden(ctx, hidden, [r.prompt_len - 1 for r in rows])
        prefill_time = timer.now() - start
        draft_time = verify_time = 0.0
        # Drafting time is a per-token cost sample only when the drafter also ran the round
        # before: the first drafting round includes a draft model's prefill of the prompt, and
        # one after plain steps its catch-up on the tokens they emitted (counting that made
        # drafting look ever dearer the longer the policy paused it, until it never drafted).
        drafted_last = False

        while any(ctx.active):
            t0 = timer.now()
            was_active = list(ctx.active)
            want = policy.choose() if policy is not None else self.spec_length
            caps = [
                min(want, max_new_tokens - len(r.new_tokens) - 1, max_len - len(r.tokens))
                if ctx.active[b] else 0
                for b, r in enumerate(rows)
            ]
            k = max(caps)
            if k > 0:
                draft = self._call_drafter("propose", ctx, k)
                ids, lengths, probs = check_draft(draft, batch, k, target.vocab_size, self._drafter_label, device)
                lengths = torch.minimum(lengths, torch.tensor(caps, device=device))
                width = int(lengths.max())
                ids = ids[:, :width]
                probs = probs[:, :width] if probs is not None else None
            else:
                ids = torch.zeros((batch, 0), dtype=torch.long, device=device)
                lengths = torch.zeros(batch, dtype=torch.long, device=device)
                probs = None
            t1 = timer.now()

            last = torch.tensor([[r.tokens[-1]] for r in rows], device=device)  # [batch, 1]
            old_lengths = list(self.cache.lengths)
            out = forward_step(self.model, self.cache, torch.cat([last, ids], dim=1), return_hidden=self.wants_hidden)
            logits, hidden = out if self.wants_hidden else (out, None)  # [batch, k'+1, vocab], [batch, k'+1, dim]
            if sampling.greedy:
                num_accepted, next_token = greedy_accept(ids, lengths, logits.argmax(-1))
            else:
                target_probs = logits_to_probs(logits, sampling)
                num_accepted, next_token = rejection_sample(ids, lengths, probs, target_probs, generator)
            accepted = num_accepted.tolist()
            drafted = lengths.tolist()
            emitted_rows = [ids[b, :n].tolist() + [t] for b, (n, t) in enumerate(zip(accepted, next_token.tolist()))]
            t2 = timer.now()

            new_lengths, committed = [], []
            for b, r in enumerate(rows):
                before = len(r.tokens)
                committed.append(0)
                if not ctx.active[b]:
                    new_lengths.append(old_lengths[b])
                    continue
                r.stats.record_round(drafted[b], accepted[b])
                for token in emitted_rows[b]:
                    r.tokens.append(token)
                    reason = self._finish_reason(r, token, eos, max_new_tokens, max_len, stop)
                    if reason:
                        r.finish_reason = reason
                        ctx.active[b] = False
                        break
                new_lengths.append(len(r.tokens) - 1 if ctx.active[b] else old_lengths[b])
                committed[b] = len(r.tokens) - before
            self.cache.rollback(new_lengths)
            if policy is not None:
                live = [b for b in range(batch) if was_active[b]]
                policy.observe(int(ids.shape[1]) + 1, t2 - t1, [drafted[b] for b in live], [accepted[b] for b in live],
                               draft_seconds=(t1 - t0) if drafted_last and k > 0 else None)
            drafted_last = k > 0
            ctx.num_verified = drafted
            if self.wants_hidden:  # the states of the positions whose next token is now known
                self._hand_hidden(ctx, hidden, committed)
            self._call_drafter("on_verified", ctx, [a if d else 0 for a, d in zip(accepted, drafted)])
            t3 = timer.now()
            draft_time += (t1 - t0) + (t3 - t2)
            verify_time += t2 - t1

        total = timer.now() - start
        results = []
        for r in rows:
            s = r.stats
            s.new_tokens = len(r.new_tokens)
            s.prefill_time_s, s.draft_time_s, s.verify_time_s, s.total_time_s = prefill_time, draft_time, verify_time, total
            text = None
            if tokenizer is not None:
                text = tokenizer.decode(r.new_tokens, skip_special_tokens=True)
                hits = [i for i in (text.find(s_) for s_ in stop) if i >= 0] if r.finish_reason == "stop" else []
                if hits:  # the stop string itself is not part of the output text
                    text = text[: min(hits)]
            results.append(GenerationResult(token_ids=r.new_tokens, text=text, finish_reason=r.finish_reason, stats=s))
        return results

    def _finish_reason(self, row: _Row, token: int, eos: set[int], max_new_tokens: int, max_len: int,
                       stop: Sequence[str]) -> str | None:
        if token in eos:
            return "eos"
        if stop:
            window = max(len(s) for s in stop) + 4  # every token decodes to >= 1 character
            tail = self.target.tokenizer.decode(row.new_tokens[-window:], skip_special_tokens=True)
            if any(s in tail for s in stop):
                return "stop"
        if len(row.new_tokens) >= max_new_tokens or len(row.tokens) >= max_len:
            return "length"
        return None
