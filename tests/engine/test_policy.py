"""The draft-length policy as a pure unit."""

from __future__ import annotations

import pytest

from specdraft.engine.policy import AdaptiveDraftLength
from specdraft.testing.policy import COSTS, best_fixed, simulate


def _plain_steps(policy, seconds=1.0):
    """The plain steps a new policy asks for first, timed."""
    for _ in range(policy.TRUSTED):
        policy.observe(1, seconds, [0], [0])
    return policy


def _observe(policy, rounds, drafted, accepted, width_seconds):
    for width, seconds in width_seconds.items():  # every width measured once, nothing drafted
        policy.observe(width, seconds, [], [])
    for _ in range(rounds):
        width = drafted + 1
        policy.observe(width, width_seconds.get(width, 1.0), [drafted], [accepted])


def test_a_new_policy_times_plain_steps_then_the_prior_drafts():
    policy = AdaptiveDraftLength(4)
    for _ in range(policy.TRUSTED):
        assert policy.choose() == 0
        policy.observe(1, 1.0, [0], [0])
    assert policy.choose() >= 1
    assert AdaptiveDraftLength(4, measure_costs=False).choose() >= 1  # seeded sampling: the prior at once


def test_high_acceptance_and_flat_costs_draft_the_maximum():
    policy = _plain_steps(AdaptiveDraftLength(6))
    costs = {n: 1.0 for n in range(1, 8)}
    _observe(policy, 30, 6, 6, costs)
    assert policy.choose() == 6
    assert policy.acceptance(0) > 0.9


def test_low_acceptance_and_expensive_width_means_plain_steps():
    policy = AdaptiveDraftLength(4)
    costs = {1: 1.0, 2: 1.4, 3: 1.8, 4: 2.2, 5: 2.6}
    policy.observe(1, 1.0, [0], [0])
    _observe(policy, 30, 4, 0, costs)
    assert policy.choose() == 0


def test_cheap_first_token_is_worth_drafting_even_at_modest_acceptance():
    policy = AdaptiveDraftLength(4)
    costs = {1: 1.0, 2: 1.02, 3: 1.5, 4: 1.8, 5: 2.1}
    _plain_steps(policy)
    policy.observe(3, 1.5, [2], [0])  # measure widths 2.. too
    policy.observe(4, 1.8, [3], [0])
    policy.observe(5, 2.1, [4], [0])
    _observe(policy, 30, 1, 0, costs)  # reset nothing: ~30% accepted below
    for i in range(30):
        policy.observe(2, 1.02, [1], [1 if i % 3 == 0 else 0])
    assert policy.choose() == 1


def test_stopped_policy_tries_again_after_a_while():
    policy = AdaptiveDraftLength(4, measure_costs=False, prior_cost_slope=0.3)
    _observe(policy, 20, 4, 0, {})
    assert policy.choose() == 0
    for _ in range(40):  # plain rounds: counts decay towards the prior
        policy.observe(1, 1.0, [0], [0])
    assert policy.choose() >= 1


def test_unmeasured_costs_use_the_prior_and_measure_costs_false_ignores_timings():
    policy = AdaptiveDraftLength(4, measure_costs=False)
    policy.observe(1, 1.0, [0], [0])
    for _ in range(3):
        policy.observe(2, 100.0, [1], [1])
    assert policy.relative_cost(2) == 1.1
    policy.measure_costs = True
    assert policy.relative_cost(2) == 100.0
    for _ in range(3):
        policy.observe(3, 0.5, [], [])  # noise: a wider pass measured cheaper than a 1-token pass
    assert policy.relative_cost(3) == 100.0  # costs are read as non-decreasing in width


def test_one_slow_pass_does_not_switch_drafting_off():
    """A width's first pass can be slow for reasons of its own (a kernel being chosen, a cache
    growing). Believed at once, it would stop the policy from ever trying that width again."""
    policy = AdaptiveDraftLength(4)
    for _ in range(5):
        policy.observe(1, 1.0, [], [])
    policy.observe(2, 4.0, [1], [1])  # cold
    assert policy.relative_cost(2) == pytest.approx(1.1)  # not yet trusted: the prior
    assert policy.choose() >= 1
    for _ in range(4):
        policy.observe(2, 1.05, [1], [1])
    assert policy.relative_cost(2) == pytest.approx(1.05)  # the median of the last passes
    for _ in range(3):
        policy.observe(2, 3.0, [1], [1])
    assert policy.relative_cost(2) == pytest.approx(3.0)  # a lasting change is believed


