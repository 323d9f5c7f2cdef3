"""Drafters for tests of the verifier: they draft what the target itself would, nearly."""

from __future__ import annotations

from ..drafters.api import Drafter
from ..types import Draft


def last_logits(model, rows: list[list[int]]):
    """``model``'s logits after each row's last token, one forward per group of rows of equal
    length (a transformers model, no cache: tiny models only), in its dtype  # [batch, vocab]"""
    import torch

    out = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for b, ids in enumerate(rows):
        groups.setdefault(len(ids), []).append(b)
    with torch.no_grad():
        for members in groups.values():
            ids = torch.tensor([list(rows[b]) for b in members], device=model.device)
            logits = model(ids).logits[:, -1].cpu()
            for i, b in enumerate(members):
                out[b] = logits[i]
    return torch.stack(out)


class TargetDrafter(Drafter):
    """Drafts ``k`` tokens from the target's own logits times ``scale``, through the sampling
    pipeline with each position's context (``ctx.counts_after``), each row from its own
    generator: a draft distribution close to the target's but not equal to it, so drafts are
    accepted often and rejected at every position (rejection, the residual after it and the
    bonus token all get real traffic). ``one_hot=True`` drafts the most likely token of that
    distribution deterministically (``Draft.probs`` None, the one-hot path). Greedy rows draft
    the argmax of the scaled logits.

    It runs ``model`` (a transformers model) on every context, without a cache: tiny models only.
    """

    api_version = 2

    def __init__(self, model, scale: float = 0.5, one_hot: bool = False):
        super().__init__(None, None)
        self.model, self.scale, self.one_hot = model, scale, one_hot

    def propose(self, ctx, k):
        import torch

        from ..sampling import RowSampling, greedy_tokens, logits_to_probs, sample_rows

        rows = [list(t) for t in ctx.token_ids]
        drafted, dists = [], []
        params = ctx.sampling if isinstance(ctx.sampling, RowSampling) else RowSampling([ctx.sampling] * len(rows))
        for _ in range(k):
            logits = last_logits(self.model, rows) * self.scale  # [batch, vocab]
            counts = ctx.counts_after(drafted)
            if params.greedy or self.one_hot:
                tokens = greedy_tokens(logits, params, counts) if params.greedy else \
                    logits_to_probs(logits, params, counts).argmax(-1)
                probs = None
            else:
                probs = logits_to_probs(logits, params, counts)  # a greedy row's is its one-hot
                tokens = sample_rows(probs, ctx.generators or ctx.generator)
                dists.append(probs)
            drafted.append(tokens)
            for row, t in zip(rows, tokens.tolist()):
                row.append(t)
        if not drafted:
            return Draft.empty(len(rows))
        token_ids = torch.stack(drafted, 1).to(ctx.device)
        return Draft(token_ids=token_ids, probs=torch.stack(dists, 1).to(ctx.device) if dists else None)
