"""The verifier on its own: a stub runner returns chosen logits; no engine, no model.

Greedy cases are checked token for token; sampled ones against the target's law by a chi-square
test at ``specdraft.testing.SIGNIFICANCE`` (each row its own generator, so one batch is many
independent trials)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft import Draft
from specdraft.errors import DrafterError
from specdraft.sampling import RowSampling, SamplingParams
from specdraft.testing import SIGNIFICANCE, chi_square_pvalue
from specdraft.verifier import Verifier

VOCAB = 6
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


class StubRunner:
    """Returns ``logits[:, :W]`` for a pass of ``W`` tokens and records what it was asked to run."""

    supports_tree = True

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits  # [batch, positions, vocab]
        self.cache = SimpleNamespace(reserve=lambda *args, **kwargs: None)
        self.passes: list = []

    def forward(self, tokens, hidden=False, slots=None, **tree):
        self.passes.append((tokens.tolist(), slots, tree))
        return self.logits[:, : tokens.shape[1]], None


def argmax_logits(rows: list[list[int]], width: int) -> torch.Tensor:
    """Logits whose argmax at pass index ``j`` of row ``b`` is ``rows[b][j]``.  # [batch, width, VOCAB]"""
    logits = torch.zeros((len(rows), width, VOCAB))
    for b, tokens in enumerate(rows):
        for j, t in enumerate(tokens):
            logits[b, j, t] = 5.0
    return logits


def run(logits, draft, caps, sampling, generators=None, last=None):
    runner = StubRunner(logits)
    verifier = Verifier(runner, VOCAB, "cpu", who="'stub'")
    proposal = verifier.proposal(draft, caps)
    batch = len(caps)
    out, _ = verifier.verify(proposal, last or [0] * batch, list(range(batch)), longest=10)
    outcome = verifier.accept(proposal, out, RowSampling(sampling), generators or [None] * batch)
    return proposal, outcome, runner


def test_greedy_chain_full_acceptance_and_bonus_rejection_at_first_and_ragged_rows():
    # row 0: 3 drafts, all the target's argmax -> 3 accepted + bonus; row 1: its first draft is
    # wrong -> 0 accepted, the target's token; row 2: an empty draft -> a plain step
    draft = Draft.from_lists([[3, 4, 5], [2, 1], []])
    logits = argmax_logits([[3, 4, 5, 1], [1, 1, 1, 1], [4, 0, 0, 0]], 4)
    proposal, outcome, runner = run(logits, draft, [3, 3, 3], [GREEDY] * 3, last=[9 % VOCAB, 0, 2])
    assert proposal.tree is None and proposal.width == 3
    assert runner.passes[0][0] == [[3, 3, 4, 5], [0, 2, 1, 0], [2, 0, 0, 0]] and runner.passes[0][2] == {}
    assert outcome.num_accepted == [3, 0, 0] and outcome.next_token == [1, 1, 4]
    assert [outcome.committed(b) for b in range(3)] == [[3, 4, 5, 1], [1], [4]]
    assert outcome.drafted == [3, 2, 0] and outcome.depths == [3, 2, 0]
    assert outcome.paths == [[0, 1, 2], [], []] and not any(outcome.branched(b) for b in range(3))


def test_caps_cut_a_chain_and_an_empty_draft_is_a_plain_step():
    draft = Draft.from_lists([[3, 4, 5], [3, 4, 5]])
    logits = argmax_logits([[3, 4, 5, 1], [3, 4, 5, 2]], 4)
    proposal, outcome, _ = run(logits, draft, [3, 1], [GREEDY] * 2)  # row 1 may have one token verified
    assert proposal.width == 3 and proposal.lengths.tolist() == [3, 1]
    assert outcome.committed(0) == [3, 4, 5, 1] and outcome.committed(1) == [3, 4]
    proposal, outcome, runner = run(logits, None, [2, 2], [GREEDY] * 2)
    assert proposal.width == 0 and runner.passes[0][0] == [[0], [0]] and outcome.committed(1) == [3]


def test_greedy_tree_takes_the_branch_the_target_agrees_with():
    # nodes: 0 (token 1) and 1 (token 2) under the root, 2 (token 3) under node 1, 3 (token 4) under node 0
    draft = Draft.from_tree_lists([[(-1, 1), (-1, 2), (1, 3), (0, 4)]])
    # pass index j = node j - 1: the target wants 2 after the root, 3 after node 1, then 5
    logits = argmax_logits([[2, 0, 3, 5, 0]], 5)
    proposal, outcome, runner = run(logits, draft, [3], [GREEDY])
    assert proposal.tree is not None and proposal.tree.depths.tolist() == [[1, 1, 2, 2]]
    tokens, _, tree = runner.passes[0]
    assert tokens == [[0, 1, 2, 3, 4]] and tree["tree_mask"].shape == (1, 5, 5)
    assert tree["depths"].tolist() == [[0, 1, 1, 2, 2]]
    assert outcome.paths == [[1, 2]] and outcome.committed(0) == [2, 3, 5] and outcome.branched(0)
    assert outcome.drafted == [4] and outcome.depths == [2]