def test_a_weak_expensive_drafter_is_switched_off():
    """Drafting costs 0.1 step per token and 10% of first drafts are accepted: plain steps win."""
    policy = AdaptiveDraftLength(4)
    policy.observe(1, 1.0, [], [])
    for i in range(40):
        policy.observe(2, 1.0, [1], [1 if i % 10 == 0 else 0], draft_seconds=0.1)
    assert policy.choose() == 0


def test_expensive_drafting_shortens_drafts():
    cheap, costly = AdaptiveDraftLength(4), AdaptiveDraftLength(4)
    for policy, per_token in ((cheap, 0.0), (costly, 1.5)):
        _plain_steps(policy)
        for width in range(2, 6):  # flat verify costs
            policy.observe(width, 1.0, [], [])
        for _ in range(20):
            policy.observe(5, 1.0, [4], [4], draft_seconds=per_token * 4)
    assert costly.draft_cost() == pytest.approx(1.5, rel=0.01)
    costly.observe(5, 1.0, [4], [4], draft_seconds=400.0)  # a one-off catch-up does not move the median
    assert costly.draft_cost() == pytest.approx(1.5, rel=0.01)
    costly.observe(5, 1.0, [4], [4], draft_seconds=None)  # not measured (a request's first round)
    assert len(costly.draft_seconds) == 9
    assert cheap.choose() == 4
    assert costly.choose() < cheap.choose()




def test_a_gain_within_noise_is_not_worth_a_draft():
    """Free verify width and ~3% first-position acceptance: expected 1.03 tokens a round, not
    enough to pay for the costs no estimate captures (min_gain = 5%)."""
    policy = AdaptiveDraftLength(1)
    for _ in range(5):
        for width in (1, 2):
            policy.observe(width, 1.0, [], [])
    for i in range(100):
        policy.observe(2, 1.0, [1], [0])
    assert 0.02 < policy.acceptance(0) < 0.04  # the prior's pull
    assert policy.choose() == 0
    assert _plain_steps(AdaptiveDraftLength(1, min_gain=0.0)).choose() == 1


def _plain_rounds_until_retry(policy, limit=500):
    for n in range(1, limit):
        policy.observe(1, 1.0, [0], [0])
        if policy.choose() >= 1:
            return n
    return limit


def _failed_policy(seconds_per_draft):
    policy = AdaptiveDraftLength(2)
    policy.observe(1, 1.0, [0], [0])
    for _ in range(6):
        policy.observe(2, 1.04, [1], [0], draft_seconds=seconds_per_draft)
        policy.observe(3, 1.1, [2], [0], draft_seconds=2 * seconds_per_draft)
    assert policy.choose() == 0  # nothing was ever accepted
    return policy


def test_retry_interval_follows_the_cost_of_a_retry():
    """A drafter that drafts for free (n-gram) retries after a few plain rounds; one whose draft
    costs half a step (a draft model) waits long enough that exploring stays cheap."""
    cheap, costly = _failed_policy(0.0), _failed_policy(0.5)
    assert cheap.idle_decay() == pytest.approx(cheap.decay)  # a retry costs the budget: the usual rate
    retry_cost = 0.5 + 0.04  # one drafted token + the wider verify pass, in 1-token passes
    assert costly.idle_decay() == pytest.approx(costly.decay ** (costly.explore_budget / retry_cost))
    waited_cheap, waited_costly = _plain_rounds_until_retry(cheap), _plain_rounds_until_retry(costly)
    assert waited_cheap <= 30 and waited_costly >= 8 * waited_cheap


def test_seeded_policy_retries_on_the_prior_schedule():
    """Without measured costs (seeded sampling) plain rounds decay at the fixed rate."""
    policy = AdaptiveDraftLength(2, measure_costs=False)
    policy.observe(1, 1.0, [0], [0])
    policy.observe(2, 1.0, [1], [0], draft_seconds=5.0)
    assert policy.idle_decay() == policy.decay


