"""Protocol-guided search for the removal set, with the repair of the cut in the loop.

One module on purpose: the search, its per-budget allowances and the bound of its cost that
:func:`~hf_layerswap.cost.estimate_cost` reads from its registry entry are one schedule; the
bound follows the allowances and defaults defined here, so they change together.

The paper's greedy rule (:func:`~hf_layerswap.scoring.rule.greedy_select`) reads one number
per layer and never looks at a set as a whole; two blocks that are each cheap to remove
can be costly together, and the best sets are often neighbours ({13, 14}, {7, 8, 9}),
which the rule's spacing forbids. :func:`search_select` scores whole candidate sets S on
the calibration prompts by an *objective*, the sets to score ranked by a prediction.

Each budget n spends its allowance (below) in up to ``1 + max_rounds`` rounds, each
scoring the sets of lowest *prediction* not scored yet (at least ``moves_per_round`` a
round, the allowance spread over the rounds), the prediction refitted after each round.
Every set is scored once and cached across budgets. The sets ranked: every set of n
removable blocks where there are at most 20,000 of them; else the proposals below and,
around the best sets scored, every one-block swap, run shift and growth of a best set of
n - 1. Proposals from the scores: each protocol's greedy set (the paper's rule, spacing 1;
at budget 2 scored first, the pair tables' own pair) and its n lowest-scored layers, the
n lowest single-removal values d_skip({i}), per score source (each protocol, single
removal) the two contiguous runs of n unprotected blocks with the lowest summed score,
and the best set of n - 1 grown by its best predicted block (what a budget whose
allowance is spent scores, alone).

Prediction (second order): a set scored has its value; else f(S) ~ sum over i in S of
d({i}) + sum over pairs {a, b} in S of the interaction f({a, b}) - d({a}) - d({b}), the
measured one for a pair scored, else the pair model's: f({a, b}) ~ r * (d({a}) + d({b}))
with one ratio r for neighbours and one for the others, the mean of the scored pairs of
that kind shrunk toward 1 by one pseudo-pair (removal costs of blocks are mostly
sub-additive, neighbours most). For four blocks or more, the mean residual (scored minus
second-order value) of its scored subsets one block smaller is added. So two blocks that
are cheap alone but costly together are not tried first, and a costly block that is
cheap next to another is.

Allowance (SLEB's schedule): budget n scores at most what step n of SLEB scores,
U - (n - 1) new sets for U = L - |protect| removable blocks (budget 1: the single-removal
sweep, U sets); budget 2's protocol pairs count inside it. So budgets 1..N together
score at most sum_{k<N} (U - k) sets, SLEB's count for N, and never more forward passes
(one per set plus one dense reference sweep each). ``evaluations_per_budget`` replaces
U - (n - 1) by one number for every budget n >= 2; an optional ``max_evaluations`` caps
the whole call. A budget with at most ``exhaustive_below`` sets in all scores every set
instead when they fit in what budgets 1..n may spend together (the allowances of 1..n less
what 1..n-1 spent), so the cumulative bound holds there too. Budget n only depends on the
work for budgets 1..n, so one call for 1..N returns what N separate calls would.
Everything is deterministic (ties: the lexicographically smallest set).

Objectives: :data:`~hf_layerswap.selection.objectives.OBJECTIVES` (removal KL, calibration
NLL, removal KL after the Ghosted Layers repair), all on the calibration prompts only.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from torch import nn
from tqdm.auto import tqdm

from ..calibration import CalibrationSet
from ..layerplan import num_blocks, removal_plan, uncompiled
from ..scoring.protocols import PROTOCOLS
from ..scoring.report import SwapReport, score_key, set_key
from ..scoring.rule import check_budget, greedy_select, resolve_protect
from ..scoring.reference import ReferenceCache
from .criterion import CriterionResult, as_calibration, adjacent_report, report_cost, same_prompts
from .dispatch import check_report_matches
from .objectives import OBJECTIVES, SetObjective, objective_entry
from .registry import Criterion, keyword_options, register_strategy
from ..utils.registry import Options, option

__all__ = ["SearchOptions", "check_max_evaluations", "criterion_name", "known_values", "search_allowances", "search_criterion",
           "search_select"]


@dataclass(frozen=True)
class SearchOptions(Options):
    """The typed options of ``strategy="search"`` (:func:`search_select`); its other options
    (``evaluator``, ``on_budget``, ``progress``) pass as given."""

    max_evaluations: int | None = option(None, help="most distinct sets scored in all, the single-removal sweep "
                                                    "included (None: the per-budget allowances)", ge=1)
    evaluations_per_budget: int | None = option(None, help="most new sets each budget n >= 2 scores (None: SLEB's "
                                                           "schedule, U - (n - 1))", ge=1)
    extend_best: int = option(3, help="the best sets of n - 1 grown and of n moved", ge=1)
    moves_per_round: int = option(6, help="the least sets each round of a budget scores", ge=0)
    max_rounds: int = option(4, help="rounds after the first, per budget", ge=0)
    exhaustive_below: int | None = option(None, help="score every set of a budget with at most this many that fit "
                                                     "its allowance (None: moves_per_round * max_rounds)", ge=0)
    prefix_reuse: bool = option(True, help="reuse the stream of a shared prefix across candidate sets")


def _lowest(scores: Sequence[float], allowed: Sequence[int], n: int) -> list[int]:
    finite = [i for i in allowed if scores[i] is not None and math.isfinite(scores[i])]
    return sorted(sorted(finite, key=lambda i: (score_key(scores[i]), i))[:n])


def _best_runs(scores: Sequence[float], allowed: set[int], num_blocks: int, n: int, k: int = 2) -> list[list[int]]:
    """The ``k`` contiguous runs of ``n`` allowed blocks with the lowest summed score (ties: earliest)."""
    runs = []
    for a in range(num_blocks - n + 1):
        run = list(range(a, a + n))
        if all(i in allowed and scores[i] is not None and math.isfinite(scores[i]) for i in run):
            runs.append((sum(scores[i] for i in run), a, run))
    return [run for _, _, run in sorted(runs)[:k]]


def _shifts(current: Sequence[int], allowed: set[int]) -> list[list[int]]:
    """Each maximal contiguous run of ``current`` moved by one block either way."""
    out, members = [], set(current)
    for start in sorted(x for x in members if x - 1 not in members):
        end = start
        while end + 1 in members:
            end += 1
        for drop, add in ((start, end + 1), (end, start - 1)):
            if add in allowed and add not in members:
                out.append(sorted((members - {drop}) | {add}))
    return out


def search_select(
    report: SwapReport | None,
    budgets: int | Sequence[int],
    *,
    model: nn.Module,
    calibration: CalibrationSet,
    objective: str = "removal_kl",
    protect: Sequence[int] = (0, -1),
    spacing: int = 0,
    max_evaluations: int | None = None,
    evaluations_per_budget: int | None = None,
    extend_best: int = 3,
    moves_per_round: int = 6,
    max_rounds: int = 4,
    exhaustive_below: int | None = None,
    batch_size: int = 8,
    prefix_reuse: bool = True,
    progress: bool = False,
    evaluator: SetObjective | None = None,
    on_budget: Callable[[int, dict], None] | None = None, max_memory=None,
) -> dict[int, dict]:
    """Search the removal set of every budget 1..max(budgets) on the calibration prompts.

    Args:
        report: swap-KL scores of ``model`` on these prompts (candidates from each protocol it scored;
            its set values of this model and prompts, :func:`known_values`, are taken); ``None``: single removals only.
        budgets: n or a list of n; the search runs every budget up to the largest (each
            seeds the next) and returns the requested ones.
        model: the dense model (left unchanged).
        calibration: the calibration prompts (the only text the search reads).
        objective: see :data:`OBJECTIVES`.
        protect: blocks never removed (negative = from the end; default first and last).
        spacing: every two removed blocks satisfy ``|a - b| > spacing`` (default 0: none).
        max_evaluations: most distinct sets to score in all (default ``None``: no cap
            beyond the per-budget allowances); the single-removal sweep counts. At least
            one set per removable block.
        evaluations_per_budget: most new sets each budget n >= 2 scores (at n = 2 the
            protocols' own pairs included; default ``None``: SLEB's schedule, U - (n - 1) for
            U = L - |protect| removable blocks, what step n of SLEB scores); budget 1
            scores the single-removal sweep (U sets). A later budget is never starved by an
            earlier one; by default budgets 1..N together score at most SLEB's count for N,
            sum_{k<N} (U - k) sets (with the option: U + (N - 1) * evaluations_per_budget).
        extend_best: how many best sets of n - 1 are grown and of n moved (ranked sets).
        moves_per_round, max_rounds: up to ``1 + max_rounds`` rounds a budget, each of at least ``moves_per_round`` sets.
        exhaustive_below: score every set of a budget when there are at most this many
            (default ``moves_per_round * max_rounds``) and
            they fit in what budgets 1..n may spend together (their allowances less what
            budgets 1..n-1 spent); such a budget's allowance is raised to all its sets.
        evaluator: a :class:`SetObjective` to reuse (its cache and counters carry over).
        on_budget: called as ``on_budget(n, record)`` when each budget 1..max(budgets) is done
            (``record`` as returned, ``total_cost`` the cost so far): results as they come.
        max_memory: working-memory budget, its kept reference's and engine calls' (:class:`SetObjective`).

    Returns:
        ``{n: record}``; ``record`` has ``selected`` (0-based, ascending), ``value`` (the
        objective of it), ``objective``, ``strategy="search"``, ``protocol_sets``
        (per protocol in the report: the paper's greedy set with spacing 1 and its
        value, ``None`` if not scored; the entry ``None`` where the rule cannot fill the
        budget), ``trace`` (sets of n scored, the first round's best, each round),
        ``cost`` (cumulative evaluator calls, ``reused`` ones, forward passes, block
        passes, seconds up to this budget), ``total_cost`` (the whole call), ``evaluations_per_budget`` (as
        given) and ``allowances`` (the most new sets of each budget 1..max(budgets), an
        exhaustive budget's raised one included).

    Raises:
        ValueError: an unknown objective, a budget above the unprotected blocks the
            spacing allows, or a report of another block count.
    """
    total = num_blocks(model)
    wanted, top = _check_budgets(report, budgets, total, spacing, protect)
    check_max_evaluations(max_evaluations, total, protect)
    protected = resolve_protect(protect, total)
    allowed = [i for i in range(total) if i not in protected]
    exhaustive_below = moves_per_round * max_rounds if exhaustive_below is None else exhaustive_below
    schedule = search_allowances(len(allowed), top, evaluations_per_budget)
    allowances = list(schedule)  # an exhaustive budget raises its own
    _check_extend_best(extend_best)
    budget_total = math.inf if max_evaluations is None else int(max_evaluations)
    bar = (tqdm(total=min(sum(allowances), budget_total), desc=f"removal-set search ({objective})", unit="set",
                dynamic_ncols=True) if progress and evaluator is None else None)
    f = evaluator or SetObjective(model, calibration, objective, batch_size=batch_size, prefix_reuse=prefix_reuse, progress=bar,
                                  max_memory=max_memory, known=known_values(report, calibration, objective, model))
    search = _SetSearch(f, allowed, spacing, budget_total, total)
    first_call = f.calls
    search.score_singles()
    sources = {"single_removal": search.single}
    protocols = list(report.protocols) if report is not None else []
    for p in protocols:
        sources[p] = report.layer_scores(p)
    common = {"strategy": "search", "objective": objective, "spacing": spacing, "protect": sorted(protected),
              "max_evaluations": max_evaluations, "evaluations_per_budget": evaluations_per_budget,
              "allowances": allowances, "unit": "nats per token" if objective == "nll" else "nats"}
    # per budget: the best set, the sets scored best first, the trace, the protocols' own sets, the cost so far
    ranked_by_n: dict
    best, ranked_by_n, trace, protocol_sets, costs = {}, {}, {}, {}, {}
    for n in range(1, top + 1):
        exhaustive = _exhaustive(len(allowed), n, exhaustive_below, f.calls - first_call, schedule)
        if n > 1 and exhaustive:
            allowances[n - 1] = max(allowances[n - 1], math.comb(len(allowed), n))
        greedy, ranked, current, rounds = search.run_budget(
            n, sources, protocols, protect, ranked_by_n.get(n - 1), extend_best=extend_best,
            allowance=allowances[n - 1], moves_per_round=moves_per_round, max_rounds=max_rounds,
        )
        ranked_by_n[n] = sorted({set_key(s): s for s in [current] + ranked}.values(),
                                key=lambda s: (score_key(f.value(s)), s))
        best[n] = current
        protocol_sets[n] = {p: (None if g is None else {"set": g, "value": f.value(g) if set_key(g) in f.cache else None})
                            for p, g in greedy.items()}
        seed = rounds[0]["best"] if rounds else ranked[0]
        trace[n] = {"candidates": len(ranked), "seed_best": seed, "seed_value": f.value(seed), "rounds": rounds}
        costs[n] = f.cost()
        if on_budget is not None:
            on_budget(n, _record_of(n, best[n], f.value(best[n]), protocol_sets[n], trace[n], costs[n], costs[n],
                                    common))
    if bar is not None:
        bar.close()
    final_cost = f.cost()
    return {n: _record_of(n, best[n], f.value(best[n]), protocol_sets[n], trace[n], costs[n], final_cost, common)
            for n in wanted}


def _record_of(n: int, selected, value, protocol_sets: dict, trace: dict, cost: dict, total_cost: dict,
               common: dict) -> dict:
    """The record :func:`search_select` returns for budget ``n`` (keys in a fixed order)."""
    return {
        "strategy": common["strategy"], "objective": common["objective"], "num_to_remove": n, "selected": list(selected),
        "value": value, "spacing": common["spacing"], "protect": list(common["protect"]),
        "protocol_sets": copy.deepcopy(protocol_sets), "trace": copy.deepcopy(trace),
        "cost": dict(cost), "total_cost": dict(total_cost), "max_evaluations": common["max_evaluations"],
        "evaluations_per_budget": common["evaluations_per_budget"], "allowances": list(common["allowances"]),
        "unit": common["unit"],
    }


def known_values(report: SwapReport | None, calibration: CalibrationSet, objective: str,
                 model: nn.Module | None = None) -> dict[str, float]:
    """The removal-KL values ``report`` already holds (:attr:`~hf_layerswap.SwapReport.removal_kl`,
    e.g. an earlier search's on the same model) when they were measured on these prompts and
    this model: the report's calibration content hash is ``calibration``'s and, when the
    report records its model's weight fingerprint and ``model`` is given, it is ``model``'s
    (:func:`~hf_layerswap.selection.dispatch.check_report_matches`). ``{}`` for another
    objective, no report, other prompts or another model."""
    if report is None or objective != "removal_kl" or not report.removal_kl:
        return {}
    if same_prompts(report, calibration) is not True:
        return {}
    if model is not None:
        try:
            check_report_matches(report, uncompiled(model))
        except ValueError:  # scored on another model: its layer scores still seed the candidates
            return {}
    return dict(report.removal_kl)


def _check_budgets(report: SwapReport | None, budgets, total: int, spacing: int, protect) -> tuple[list[int], int]:
    """(the requested budgets ascending, the largest); raises ``ValueError`` for none, a
    budget the rule cannot fill, or a report of another block count."""
    single_budget = isinstance(budgets, int)
    wanted = sorted({budgets} if single_budget else set(budgets))
    if not wanted:
        raise ValueError("no budget given: pass n as an int or a non-empty list of ints")
    top = max(check_budget(b, total, spacing=spacing, protect=protect) for b in wanted)
    if report is not None and report.num_blocks != total:
        raise ValueError(f"the report has {report.num_blocks} blocks but the model has {total}")
    return wanted, top


def check_max_evaluations(max_evaluations, total: int, protect) -> None:
    """Refuse a ``max_evaluations`` below the single-removal sweep the search starts with (one
    set per removable block of a model of ``total`` blocks with ``protect``); ``None`` (no cap)
    passes. :func:`~hf_layerswap.prune` checks it before the scoring.

    Raises:
        ValueError: naming the cap and the least allowed.
    """
    removable = total - len(resolve_protect(protect, total))
    if max_evaluations is not None and int(max_evaluations) < removable:
        raise ValueError(f"max_evaluations={max_evaluations!r}: at least {removable} (one per removable block)")


def _check_extend_best(extend_best) -> None:
    """Raises ``ValueError`` for ``extend_best`` < 1."""
    if int(extend_best) < 1:
        raise ValueError(f"extend_best={extend_best!r}: must be an int >= 1")


def _exhaustive(removable: int, n: int, exhaustive_below: int, spent: int, schedule: Sequence[int]) -> bool:
    """Whether budget ``n`` scores every set: there are at most ``exhaustive_below`` and they
    fit in what budgets 1..n may spend together (``schedule[:n]`` less the ``spent`` of budgets
    1..n-1), so the search never passes the schedule's sum. Budget 1: the sweep scored them all."""
    combos = math.comb(removable, n)
    return combos <= exhaustive_below and (n == 1 or spent + combos <= sum(schedule[:n]))


def search_allowances(removable: int, top: int, evaluations_per_budget: int | None = None) -> list[int]:
    """The most new sets :func:`search_select` scores at each budget 1..``top`` (before an
    exhaustive budget raises its own): budget 1 the single-removal sweep (``removable``
    sets, U = L - |protect|); budget n >= 2 ``evaluations_per_budget`` or, by default,
    SLEB's step n: U - (n - 1). The default list sums to SLEB's count of candidate sets for
    ``top`` (Song et al., 2024, "SLEB: Streamlining LLMs through Redundancy Verification
    and Elimination of Transformer Blocks").

    Raises:
        ValueError: ``evaluations_per_budget`` below 1, ``removable`` below 1 or ``top``
            above ``removable``.
    """
    if int(removable) < 1 or not 1 <= int(top) <= int(removable):
        raise ValueError(f"removable={removable!r}, top={top!r}: need 1 <= top <= removable")
    if evaluations_per_budget is not None and int(evaluations_per_budget) < 1:
        raise ValueError(f"evaluations_per_budget={evaluations_per_budget!r}: must be an int >= 1 or None")
    if evaluations_per_budget is None:
        return [int(removable) - k for k in range(int(top))]
    return [int(removable)] + [int(evaluations_per_budget)] * (int(top) - 1)


#: Budgets with at most this many sets rank every one of them by the prediction; above it
#: the ranked pool is the seeds and the one-block moves around the best sets scored.
_ENUMERATE_LIMIT = 20000


class _SetSearch:
    """The state of one :func:`search_select` call: the cached objective ``f``, the
    removable blocks, the spacing rule, the evaluation allowance of the current budget,
    and the single-removal values with the blocks ranked by them."""

    def __init__(self, f: SetObjective, allowed: list[int], spacing: int, budget_total: float, total: int):
        self.f = f
        self.allowed = allowed
        self.allowed_set = set(allowed)
        self.spacing = spacing
        self.budget_total = budget_total
        self.total = total
        self.level = {"start": f.calls, "allowance": len(allowed)}
        self.single: list[float | None] = [None] * total
        self.rank: list[int] = []
        self.ratios = {1: 1.0, 2: 1.0}

    def ok(self, s) -> bool:
        s = sorted(set(s))
        return all(i in self.allowed_set for i in s) and all(b - a > self.spacing for a, b in zip(s, s[1:]))

    def left(self) -> int:
        f = self.f  # the budget's allowance is finite, so the result is (an infinite cap is not)
        return int(min(self.budget_total - f.calls, self.level["allowance"] - (f.calls - self.level["start"])))

    def score(self, pool):
        """Score the allowed, not yet cached sets of ``pool`` (as many as the allowance
        leaves, at least one) and return the pool's scored sets, best first."""
        f = self.f
        pool = [sorted(set(s)) for s in pool if s and self.ok(s)]
        pool = list({set_key(s): s for s in pool}.values())
        new = [s for s in pool if set_key(s) not in f.cache]
        cached = [s for s in pool if set_key(s) in f.cache]
        limit = max(self.left(), 0 if cached else 1)  # a budget always gets at least one scored set
        if len(new) > limit:
            new = new[:limit]
            pool = cached + new
        f(new)
        self.fit_ratios()
        return sorted(pool, key=lambda s: (score_key(f.value(s)), s))

    def score_singles(self) -> None:
        """Budget 1: every single removal, then the blocks ranked by it (ties: lower block)."""
        for s in self.score([[i] for i in self.allowed]):
            self.single[s[0]] = self.f.value(s)
        self.rank = sorted(self.allowed, key=lambda i: (score_key(self.single[i]), i))

    def scored(self, n: int) -> list[list[int]]:
        """Every set of ``n`` blocks scored so far, best first (ties: lexicographic)."""
        sets = [[int(x) for x in key.split(",")] for key in self.f.cache if key.count(",") == n - 1]
        return sorted(sets, key=lambda s: (score_key(self.f.value(s)), s))

    def fit_ratios(self) -> None:
        """The pair model for pairs not scored: f({a, b}) ~ r * (d({a}) + d({b})), one ratio r
        for neighbours (gap 1) and one for the others, each the mean of the scored pairs of
        its kind shrunk toward 1 (additive) by one pseudo-pair."""
        sums = {1: [1.0, 1], 2: [1.0, 1]}
        for key, value in self.f.cache.items():
            if key.count(",") != 1:
                continue
            a, b = (int(x) for x in key.split(","))
            if self.single[a] is None or self.single[b] is None:
                continue
            base = self.single[a] + self.single[b]
            if not (math.isfinite(value) and math.isfinite(base)) or base <= 0:
                continue
            kind = 1 if b - a == 1 else 2
            sums[kind][0] += value / base
            sums[kind][1] += 1
        self.ratios = {k: s / c for k, (s, c) in sums.items()}

    def interaction(self, a: int, b: int) -> float:
        """f({a, b}) - d({a}) - d({b}): the scored value where the pair was scored, else the
        pair model's (:meth:`fit_ratios`)."""
        a, b = min(a, b), max(a, b)
        key = set_key((a, b))
        if key in self.f.cache:
            return self.f.cache[key] - self.single[a] - self.single[b]
        return (self.ratios[1 if b - a == 1 else 2] - 1.0) * (self.single[a] + self.single[b])

    def pairwise(self, s: Sequence[int]) -> float:
        """The second-order value of ``s``: its single removals plus every pair's interaction."""
        return sum(self.single[x] for x in s) + sum(self.interaction(a, b) for a, b in itertools.combinations(s, 2))

    def predict_set(self, s: Sequence[int]) -> float:
        """The value of ``s`` as scored, else predicted: :meth:`pairwise`, corrected by the mean
        residual (scored minus pairwise) of its scored subsets one block smaller."""
        key = set_key(s)
        if key in self.f.cache:
            return self.f.cache[key]
        value = self.pairwise(s)
        if len(s) > 3:
            residuals = [self.f.cache[k] - self.pairwise(t) for t in ([x for x in s if x != d] for d in s)
                         if (k := set_key(t)) in self.f.cache]
            if residuals:
                value += sum(residuals) / len(residuals)
        return math.inf if math.isnan(value) else value

    def extensions(self, prev: Sequence[int], count: int | None = None) -> list[list[int]]:
        """``prev`` grown by one allowed block, best prediction first (ties: lower set); the
        first ``count`` of them."""
        grown = [sorted(list(prev) + [c]) for c in self.allowed if c not in prev]
        grown = [s for s in grown if self.ok(s)]
        grown.sort(key=lambda s: (score_key(self.predict_set(s)), s))
        return grown if count is None else grown[:count]

    def neighbourhood(self, n: int, seeds: list[list[int]], ranked_prev: list[list[int]] | None,
                      extend_best: int) -> list[list[int]]:
        """The sets the prediction ranks at budget ``n``: every set where there are at most
        :data:`_ENUMERATE_LIMIT`, else the seeds, the best sets of ``n - 1`` grown by one block,
        and the one-block swaps and run shifts of the best sets of ``n`` scored so far."""
        if math.comb(len(self.allowed), n) <= _ENUMERATE_LIMIT:
            return [list(c) for c in itertools.combinations(self.allowed, n) if self.ok(c)]
        pool = list(seeds)
        for prev in (ranked_prev or [])[:extend_best]:
            pool.extend(self.extensions(prev))
        for current in self.scored(n)[:extend_best]:
            pool.extend(_shifts(current, self.allowed_set))
            pool.extend(sorted([x for x in current if x != r] + [c]) for r in current for c in self.allowed
                        if c not in current)
        return [s for s in pool if self.ok(s)]

    def run_budget(self, n: int, sources: dict, protocols: list[str], protect, ranked_prev: list[list[int]] | None, *,
                   extend_best: int, allowance: int, moves_per_round: int, max_rounds: int):
        """Budget ``n``: up to ``1 + max_rounds`` rounds, each scoring the sets of best
        prediction (:meth:`predict_set`) not scored yet, at least ``moves_per_round`` a round
        and the allowance spread over the rounds, the prediction refitted after each round.
        A budget whose allowance is spent scores the best set of ``n - 1`` grown by its
        best predicted block. Returns ``(greedy sets, sets of n scored best first, best
        set, rounds)``."""
        f, spacing = self.f, self.spacing
        greedy = {}
        for p in protocols:
            try:
                greedy[p] = greedy_select(sources[p], n, spacing=max(1, spacing), protect=protect)
            except ValueError:
                greedy[p] = None
        if n > 1:
            self.level.update(start=f.calls, allowance=allowance)
        seeds = self.seeds(n, greedy, sources, protocols, ranked_prev)
        rounds: list[dict] = []
        if n > 1 and self.left() <= 0:  # spent: the best set of n - 1 grown by the best predicted block
            self.score(seeds[:1])
        rounds_left = max_rounds + 1 if n > 1 else 0
        # budget 2: each protocol's greedy pair first, the pair tables' own proposal (beyond
        # it the pairs they and the prediction led to are in the pair model)
        own = [g for p in protocols if (g := greedy[p]) is not None and self.ok(g)] if n == 2 else []
        while self.left() > 0 and rounds_left > 0:
            pool = [s for s in self.neighbourhood(n, seeds, ranked_prev, extend_best) if set_key(s) not in f.cache]
            if not pool:
                break
            pool.sort(key=lambda s: (score_key(self.predict_set(s)), s))
            before = self.scored(n)[:1]
            size = max(min(moves_per_round, self.left()), math.ceil(self.left() / rounds_left))
            tried = self.score(own + pool[:max(size - len(own), 0)])
            own = []
            best = self.scored(n)[0]
            rounds.append({"sets": len(tried), "best": best, "value": f.value(best),
                           "improved": not before or score_key(f.value(best)) < score_key(f.value(before[0]))})
            rounds_left -= 1
        ranked = self.scored(n)
        if not ranked:  # the spacing left nothing: fall back to the greedy order of singles
            ranked = self.score([greedy_select(self.single, n, spacing=spacing, protect=protect)])
        return greedy, ranked, ranked[0], rounds

    def seeds(self, n: int, greedy: dict, sources: dict, protocols: list[str],
              ranked_prev: list[list[int]] | None) -> list[list[int]]:
        """Candidate sets of budget ``n`` beyond the prediction's own: the best set of ``n - 1``
        grown by its best predicted block first, each protocol's greedy and lowest-score sets,
        the ``n`` most removable blocks, the best contiguous runs of every score."""
        pool = []
        if n > 1:
            pool.extend(self.extensions(ranked_prev[0], 1))
        pool.extend(greedy[p] for p in protocols if greedy[p] is not None)
        for p in protocols:
            pool.append(_lowest(sources[p], self.allowed, n))
        pool.append(self.rank[:n] if n <= len(self.rank) else [])
        for scores in sources.values():
            pool.extend(_best_runs(scores, self.allowed_set, self.total, n))
        return [s for s in pool if s and self.ok(s)]


def _default_objective(objective):
    return "removal_kl" if objective is None else objective


#: What ``_search`` passes to :func:`search_select` itself; every other keyword is an option.
_SEARCH_FIXED = ("report", "budgets", "model", "calibration", "objective", "protect", "spacing", "batch_size",
                 "max_memory")


def _config_options(cfg) -> dict:
    """``select_layers`` keywords from a :class:`~hf_layerswap.LayerSwapConfig`."""
    out = {"objective": _default_objective(cfg.objective), "progress": cfg.progress}
    if cfg.max_evaluations is not None:
        out["max_evaluations"] = cfg.max_evaluations
    return out


def _describe(cfg) -> str:
    return (f"search over candidate sets ({_default_objective(cfg.objective)} on the calibration prompts), "
            f"spacing={cfg.spacing}, protect={cfg.protect}")


def _card_candidates(search, report, removed, kl, indices):
    """The card's rows for each protocol's greedy set (paper's rule, spacing >= 1) as the
    search scored them, and why the chosen set won; ``None`` when the record is of another set."""
    if list(search.get("selected", [])) != list(removed):
        return None
    rows, sets = [], {}
    objective = search.get("objective", "removal_kl")
    for p in report.protocols:
        entry = (search.get("protocol_sets") or {}).get(p)
        if entry is None:
            rows.append({"protocol": p, "layers": "not possible under the paper's rule at this budget",
                         "removal_kl": kl(None)})
            continue
        sets[p] = list(entry["set"])
        value = entry.get("value")
        if objective != "removal_kl":
            value = report.removal_kl.get(set_key(entry["set"]))
        rows.append({"protocol": p, "layers": indices(entry["set"]), "removal_kl": kl(value)})
    cost = search.get("cost") or {}
    values = {p: (search["protocol_sets"][p] or {}).get("value") for p in sets}
    reason = (
        f"`strategy='search'`: candidate sets, proposed by both protocols (each protocol's greedy set and "
        "lowest-scored layers, low-score contiguous runs, the single-removal ranking) and ranked by a prediction "
        f"from the single removals and the pairs scored, were scored by **{objective}** on the calibration prompts; "
        f"the chosen set scores {kl(search.get('value'))} {search.get('unit', 'nats')}"
    )
    if values:
        reason += " against " + ", ".join(
            f"{p} {kl(v)}" if v is not None else f"{p} (not scored: predicted above the sets scored)"
            for p, v in values.items())
    reused = (f", {cost['reused']} of them valued by an earlier search on the same prompts and model, with no pass"
              if cost.get("reused") else "")
    reason += (f" ({cost.get('evaluator_calls', '?')} candidate sets{reused}, {cost.get('forward_passes', '?')} forward "
               "passes). It has the lowest value of every set scored.")
    matching = [p for p, s in sets.items() if s == list(removed)]
    if matching:
        reason += f" It is also the set the {' and '.join(matching)} rule picks."
    else:
        reason += " Neither protocol's greedy rule picks it."
    return rows, reason


def _search_cost(plan) -> dict:
    """The search's passes (budgets 1..n): budget 1's single-removal sweep exactly, then an
    upper bound from the per-budget allowances (:func:`search_allowances`), each further set
    from the first removable block without prefix sharing, plus the reference sweeps of the
    batches the kept reference cannot hold; a repair-aware objective adds its operator fit
    and the sets cut through the last block."""
    cfg, total_blocks, allowed = plan.config, plan.num_blocks, plan.allowed
    options = plan.options  # the search's typed options as the prune passes them (SearchOptions)
    rounds = options.max_rounds
    n_top = plan.num_to_remove
    sets = [[i] for i in allowed]  # budget 1: the single-removal sweep, exact
    # budgets 2..n: SLEB's schedule (or evaluations_per_budget) each, each protocol's greedy set inside; an
    # exhaustive budget only spends what budgets 1..n may spend together, so the sum bounds it too
    bound_sets = sum(search_allowances(len(allowed), n_top, options.evaluations_per_budget)[1:])
    calls = 2 + (2 + rounds) * (n_top - 1)  # the sweep; per budget 1 + max_rounds rounds and a fallback
    if options.max_evaluations is not None:  # the whole call's cap; a budget past it still scores one set
        bound_sets = max(0, min(bound_sets, int(options.max_evaluations) - len(sets) + n_top - 1))
    plans = {k: removal_plan(total_blocks, s) for k, s in enumerate(sets)}
    # each set from its first removed block, no sharing between sets: calls share less than one run would;
    # the first call (the single-removal sweep) finds the kept reference empty and fills it: its plan is exact
    # (without prefix_reuse every set runs from the first block)
    counts = plan.engine(plans, settings=dataclasses.replace(plan.settings,
                                                             prefix_reuse="start" if options.prefix_reuse else "none"),
                         reference_cache=ReferenceCache(plan.memory_budget))
    planned = counts.pop("plan")
    calib = plan.calibration
    first = min(allowed) if options.prefix_reuse else 0
    n_batches = len(planned.batches)
    extra_blocks = bound_sets * max(total_blocks - n_top - first, 1) * n_batches
    # batches whose reference does not fit the kept budget are swept again by every further call
    kept = plan.reference_batches(planned)
    extra_blocks += (n_batches - kept) * total_blocks * (calls - 1)
    counts["block_passes"] += extra_blocks
    counts["block_tokens"] += extra_blocks * calib.input_ids.shape[1] * planned.batch_size
    counts["block_loads"] += _further_loads(planned, bound_sets, calls - 1, kept, total_blocks - first)
    rows = int(calib.attention_mask.sum())
    chunks = sum(math.ceil(b.real_positions / planned.kl_chunk) for b in planned.batches)
    # every further call runs the reference head once per group per chunk; each bound set one head pass
    counts["head_passes"] += chunks * (bound_sets + calls)
    counts["head_rows"] += rows * (bound_sets + calls)
    counts.update(calls=calls, sweeps=calls, sets=len(sets) + bound_sets)
    objective_entry(_default_objective(cfg.objective)).estimate(counts, plan, sets, n_batches)
    return plan.counts(counts, exact=False, note="an upper bound: the single-removal sweep, then each budget's "
                       "allowance of sets from the first removable block (search_allowances)",
                       **{k: counts[k] for k in ("calls", "sweeps", "sets", "working_bytes", "head_loads") if k in counts},
                       exact_sets=sets)


def _further_loads(planned, bound_sets: int, further_calls: int, kept: int, from_first: int) -> int:
    """An upper bound of the block loads of the search's calls after its first, when its
    blocks stream (:class:`~hf_layerswap.scoring.engineplan.EnginePlan` ``offloaded_blocks``;
    0 otherwise): a call that scores sets streams, per batch and slot-major probe group, the
    blocks from the first removable one (``from_first``: the kept reference gives each set
    its start) or, for a batch the kept reference does not hold, every offloaded block. A
    group holds at least ``capacity - 3`` sets (a pass's peak is its live states, one more
    being computed, the identity's and the final rows: :attr:`~hf_layerswap.scoring.slotmajor.PassPlan.peak_states`),
    and only calls that score a set run (at most ``bound_sets`` of ``further_calls``)."""
    if not planned.offloaded_blocks or not bound_sets:
        return 0
    runs = min(further_calls, bound_sets)
    loads = 0
    for n, batch in enumerate(planned.batches):
        per_group = max(1, planned.state_capacity(batch.positions) - 3)
        groups = runs + math.ceil(bound_sets / per_group)
        loads += groups * (min(from_first, planned.offloaded_blocks) if n < kept else planned.offloaded_blocks)
    return loads


def criterion_name(objective: str) -> str:
    """The comparison harness's name of the search with ``objective`` (one of
    :data:`~hf_layerswap.selection.objectives.OBJECTIVES`): ``"search"`` for the default
    ``"removal_kl"``, else ``"search_<objective>"`` (``"search_nll"``, ``"search_ghosted"``)."""
    return "search" if objective == "removal_kl" else f"search_{objective}"


def _criterion(objective: str) -> Criterion:
    """The harness criterion of the search with ``objective`` (:func:`search_criterion`)."""
    return Criterion(lambda model, calib, n, **kw: search_criterion(model, calib, n, objective=objective, **kw),
                     reads=PROTOCOLS)


@register_strategy(
    "search", needs_model=True, help="a search over candidate sets guided by both protocols, minimising a set objective on the calibration prompts", option_class=SearchOptions, cost=_search_cost, options=keyword_options(search_select, _SEARCH_FIXED), config_options=_config_options,
    takes_objective=True, keeps_reference=True,
    describe=_describe, guided_by=lambda decision, protocol: None,
    values=lambda decision: [("the search's value", decision["value"])] if "value" in decision else [],
    card_summary=" by a search over candidate sets guided by both swap-KL protocols.",
    card_rule=lambda spacing, protect: (f"spacing={max(1, spacing)}, protect={protect} for each protocol's rule; "
                                        f"the search itself used spacing={spacing}"),
    card_candidates=_card_candidates,
    check_config=lambda cfg, total: check_max_evaluations(cfg.selection_options().get("max_evaluations"), total,
                                                          cfg.protect),
    criteria={criterion_name(objective): _criterion(objective) for objective in OBJECTIVES},
)
def _search(report, num_to_remove, *, spacing, protect, model, calibration, batch_size, objective, options,
            max_memory=None, **_):
    """Protocol-guided set search (:func:`search_select`) under the caller's working-memory
    budget; the record goes to ``report.selections``."""
    objective = _default_objective(objective)
    record = search_select(report, num_to_remove, model=model, calibration=calibration, objective=objective,
                           protect=protect, spacing=spacing, batch_size=batch_size, max_memory=max_memory,
                           **options)[num_to_remove]
    _record(report, record, calibration)
    return list(record["selected"])


def _record(report: SwapReport, record: dict, calibration: CalibrationSet) -> None:
    """Append the search's ``record`` to the report's selections and, for the removal KL on
    the report's own prompts (or a report that records none), its sets' values to
    ``report.removal_kl``."""
    if record["objective"] == "removal_kl" and same_prompts(report, calibration) is not False:
        report.removal_kl[set_key(record["selected"])] = record["value"]
        for entry in record["protocol_sets"].values():
            if entry is not None and entry["value"] is not None:
                report.removal_kl[set_key(entry["set"])] = entry["value"]
    report.selections.append(record)


def search_criterion(model: nn.Module, calibration, n, *, report: SwapReport, objective: str = "removal_kl",
                     protect: Sequence[int] = (0, -1), batch_size: int = 8, **options):
    """:func:`search_select` as a criterion of :func:`hf_layerswap.comparison.compare_criteria`.

    Returns ``{n: CriterionResult}`` (or one result for an int ``n``); the cost includes
    the scoring of both protocols (adjacent pairs) plus the search, and
    ``details["search_cost"]`` gives the search alone (cumulative up to that budget). The
    search scores every set it values: set values ``report`` holds (e.g. another
    criterion's, :func:`known_values`) are not taken, so its cost does not depend on which
    criteria ran before it.
    """
    calib = as_calibration(model, calibration, None)
    budgets = [n] if isinstance(n, int) else sorted(set(n))
    sub = copy.copy(adjacent_report(report))
    sub.removal_kl = {}
    passes, blocks, seconds, estimated = report_cost(report, tuple(report.protocols))
    found = search_select(sub, budgets, model=model, calibration=calib, objective=objective, protect=protect,
                          batch_size=batch_size, **options)
    out = {}
    for b, rec in found.items():
        cost = rec["cost"]
        out[b] = CriterionResult(
            criterion_name(objective), b, rec["selected"], None,
            passes + cost["forward_passes"], blocks + cost["block_passes"], seconds + cost["seconds"],
            evaluator_calls=cost["evaluator_calls"],
            details={"objective": objective, "value": rec["value"], "unit": rec["unit"],
                     "protocol_sets": rec["protocol_sets"], "trace": rec["trace"], "search_cost": cost,
                     "scoring_cost": {"forward_passes": passes, "block_passes": blocks, "seconds": seconds,
                                      "seconds_estimated": estimated},
                     "protect": rec["protect"]},
        )
    return out[n] if isinstance(n, int) else out
