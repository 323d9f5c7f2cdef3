"""How many tokens to verify next round: expected tokens per unit of verify cost.

Every drafter benefits: the verifier asks for ``k`` tokens where ``k`` maximises

    score(k) = E[tokens | k] / (k d + c(k + 1)),   E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a_i

with ``a_i`` the acceptance rate of draft position ``i`` given that positions before it
were accepted, ``c(n)`` the cost of an ``n``-token verify pass relative to a 1-token pass,
and ``d`` the cost of drafting one token in the same unit (next to nothing for n-gram
tables, a forward pass for a draft model). ``k = 0`` (a plain step, score 1) wins unless
some ``k`` is expected to be at least ``min_gain`` (5%) better: a round has costs no
estimate captures exactly, and a gain of a percent or two is within their noise, so a
drafter whose guesses are rarely accepted costs (almost) nothing.

Both estimates are learnt online, relative to a plain step's time, which a new policy times
first (:meth:`AdaptiveDraftLength._time_plain_step`). Acceptance counts decay every round
towards a prior (weighted like half an observation, so it steers exploration without biasing a
settled estimate: 0.6 for the first position, the estimate of the one before for the others),
and a draft position tested fewer than three times is read as at least its prior, so one
unlucky first draft does not stop a drafter for long (that cost a draft accepted 40% of the
time most of its drafting). The counts are the engine's (one policy per batch-size bucket),
carried from request to request. So
a policy that stopped drafting tries again after a while and notices when acceptance
comes back (for instance when the output starts copying the prompt). How soon depends on
what a retry costs: drafting a token (a forward pass for a draft model, next to nothing for
an n-gram table) plus the wider verify pass. A retry costing n times ``explore_budget``
(4% of a step) makes plain rounds decay the counts at the n-th root of the usual rate, so it
comes about n times less often. (A draft model also catches up on the tokens the plain steps
emitted; that costs about the same per paused token however long the pause, so it does not
enter the choice.) Costs are measured
per width as the median of the last few passes of that width, so one slow pass (a cache
growing, a kernel being chosen, another process) cannot switch drafting off for good. A
width measured fewer than three times is read optimistically (:meth:`~AdaptiveDraftLength.relative_cost`),
so it gets tried until it is known. A
measurement older than ``STALE`` rounds counts as none and is taken again when next used:
costs measured while another process loaded the machine once made every verify width look
dear for good, and a long-running process never drafted again.
With ``measure_costs=False`` (seeded sampling) only the prior cost curve is used, which
keeps the draft lengths, and so the output, a function of the seed alone.

Tree drafters (``tree_budget`` > 1) also get a node budget per round (:meth:`choose_budget`):
1 (a chain of ``k``) or a power of two up to the drafter's budget, whichever gives the most
tokens per round for the cost of its verify width (the median width its rounds really had: a
drafter that prunes doubted nodes verifies fewer than ``budget + 1`` tokens; measured as above):
on this CPU a 17-token pass costs far more than a 5-token one, on a GPU about the same. Tokens
per round are the median of each budget's last rounds; a budget tried fewer than
``TRUSTED`` times, or not for ``STALE`` rounds, is tried next.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Sequence


class AdaptiveDraftLength:
    #: a width's cost is trusted once measured this many times
    TRUSTED = 3
    #: rounds after which a width's (or drafting's) last measurement is too old to trust: it is
    #: measured afresh when next used, and read optimistically until then
    STALE = 256

    def __init__(self, max_k: int, prior: float = 0.6, prior_weight: float = 0.5, decay: float = 0.9,
                 cost_window: int = 5, prior_cost_slope: float = 0.1, measure_costs: bool = True,
                 min_gain: float = 0.05, explore_budget: float = 0.04, time_plain: bool = True) -> None:
        self.max_k = max_k
        #: whether to make plain steps to time one (:meth:`_time_plain_step`); a request's
        #: prediction has a policy of its own, made per request, that does not (it would give up
        #: the first rounds of every prediction, and predicted drafts cost nothing to make)
        self.time_plain = time_plain
        self._plain_asked = 0  # plain steps asked for in a row that no 1-token pass followed
        self.min_gain, self.explore_budget = min_gain, explore_budget
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.cost_window, self.prior_cost_slope = cost_window, prior_cost_slope
        self.measure_costs = measure_costs
        self.accepted = [0.0] * max_k  # decayed count of acceptances at position i
        self.reached = [0.0] * max_k  # decayed count of rounds that tested position i
        self.tested = [0] * max_k  # rounds that tested position i (not decayed)
        self.seconds: dict[int, deque[float]] = {}  # verify width -> wall times of its last passes
        # drafting time per drafted token, last rounds; the median ignores one-off catch-ups
        self.draft_seconds: deque[float] = deque(maxlen=9)
        self.rounds = 0  # rounds observed (the policy's clock)
        self.measured_at: dict[int | str, int] = {}  # width, or "draft" -> round of its last measurement
        self.budget_tokens: dict[int, deque[float]] = {}  # tree budget -> tokens per round, last rounds
        self.budget_at: dict[int, int] = {}  # tree budget -> round it was last used
        self.budget_widths: dict[int, deque[int]] = {}  # tree budget -> its verify passes' widths, last rounds

    def reset_acceptance(self) -> None:
        """Forget acceptance statistics (kept costs are still valid)."""
        self.accepted = [0.0] * self.max_k
        self.reached = [0.0] * self.max_k
        self.tested = [0] * self.max_k

    def acceptance(self, i: int) -> float:
        """Estimated P(position i accepted | positions < i accepted), i from 0.

        Each position's counts lean on a prior of half an observation: ``prior`` for the first,
        the estimate of the position before it for the others (a position rarely reached, or not
        for a while, reads like its neighbour rather than like a fixed 0.6: in simulation
        (:mod:`specdraft.testing.policy`) a drafter accepted 90% of the time that had settled on 3
        tokens read the 4th at 0.6 and never tried it). Read optimistically (at least that prior)
        until the position has been tested ``TRUSTED`` times: one rejected first draft says little
        about a drafter accepted 40% of the time, and believed at once it stops drafting for long.
        """
        return self.acceptances(i + 1)[i]

    def acceptances(self, n: int) -> list[float]:
        """:meth:`acceptance` of positions ``0 .. n - 1``, in one pass."""
        out, prior = [], self.prior
        for i in range(n):
            estimate = (self.accepted[i] + prior * self.prior_weight) / (self.reached[i] + self.prior_weight)
            prior = estimate if self.tested[i] >= self.TRUSTED else max(estimate, prior)
            out.append(prior)
        return out

    def relative_cost(self, width: int) -> float:
        """Cost of a ``width``-token verify pass in units of a 1-token pass.

        Read as non-decreasing in width (and >= 1): timing noise can make a wider pass look
        cheaper than a narrower one, which would make drafting look free. A width timed fewer
        than ``TRUSTED`` times is read optimistically, so that it gets tried until it is known:
        the least of its own times, the prior ``1 + 0.1 (n - 1)``, the nearest known narrower
        width's cost plus the prior's slope per token, and any known wider width's cost (a
        wider pass never costs less). Read at the prior alone, a width the policy had not tried
        could look dearer than it is for good: on a GPU, where a 5-token pass costs about a
        1-token one, a policy that had settled on 3 tokens never tried 4.
        """
        return self.relative_costs(width)[-1]

    def relative_costs(self, n: int) -> list[float]:
        """:meth:`relative_cost` of widths ``1 .. n``, in one pass."""
        one, slope = self._seconds(1), self.prior_cost_slope
        if not (self.measure_costs and one):
            return [1.0 + slope * (w - 1) for w in range(1, n + 1)]
        times = {w: t for w, t in self.seconds.items() if w > 1 and not self._stale(w)}
        known = {w: median(t) / one for w, t in times.items() if len(t) >= self.TRUSTED}
        out, cost, below, below_cost = [1.0], 1.0, 1, 1.0
        for w in range(2, n + 1):
            if w in known:
                cost = max(cost, known[w])
                below, below_cost = w, cost
            else:
                cost = max(cost, min([1.0 + slope * (w - 1), below_cost + slope * (w - below),
                                      *(t / one for t in times.get(w, ())), *(c for v, c in known.items() if v > w)]))
            out.append(cost)
        return out

    def _stale(self, what: int | str) -> bool:
        return what in self.measured_at and self.rounds - self.measured_at[what] > self.STALE

    def _seconds(self, width: int) -> float | None:
        times = self.seconds.get(width)
        return median(times) if times else None

    def draft_cost(self) -> float:
        """Cost of drafting one token, in units of a 1-token verify pass."""
        one = self._seconds(1)
        if self.measure_costs and self.draft_seconds and one and not self._stale("draft"):
            return median(self.draft_seconds) / one
        return 0.0

    def idle_decay(self) -> float:
        """How much a plain round decays the acceptance counts: ``decay`` when a retry costs at
        most ``explore_budget`` of a step, proportionally closer to 1 the more it costs."""
        if not self.measure_costs:
            return self.decay
        retry = self.draft_cost() + self.relative_cost(2) - 1.0  # in 1-token passes
        return self.decay ** (1.0 / max(1.0, retry / self.explore_budget))

    def choose(self, cap: int | None = None) -> int:
        """The draft length with the best expected tokens per unit cost (0 = plain step, which a
        draft must beat by ``min_gain``; see :meth:`_time_plain_step` for the rounds that time one)."""
        if self._time_plain_step():
            self._plain_asked += 1
            return 0
        cap = self.max_k if cap is None else min(cap, self.max_k)
        costs, acceptance = self.relative_costs(cap + 1), self.acceptances(cap)
        best_k, best = 0, (1.0 + self.min_gain) / costs[0]
        expected, survive, per_draft = 1.0, 1.0, self.draft_cost()
        for k in range(1, cap + 1):
            survive *= acceptance[k - 1]
            expected += survive
            score = expected / (k * per_draft + costs[k])
            if score > best:
                best_k, best = k, score
        return best_k

    def _time_plain_step(self) -> bool:
        """Whether this round is a plain step to time one. Every cost is relative to a plain
        step's, and a drafter that always drafts never times one: its verify widths and its
        drafting were read at the prior for good (drafting free, an n-token pass 1 + 0.1 (n - 1)):
        in simulation (:mod:`specdraft.testing.policy`) a draft model costing 0.3 of a step per
        token, accepted half the time, kept drafting at 0.80x plain. So a new policy's first
        ``TRUSTED`` rounds are plain steps, and so are ``TRUSTED`` again when the last was timed
        ``STALE`` rounds ago (at most 3 in 256 rounds: a drafter that doubles the speed loses
        about 0.6% to them). Not where costs are not measured, nor after the pass was wider
        anyway (another row's prediction widened it) ``2 * TRUSTED`` times in a row."""
        if not (self.measure_costs and self.time_plain) or self._plain_asked >= 2 * self.TRUSTED:
            return False
        return self._stale(1) or len(self.seconds.get(1, ())) < self.TRUSTED

    def choose_budget(self, most: int, k: int) -> int:
        """The tree budget for a round drafting ``k`` levels: 1 (a chain) or a power of two up to
        ``most``, by tokens per round over the relative cost of its verify pass (and drafting)."""
        candidates = [1] + [b for b in (2 ** i for i in range(1, 8)) if b < most] + [most]
        for budget in candidates:  # each is tried until its figure is trusted, and again when stale
            tried = self.budget_tokens.get(budget, ())
            if len(tried) < self.TRUSTED or self.rounds - self.budget_at.get(budget, self.rounds) > self.STALE:
                return budget
        per_draft = self.draft_cost()

        def score(budget: int) -> float:  # priced at the width its trees really had (pruned ones are narrower)
            width = round(median(self.budget_widths[budget]))
            return median(self.budget_tokens[budget]) / (k * per_draft + self.relative_cost(width))

        return max(candidates, key=score)

    def observe(self, width: int, seconds: float, drafted: Sequence[int], accepted: Sequence[int],
                draft_seconds: float | None = None, budget: int | None = None) -> None:
        """Record one round: a verify pass of ``width`` tokens taking ``seconds``, per-row drafted
        and accepted counts, and the time spent drafting (``width - 1`` tokens; None = not a
        sample of the per-token cost, as for a round whose drafter prefilled the prompt or
        caught up on tokens emitted by plain steps). ``drafted`` counts a tree's levels; ``budget``:
        the round's tree budget (None: not a tree round)."""
        self.rounds += 1
        if budget is not None and any(drafted):
            tokens = [a + 1 for d, a in zip(drafted, accepted) if d]
            self.budget_tokens.setdefault(budget, deque(maxlen=2 * self.cost_window)).append(sum(tokens) / len(tokens))
            self.budget_widths.setdefault(budget, deque(maxlen=2 * self.cost_window)).append(width)
            self.budget_at[budget] = self.rounds
        times = self.seconds.setdefault(width, deque(maxlen=self.cost_window))
        if self._stale(width):  # measured under other conditions (another process, say): start over
            times.clear()
        times.append(seconds)
        if width == 1:
            self._plain_asked = 0
        self.measured_at[width] = self.rounds
        if width > 1 and draft_seconds is not None:
            if self._stale("draft"):
                self.draft_seconds.clear()
            self.draft_seconds.append(draft_seconds / (width - 1))
            self.measured_at["draft"] = self.rounds
        decay = self.decay if width > 1 else self.idle_decay()
        self.accepted = [a * decay for a in self.accepted]
        self.reached = [r * decay for r in self.reached]
        for d, a in zip(drafted, accepted):
            for i in range(min(a + 1, d, self.max_k)):  # positions tested: up to the first rejection
                self.reached[i] += 1.0
                self.tested[i] += 1
                if i < a:
                    self.accepted[i] += 1.0