def test_one_rejected_first_draft_does_not_stop_drafting_three_do():
    """A position is read as at least the prior until tested three times in a request: a drafter
    accepted 40% of the time fails its first draft 60% of the time, and believing that one
    failure would stop it for most of the request."""
    policy = AdaptiveDraftLength(1)
    for width in (1, 2):
        for _ in range(3):
            policy.observe(width, 1.0 + 0.1 * (width - 1), [], [])
    for attempt in range(3):
        assert policy.choose() == 1, attempt
        policy.observe(2, 1.1, [1], [0], draft_seconds=0.15)
    assert policy.choose() == 0  # three rejections: now the evidence is believed
    policy.reset_acceptance()  # a new request starts optimistic again
    assert policy.choose() == 1


def test_costs_measured_under_load_are_measured_again_later():
    """Verify widths and drafting timed while the machine was busy look dear; a policy that
    trusted them for good would never draft again. Old measurements count as none."""
    policy = AdaptiveDraftLength(2)
    for _ in range(5):
        policy.observe(1, 1.0, [], [])
        policy.observe(2, 3.0, [1], [1], draft_seconds=2.0)  # a burst of load
        policy.observe(3, 3.5, [2], [2], draft_seconds=4.0)
    assert policy.choose() == 0
    for _ in range(policy.STALE + 1):  # plain steps only: the dear widths are never re-timed
        policy.observe(1, 1.0, [0], [0])
    assert policy.draft_cost() == 0.0 and policy.relative_cost(2) == pytest.approx(1.1)
    assert policy.choose() >= 1
    policy.observe(2, 1.02, [1], [1], draft_seconds=0.05)  # measured afresh, old samples dropped
    assert list(policy.seconds[2]) == [1.02] and list(policy.draft_seconds) == [0.05]