def test_a_tree_deeper_than_its_rows_cap_loses_its_deep_nodes():
    draft = Draft.from_tree_lists([[(-1, 1), (0, 2), (1, 3)]] * 2)
    logits = argmax_logits([[1, 2, 3, 4]] * 2, 4)
    proposal, outcome, _ = run(logits, draft, [2, 3], [GREEDY] * 2)
    assert proposal.lengths.tolist() == [2, 3]
    assert outcome.committed(0) == [1, 2, 3] and outcome.committed(1) == [1, 2, 3, 4]


def test_a_bad_draft_is_reported_naming_the_drafter():
    with pytest.raises(DrafterError, match="'stub' returned an invalid draft: token ids must lie in"):
        run(argmax_logits([[0, 0]], 2), Draft.from_lists([[VOCAB]]), [1], [GREEDY])


def _law(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_sampled_chain_follows_the_target_law_with_and_without_draft_probabilities():
    n = 3000
    target_0 = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])  # the target's law at the first position
    target_1 = torch.tensor([0.3, 0.0, 0.3, 0.0, 0.4, 0.0])  # and after its first draft
    logits = torch.stack([target_0.log(), target_1.log(), torch.zeros(VOCAB)])[None].expand(n, -1, -1)
    draft_law = torch.tensor([0.4, 0.0, 0.1, 0.1, 0.1, 0.3])
    gen = torch.Generator().manual_seed(0)
    first = torch.multinomial(draft_law.expand(n, -1), 1, generator=gen)  # [n, 1] drawn from the draft's law
    cases = {"one-hot": Draft(token_ids=torch.full((n, 1), 5)),
             "draft probs": Draft(token_ids=first, probs=draft_law.expand(n, 1, -1).clone())}
    for name, draft in cases.items():
        generators = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
        _, outcome, _ = run(logits, draft, [1] * n, [SAMPLED] * n, generators)
        # cells: the first token alone (rejected) or with the token after it (accepted)
        counts = torch.zeros(VOCAB, VOCAB + 1)
        for b in range(n):
            out = outcome.committed(b)
            counts[out[0], out[1] if len(out) > 1 else VOCAB] += 1
        drafted = draft.token_ids[:, 0]
        # accepted rows hold the drafted token; the law of the pair is target_0 x target_1 on the accepted
        # and target_0 alone on the rejected, summed over which rows drafted what
        expected = torch.zeros(VOCAB, VOCAB + 1)
        q = draft_law if name == "draft probs" else torch.nn.functional.one_hot(torch.tensor(5), VOCAB).float()
        for x in range(VOCAB):
            accept_x = torch.minimum(q[x], target_0[x])  # P(draft x and accept it)
            expected[x, :VOCAB] += accept_x * target_1
            expected[x, VOCAB] += target_0[x] - accept_x
        assert chi_square_pvalue(counts, expected / expected.sum()) > SIGNIFICANCE, name
        assert all(outcome.num_accepted[b] == 0 or outcome.tokens[b] == [int(drafted[b])] for b in range(n))


def test_sampled_tree_follows_the_target_law():
    n = 3000
    target_0 = torch.tensor([0.1, 0.25, 0.05, 0.3, 0.2, 0.1])
    logits = torch.stack([target_0.log(), torch.zeros(VOCAB), torch.zeros(VOCAB)])[None].expand(n, -1, -1)
    draft = Draft.from_tree_lists([[(-1, 1), (-1, 3)]] * n)  # two deterministic children of the root
    generators = [torch.Generator().manual_seed(7000 + i) for i in range(n)]
    _, outcome, _ = run(logits, draft, [1] * n, [SAMPLED] * n, generators)
    first = torch.tensor([outcome.committed(b)[0] for b in range(n)])
    assert chi_square_pvalue(torch.bincount(first, minlength=VOCAB), target_0) > SIGNIFICANCE
    for b in range(n):  # an accepted node is the child holding the first token
        assert outcome.paths[b] == {1: [0], 3: [1]}.get(int(first[b]), [])


def test_every_verify_pass_fits_the_decode_kernels():
    """A verify pass wider than DECODE_WIDTH runs prefill's attention (SDPA), whose rounding is not
    a one-token step's, so speculation there would not be exact: the widest draft of every source
    (a chain, a tree, a prediction) plus the row's last token must fit. Predictions of 32 tokens
    (33-token passes) changed greedy bfloat16 output of the default model."""
    from specdraft.drafters.common.tree import MAX_TREE_BUDGET
    from specdraft.limits import MAX_SPEC_LENGTH
    from specdraft.runner.model import CUDA_DECODE_WIDTH, DECODE_WIDTH
    from specdraft.verifier.prediction import MAX_PREDICTED

    widest = max(MAX_SPEC_LENGTH, MAX_TREE_BUDGET, MAX_PREDICTED) + 1
    assert widest <= DECODE_WIDTH <= CUDA_DECODE_WIDTH
