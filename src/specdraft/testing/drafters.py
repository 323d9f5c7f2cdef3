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


class TopTwoTree(Drafter):
    """Drafts a tree from the target's own unmasked logits: at each level the runner-up, then the
    argmax (the spine the next level hangs under), so an accepted path runs through the second
    child of each level (pass indices 2, 4, ...), and where a mask (``min_tokens``, a grammar)
    holds back the argmax, the masked argmax is often the runner-up: the walk must leave the
    spine for a sibling there. Runs ``model`` (transformers) without a cache: tiny models only."""

    api_version = 2

    def __init__(self, model):
        super().__init__(None, None)
        self.model = model

    def propose(self, ctx, k):
        import torch

        rows = [list(t) for t in ctx.token_ids]
        ids, parents, spine = [[] for _ in rows], [[] for _ in rows], [-1] * len(rows)
        for _ in range(k):
            top = last_logits(self.model, rows).topk(2, dim=-1).indices.tolist()
            for b, (first, second) in enumerate(top):
                ids[b] += [second, first]
                parents[b] += [spine[b], spine[b]]
                spine[b] = len(ids[b]) - 1
                rows[b].append(first)
        return Draft(token_ids=torch.tensor(ids), parents=torch.tensor(parents))


class RightThenWrong(Drafter):
    """Drafts the target's next ``right`` greedy tokens, then tokens its greedy choice is not (the
    greedy token plus one): a greedy round of ``k > right`` tokens accepts exactly ``right``
    (positions ``0 .. right - 1``), so acceptance counts are known in advance. Runs ``model``
    (transformers) without a cache: tiny models only."""

    api_version = 2

    def __init__(self, model, right: int = 1):
        super().__init__(None, None)
        self.model, self.right = model, right

    def propose(self, ctx, k):
        rows = []
        for tokens in ctx.token_ids:
            ids = list(tokens)
            for j in range(k):
                greedy = int(last_logits(self.model, [ids])[0].argmax())
                ids.append(greedy if j < self.right else (greedy + 1) % ctx.vocab_size)
            rows.append(ids[len(tokens):])
        return Draft.from_lists(rows)