def _tree_rounds(policy, k, budgets, tokens, widths, seconds):
    """Rounds of ten rows at each budget until the policy trusts them: ``tokens[b]`` per round on
    average, verify passes ``widths[b]`` wide taking ``seconds(width)``."""
    for width in range(1, max(widths.values()) + 1):  # every width's cost known (else the prior curve)
        for _ in range(policy.TRUSTED):
            policy.observe(width, seconds(width), [], [])
    for _ in range(policy.TRUSTED):
        for budget in budgets:
            assert policy.choose_budget(max(budgets), k) in budgets
            total = round((tokens[budget] - 1) * 10)  # accepted tokens over the ten rows
            accepted = [total // 10 + (i < total % 10) for i in range(10)]
            policy.observe(widths[budget], seconds(widths[budget]), [k] * 10, accepted, budget=budget)


@pytest.mark.parametrize("slope, expected", [
    (0.0, 16),  # wide passes cost nothing (a GPU): the tree's extra tokens win
    (0.25, 1),  # a 17-token pass costs 5 one-token passes (a slow CPU): the chain wins
])
def test_tree_budget_follows_the_cost_of_width(slope, expected):
    policy = AdaptiveDraftLength(4)
    budgets = [1, 2, 4, 8, 16]
    tokens = {1: 2.0, 2: 1.4, 4: 1.9, 8: 2.4, 16: 2.9}
    widths = {1: 5, 2: 3, 4: 5, 8: 9, 16: 17}
    _tree_rounds(policy, 4, budgets, tokens, widths, lambda w: 1.0 + slope * (w - 1))
    assert policy.choose_budget(16, 4) == expected


def test_a_pruned_tree_is_priced_at_the_width_it_had():
    """A budget of 16 whose trees had 4 nodes (a drafter dropping doubted nodes) costs a 5-token
    pass, not a 17-token one: with the same tokens per round as the chain's and a cheaper pass, it wins."""
    policy = AdaptiveDraftLength(4)
    budgets = [1, 2, 4, 8, 16]
    tokens = {1: 2.0, 2: 1.4, 4: 1.9, 8: 2.0, 16: 2.4}
    widths = {1: 5, 2: 3, 4: 5, 8: 5, 16: 5}
    _tree_rounds(policy, 4, budgets, tokens, widths, lambda w: 1.0 + 0.25 * (w - 1))
    assert policy.choose_budget(16, 4) == 16


def test_a_drafter_that_always_drafts_is_held_to_the_cost_of_a_plain_step():
    """A drafter that always drafts never timed a plain step, so its costs were read at the prior
    for good (drafting free, an n-token pass 1 + 0.1 (n - 1)): a draft model costing 0.3 of a step
    per token, accepted half the time, on a CPU where every token of a pass costs a quarter of a
    step, ran at 0.80x plain decoding in this simulation. Now the policy times plain steps first
    and stops drafting where it loses."""
    policy = AdaptiveDraftLength(4)
    speedup = simulate(policy, [0.5], COSTS["slow"], 0.3)
    assert policy.relative_cost(2) == pytest.approx(1.25) and policy.draft_cost() == pytest.approx(0.3)
    assert speedup >= 0.98


def test_a_pass_widened_by_other_rows_does_not_hold_drafting_back():
    """A plain step asked for is not timed when another row's prediction widens the pass; after
    2 * TRUSTED such rounds in a row the policy drafts on its prior."""
    policy = AdaptiveDraftLength(4)
    for _ in range(2 * policy.TRUSTED):
        assert policy.choose() == 0
        policy.observe(3, 1.2, [0], [0])  # the pass had predicted tokens of another row
    assert policy.choose() >= 1


def test_a_plain_step_is_timed_again_when_the_last_is_stale():
    policy = _plain_steps(AdaptiveDraftLength(2))
    for _ in range(policy.STALE + 1):
        assert policy.choose() >= 1
        policy.observe(3, 1.1, [2], [2])
    for _ in range(policy.TRUSTED):  # plain steps timed afresh, then drafting again
        assert policy.choose() == 0
        policy.observe(1, 1.0, [0], [0])
    assert policy.choose() >= 1


def test_an_untried_width_is_read_from_its_known_neighbours():
    """On a GPU a 4-token pass measured 1.06 steps: the untried 5-token pass reads 1.16 (the
    known narrower width plus the prior's slope), not the prior's 1.4, and the untried narrower
    widths no more than the known wider one. Read at the prior, a policy that had settled on 3
    drafted tokens never tried 4."""
    policy = _plain_steps(AdaptiveDraftLength(4))
    for _ in range(policy.TRUSTED):
        policy.observe(4, 1.06, [3], [3])
    assert policy.relative_cost(5) == pytest.approx(1.16)
    assert policy.relative_cost(2) == pytest.approx(1.06) and policy.relative_cost(3) == pytest.approx(1.06)
    policy.observe(5, 1.08, [4], [4])  # one time of its own, and cheaper: read as that
    assert policy.relative_cost(5) == pytest.approx(1.08)


def test_a_position_rarely_reached_reads_like_the_one_before_it():
    """A drafter accepted 30% of the time seldom reaches its 4th position; read at the fixed prior
    (0.6) it promised 4-token drafts more than they gave."""
    policy = _plain_steps(AdaptiveDraftLength(4))
    for i in range(30):
        policy.observe(5, 1.3, [4], [1 if i % 3 == 0 else 0])
    assert policy.acceptance(0) < 0.4
    assert policy.acceptance(1) < 0.5 and policy.acceptance(3) < 0.5


REGIMES = [(cost, draft, level) for cost in COSTS for draft in (0.0, 0.05, 0.3) for level in (0.1, 0.3, 0.5, 0.7, 0.9)]


def test_the_policy_is_never_slower_than_plain_decoding_and_near_the_best_fixed_length():
    """45 simulated drafters (three cost curves, drafting free to 0.3 of a step per token,
    acceptance 0.1 to 0.9; seeded): the policy's speedup is never below 0.97x plain decoding
    (speculation slower than plain is a bug), and on average at least 0.92 of what the best
    fixed draft length for that drafter gets (which the policy does not know)."""
    ratios = []
    for cost, draft, level in REGIMES:
        speedup = simulate(AdaptiveDraftLength(4), [level], COSTS[cost], draft, rounds=1000)
        assert speedup >= 0.97, (cost, draft, level, speedup)
        ratios.append(speedup / best_fixed(level, COSTS[cost], draft))
    assert sum(ratios) / len(ratios) >= 0.92
