"""Bench arithmetic as pure functions over run records (unit-tested on synthetic data).

Definitions, per method and category (and ``overall`` = all prompts together):

* ``tokens_per_second`` = sum of new tokens / sum of wall times;
* ``speedup`` = tokens_per_second / plain's tokens_per_second on the same prompts -- at
  temperature 0 the token counts are equal, so this is the ratio of summed times;
* ``acceptance_rate`` = accepted / drafted tokens; ``acceptance_by_position[i]`` the same
  for draft position i; ``tokens_per_pass`` = new tokens / target passes;
* ``time_split``: drafting, verifying and everything else (prefill, bookkeeping), as
  fractions of the total;
* ``theoretical_speedup`` = E / C with E = (1 - a^(K+1)) / (1 - a) the expected tokens per
  round for the measured acceptance ``a`` and mean draft length ``K``, and C the measured
  cost of a round (drafting + verifying) in units of plain decoding's measured step time;
  ``efficiency`` = speedup / theoretical_speedup shows what overheads outside the rounds
  and correlated (non-i.i.d.) acceptance cost;
* ``mismatches``: prompts whose greedy output differs from plain decoding's (must be 0).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable

PLAIN = "plain"


@dataclass
class RunRecord:
    """One method on one prompt."""

    method: str
    question_id: int
    category: str
    new_tokens: int
    time_s: float
    token_ids: list[int] = field(default_factory=list)
    drafted: int | None = None  # None for peers that do not report it
    accepted: int | None = None
    target_passes: int | None = None
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    drafts: int | None = None  # rounds that drafted

    def to_dict(self) -> dict:
        return asdict(self)


def expected_tokens_per_round(acceptance: float, k: float) -> float:
    """(1 - a^(k+1)) / (1 - a): expected tokens per target pass for i.i.d. acceptance a."""
    if k <= 0:
        return 1.0
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1.0)) / (1.0 - acceptance)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(records: Iterable[RunRecord]) -> dict:
    """``{method: {category: metrics, ..., "overall": metrics}}`` (see the module docstring)."""
    groups: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    plain_ids: dict[int, list[int]] = {}
    records = list(records)
    for r in records:
        groups[(r.method, r.category)].append(r)
        groups[(r.method, "overall")].append(r)
        if r.method == PLAIN:
            plain_ids[r.question_id] = r.token_ids
    out: dict[str, dict] = defaultdict(dict)
    for (method, category), rs in groups.items():
        out[method][category] = _metrics(rs, groups.get((PLAIN, category), []), plain_ids)
    return {m: dict(sorted(c.items(), key=lambda kv: (kv[0] == "overall", kv[0]))) for m, c in out.items()}


def _metrics(rs: list[RunRecord], plain: list[RunRecord], plain_ids: dict[int, list[int]]) -> dict:
    tokens = sum(r.new_tokens for r in rs)
    time = sum(r.time_s for r in rs)
    tps = _ratio(tokens, time) or 0.0
    plain_tps = _ratio(sum(r.new_tokens for r in plain), sum(r.time_s for r in plain))
    m: dict = {
        "prompts": len(rs),
        "new_tokens": tokens,
        "time_s": time,
        "tokens_per_second": tps,
        "speedup": _ratio(tps, plain_tps) if plain_tps else None,
        "mismatches": sum(1 for r in rs if r.question_id in plain_ids and r.token_ids != plain_ids[r.question_id]),
    }
    if any(r.drafted is None for r in rs):  # a peer without speculation metrics
        return m
    drafted = sum(r.drafted for r in rs)
    accepted = sum(r.accepted for r in rs)
    passes = sum(r.target_passes for r in rs)
    width = max((len(r.drafted_per_position) for r in rs), default=0)
    by_pos_d = [sum(r.drafted_per_position[i] for r in rs if i < len(r.drafted_per_position)) for i in range(width)]
    by_pos_a = [sum(r.accepted_per_position[i] for r in rs if i < len(r.accepted_per_position)) for i in range(width)]
    draft_t, verify_t = sum(r.draft_time_s for r in rs), sum(r.verify_time_s for r in rs)
    m.update({
        "drafted": drafted,
        "accepted": accepted,
        "target_passes": passes,
        "acceptance_rate": _ratio(accepted, drafted) or 0.0,
        "tokens_per_pass": _ratio(tokens, passes) or 0.0,
        "acceptance_by_position": [_ratio(a, d) or 0.0 for a, d in zip(by_pos_a, by_pos_d)],
        "mean_draft_length": _ratio(drafted, passes) or 0.0,
        # per round that drafted: draft tokens verified (a tree's nodes) and accepted (its path)
        "nodes_per_round": _ratio(drafted, sum(r.drafts or 0 for r in rs)) or 0.0,
        "accepted_per_round": _ratio(accepted, sum(r.drafts or 0 for r in rs)) or 0.0,
        "time_split": {
            "drafting": _ratio(draft_t, time) or 0.0,
            "verifying": _ratio(verify_t, time) or 0.0,
            "other": _ratio(time - draft_t - verify_t, time) or 0.0,
        },
    })
    plain_step = _ratio(sum(r.verify_time_s for r in plain), sum(r.target_passes or 0 for r in plain))
    if plain_step and passes:
        round_cost = (draft_t + verify_t) / passes / plain_step
        if drafted > sum(by_pos_d):  # trees (more nodes than levels): per-node acceptance means little
            theory = m["tokens_per_pass"] / round_cost
        else:
            theory = expected_tokens_per_round(m["acceptance_rate"], m["mean_draft_length"]) / round_cost
        m["round_cost_in_plain_steps"] = round_cost
        m["theoretical_speedup"] = theory
        m["efficiency"] = _ratio(m["speedup"], theory) if m["speedup"] else None
    return m


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown(summary: dict, env: dict) -> str:
    """The tables of results.md."""
    methods = list(summary)
    categories = [c for c in next(iter(summary.values()))] if summary else []
    lines = ["# specdraft bench", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## Overall", "",
              "| method | tokens/s | speedup | acceptance | nodes/round | accepted/round | tokens/pass | theoretical "
              "| efficiency | drafting / verifying / other | mismatches |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        o = dict(summary[m]["overall"])
        if not o.get("drafted"):  # plain decoding and peers: no speculation figures
            for key in ("acceptance_rate", "tokens_per_pass", "theoretical_speedup", "efficiency", "nodes_per_round",
                        "accepted_per_round"):
                o[key] = None
        split = o.get("time_split")
        split_s = " / ".join(f"{split[k]:.0%}" for k in ("drafting", "verifying", "other")) if split else "-"
        lines.append(
            f"| {m} | {o['tokens_per_second']:.1f} | {_fmt(o['speedup'], '.2f', 'x')} | {_fmt(o.get('acceptance_rate'))} "
            f"| {_fmt(o.get('nodes_per_round'))} | {_fmt(o.get('accepted_per_round'))} | {_fmt(o.get('tokens_per_pass'))} | {_fmt(o.get('theoretical_speedup'), '.2f', 'x')} "
            f"| {_fmt(o.get('efficiency'), '.0%')} | {split_s} | {o['mismatches']} |"
        )
    lines += ["", "## Speedup over plain decoding by category", "",
              "| category | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c in categories:
        lines.append(f"| {c} | " + " | ".join(_fmt(summary[m].get(c, {}).get("speedup"), ".2f", "x") for m in methods) + " |")
    lines += ["", "## Tokens per second by category", "",
              "| category | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c in categories:
        lines.append(f"| {c} | " + " | ".join(_fmt(summary[m].get(c, {}).get("tokens_per_second"), ".1f") for m in methods) + " |")
    spec_methods = [m for m in methods if "acceptance_by_position" in summary[m]["overall"] and summary[m]["overall"]["drafted"]]
    if spec_methods:
        lines += ["", "## Acceptance rate by category", "",
                  "| category | " + " | ".join(spec_methods) + " |", "|---" * (len(spec_methods) + 1) + "|"]
        for c in categories:
            lines.append(f"| {c} | " + " | ".join(_fmt(summary[m].get(c, {}).get("acceptance_rate")) for m in spec_methods) + " |")
        lines += ["", "## Acceptance by draft position (overall)", ""]
        for m in spec_methods:
            pos = summary[m]["overall"]["acceptance_by_position"]
            lines.append(f"- {m}: " + ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(pos)))
    return "\n".join(lines) + "\n"
