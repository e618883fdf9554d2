"""The protocol-guided removal-set search (``strategy="search"``) against brute force."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import hf_layerswap as hl
from hf_layerswap.calibration import CalibrationSet
from hf_layerswap.cli import main
from hf_layerswap.recovery import recover
from hf_layerswap.scoring import masked_kl
from hf_layerswap.selection import search_select
from hf_layerswap.selection.search import search_allowances
from hf_layerswap.selection.sleb import sleb
from hf_layerswap.selection.objectives import OBJECTIVES, SetObjective
from hf_layerswap.scoring.rule import greedy_select
from hf_layerswap.selection import STRATEGIES
from conftest import PARAGRAPHS, eight_block_search_setup


@pytest.fixture(scope="module")
def setup():
    """An 8-block random Llama on which the paper's greedy rule misses the best pair."""
    return eight_block_search_setup()


def _brute_force(objective: SetObjective, n: int, allowed=range(1, 7)):
    sets = [list(c) for c in itertools.combinations(allowed, n)]
    values = objective(sets)
    k = min(range(len(sets)), key=lambda k: (values[k], sets[k]))
    return sets[k], values[k]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_search_finds_the_exhaustive_optimum_at_every_budget(setup, objective):
    model, calib, report = setup
    # an allowance of 20 a budget: every budget's sets (at most 20) fit, so each is scored exhaustively
    found = search_select(report, [1, 2, 3, 4, 5], model=model, calibration=calib, objective=objective,
                          evaluations_per_budget=20, max_evaluations=100)
    brute = SetObjective(model, calib, objective)
    for n in range(1, 6):
        best, value = _brute_force(brute, n)
        assert found[n]["selected"] == best, (objective, n)
        assert found[n]["value"] == value
        assert found[n]["strategy"] == "search" and found[n]["objective"] == objective
    assert found[5]["total_cost"]["evaluator_calls"] == 6 + 15 + 20 + 15 + 6
    assert found[5]["allowances"] == [6, 20, 20, 20, 20]


def test_greedy_rule_misses_the_best_pair_that_search_finds(setup):
    model, calib, report = setup
    f = SetObjective(model, calib, "removal_kl")
    best, value = _brute_force(f, 2)
    greedy = {p: greedy_select(report.layer_scores(p), 2) for p in report.protocols}
    assert all(g != best for g in greedy.values())
    assert all(f([g])[0] > value for g in greedy.values())
    chosen = hl.select_layers(report, 2, strategy="search", model=model, calibration=calib)
    assert chosen == best
    record = report.selections[-1]
    assert record["value"] == value and report.removal_kl["3,5"] == value
    for p, g in greedy.items():  # the record keeps each protocol's set and its value
        assert record["protocol_sets"][p] == {"set": g, "value": f([g])[0]}


def test_local_search_alone_reaches_the_optimum_here(setup):
    """With exhaustive scoring switched off and one set per removable block a budget,
    seeds + local moves still find the optimum."""
    model, calib, report = setup
    found = search_select(report, [1, 2, 3], model=model, calibration=calib, exhaustive_below=0,
                          evaluations_per_budget=6)
    brute = SetObjective(model, calib, "removal_kl")
    for n in (1, 2, 3):
        assert found[n]["selected"] == _brute_force(brute, n)[0]
    assert found[3]["total_cost"]["evaluator_calls"] < 6 + 15 + 20  # fewer than all sets


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_prefix_cache_changes_no_value(setup, objective):
    model, calib, _ = setup
    sets = [[2, 3], [5], [3, 5, 6], [1, 6]]
    assert SetObjective(model, calib, objective)(sets) == SetObjective(model, calib, objective, prefix_reuse=False)(sets)


def test_budgets_in_one_call_equal_separate_calls(setup):
    model, calib, report = setup
    together = search_select(report, [1, 2, 3, 4], model=model, calibration=calib, exhaustive_below=0)
    for n in (1, 2, 3, 4):
        alone = search_select(report, n, model=model, calibration=calib, exhaustive_below=0)[n]
        assert alone["selected"] == together[n]["selected"] and alone["value"] == together[n]["value"]
        assert alone["cost"]["evaluator_calls"] == together[n]["cost"]["evaluator_calls"]


def test_ghosted_objective_equals_the_repaired_model(setup):
    """The objective's repaired KL is the KL of the model recover() builds for that set."""
    model, calib, _ = setup
    removed = [3, 4, 6]
    value = SetObjective(model, calib, "ghosted")([removed])[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=calib.input_ids, attention_mask=calib.attention_mask).logits, -1)
        repaired = copy.deepcopy(model)
        recover(repaired, removed, calib, method="ghosted")
        out = repaired(input_ids=calib.input_ids, attention_mask=calib.attention_mask).logits
    expected = float(masked_kl(ref, out, calib.attention_mask).mean())
    assert value == pytest.approx(expected, rel=1e-4, abs=1e-9)
    plain = SetObjective(model, calib, "removal_kl")([removed])[0]
    assert value < plain  # the repair lowers the KL of this cut


def test_search_never_reads_evaluation_text(setup, monkeypatch):
    model, calib, report = setup

    def refuse(*args, **kwargs):
        raise AssertionError("the search evaluated perplexity")

    monkeypatch.setattr(hl.evaluation, "evaluate_perplexity", refuse)
    monkeypatch.setattr(hl, "evaluate_perplexity", refuse)
    assert hl.select_layers(report, 2, strategy="search", model=model, calibration=calib, objective="nll")


def test_registry_refuses_unknown_names(setup, tmp_path):
    model, calib, report = setup
    with pytest.raises(ValueError, match=r"strategy='nope': allowed \[.*'search'.*\]"):
        hl.select_layers(report, 1, strategy="nope")
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(strategy='nope'\): allowed"):
        hl.LayerSwapConfig(num_to_remove=1, strategy="nope")
    with pytest.raises(ValueError, match="objective='bad'"):
        hl.select_layers(report, 1, strategy="search", model=model, calibration=calib, objective="bad")
    with pytest.raises(ValueError, match="pass model= and calibration="):
        hl.select_layers(report, 1, strategy="search")
    assert {"greedy", "auto", "search", "beam", "block_influence", "angular_distance", "single_removal_kl",
            "sleb"} <= set(STRATEGIES)
    with pytest.raises(SystemExit) as err:
        main(["prune", "x", str(tmp_path / "out"), "--num-to-remove", "1", "--strategy", "nope"])
    assert err.value.code == 2


def test_baseline_strategies_share_the_interface(setup):
    model, calib, report = setup
    for name in ("block_influence", "single_removal_kl", "sleb", "angular_distance", "beam"):
        chosen = hl.select_layers(report, 2, strategy=name, model=model, calibration=calib)
        assert len(chosen) == 2 and all(1 <= i <= 6 for i in chosen)
        assert report.selections[-1]["strategy"] in (name, "interchange_beam")
    single = SetObjective(model, calib, "removal_kl")([[i] for i in range(1, 7)])
    order = sorted(range(1, 7), key=lambda i: (single[i - 1], i))
    assert hl.select_layers(report, 2, strategy="single_removal_kl", model=model, calibration=calib) == sorted(order[:2])


def test_sleb_and_single_removal_work_under_the_budget_select_layers_is_given(setup, monkeypatch):
    """select_layers' max_memory (prune's one working-memory budget) reaches SLEB and the
    single-removal sweep: SLEB keeps its dense reference within the budget's reference share
    (as the search does and the cost estimate plans; it took the device's own budget), the
    single-removal probes run under the budget; the choices stay those of the default."""
    from hf_layerswap.scoring.settings import resolve_memory
    from hf_layerswap.selection import single_removal, sleb

    model, calib, report = setup
    kept = []

    class Recording(sleb.ReferenceCache):
        def __init__(self, budget, *args, **kwargs):
            kept.append(budget)
            super().__init__(budget, *args, **kwargs)

    monkeypatch.setattr(sleb, "ReferenceCache", Recording)
    default = hl.select_layers(report, 2, strategy="sleb", model=model, calibration=calib)
    given = hl.select_layers(report, 2, strategy="sleb", model=model, calibration=calib, max_memory="96MiB")
    assert kept == [resolve_memory("auto", model).bytes // 2, 48 << 20] and given == default
    seen, real = [], single_removal.removal_kl_values

    def recording(*args, **kwargs):
        seen.append(kwargs.get("max_memory"))
        return real(*args, **kwargs)

    monkeypatch.setattr(single_removal, "removal_kl_values", recording)
    assert (hl.select_layers(report, 2, strategy="single_removal_kl", model=model, calibration=calib, max_memory="96MiB")
            == hl.select_layers(report, 2, strategy="single_removal_kl", model=model, calibration=calib))
    assert resolve_memory(seen[0], model).bytes == 96 << 20 and seen[1] is None


def test_ghosted_recovery_selects_with_the_repair_in_the_loop():
    from tests.conftest import tiny_batch, tiny_model

    model = tiny_model("llama", num_blocks=6)
    batch = tiny_batch()
    dense = copy.deepcopy(model)
    calib = CalibrationSet(batch["input_ids"], batch["attention_mask"], "tensors")
    # the default objective stays the removal KL with the repair (measured better after it)
    hl.prune_loaded_model(model, hl.LayerSwapConfig(num_to_remove=2, calibration=batch, progress=False, recovery="ghosted"))
    record = model.layerswap_report.selections[-1]
    assert record["strategy"] == "search" and record["objective"] == "removal_kl"
    assert model.config.layerswap["removed_layers"] == record["selected"]
    best, value = _brute_force(SetObjective(dense, calib, "removal_kl"), 2, allowed=range(1, 5))
    assert record["selected"] == best and record["value"] == value
    # the repair in the loop, when asked for
    model = copy.deepcopy(dense)
    hl.prune_loaded_model(model, hl.LayerSwapConfig(num_to_remove=2, calibration=batch, progress=False, recovery="ghosted",
                                                    objective="ghosted"))
    record = model.layerswap_report.selections[-1]
    assert record["objective"] == "ghosted" and model.config.layerswap["removed_layers"] == record["selected"]
    best, value = _brute_force(SetObjective(dense, calib, "ghosted"), 2, allowed=range(1, 5))
    assert record["selected"] == best and record["value"] == value


def test_a_spent_budget_extends_the_best_smaller_set(setup):
    """When max_evaluations runs out, budget n still grows the best set of n - 1 by one block."""
    model, calib, report = setup
    found = search_select(report, [1, 2, 3], model=model, calibration=calib, max_evaluations=6, exhaustive_below=0)
    assert found[1]["total_cost"]["evaluator_calls"] >= 6
    singles = dict(zip(range(1, 7), SetObjective(model, calib)([[i] for i in range(1, 7)])))
    for n in (2, 3):
        prev = found[n - 1]["selected"]
        assert set(prev) < set(found[n]["selected"])
        # the block added is the one whose own removal costs least, not a neighbour that comes first
        best = min((i for i in singles if i not in prev), key=lambda i: (singles[i], i))
        assert found[n]["selected"] == sorted(prev + [best])
        assert found[n]["trace"]["candidates"] == 1


class _TableObjective:
    """A set objective from an explicit table: f(S) = sum of single costs + pair penalties.
    Speaks the interface ``search_select(evaluator=...)`` uses and records what it scored."""

    def __init__(self, single, penalty):
        self.single, self.penalty = single, penalty
        self.cache, self.calls, self.scored = {}, 0, []

    def value(self, s):
        return self.cache[",".join(map(str, sorted(s)))]

    def cost(self):
        return {"evaluator_calls": self.calls, "forward_passes": 0, "block_passes": 0, "seconds": 0.0}

    def __call__(self, sets):
        for s in sets:
            key = ",".join(map(str, sorted(s)))
            if key not in self.cache:
                members = set(s)
                self.cache[key] = sum(self.single[i] for i in s) + sum(
                    v for pair, v in self.penalty.items() if pair <= members)
                self.calls += 1
                self.scored.append(sorted(s))
        return [self.value(s) for s in sets]


def test_each_budget_has_its_own_allowance_and_pairs_steer_the_prediction():
    """Blocks 3 and 4 are the cheapest alone but destructive together ({3, 4} is scored at
    n = 2). At n = 3 the second-order prediction knows that pair, so {3, 4, 5} (first by
    the additive prediction) is never tried; every budget scores at most its allowance."""
    from tests.conftest import tiny_model

    model = tiny_model("llama", num_blocks=8)
    single = {1: 0.5, 2: 0.4, 3: 0.1, 4: 0.2, 5: 0.3, 6: 0.6}
    f = _TableObjective(single, {frozenset({3, 4}): 5.0})
    found = search_select(None, [1, 2, 3, 4], model=model, calibration=None, evaluator=f, exhaustive_below=0,
                          evaluations_per_budget=3)
    assert [3, 4] in f.scored and [3, 4, 5] not in f.scored
    assert found[2]["selected"] == [3, 5] and found[2]["value"] == pytest.approx(0.4)
    assert found[3]["selected"] == [2, 3, 5] and found[3]["value"] == pytest.approx(0.8)
    calls = [found[n]["cost"]["evaluator_calls"] for n in (1, 2, 3, 4)]
    assert calls[0] == 6 and all(0 < b - a <= 3 for a, b in zip(calls, calls[1:]))
    assert found[4]["evaluations_per_budget"] == 3 and found[4]["max_evaluations"] is None


def test_the_default_allowance_is_slebs_schedule_and_never_costs_more_than_sleb(setup):
    """6 removable blocks: budget n scores at most U - (n - 1) = 6, 5, 4, 3, 2 sets (the
    protocols' own sets inside), as SLEB's step n does, so budgets 1..n together cost at
    most SLEB for n, in candidate sets and in forward passes (one reference sweep each).
    Here every budget spends its whole allowance: the counts are equal."""
    model, calib, report = setup
    report = copy.deepcopy(report)
    report.removal_kl.clear()  # no set value of an earlier test's search: every set is scored here
    found = search_select(report, [1, 2, 3, 4, 5], model=model, calibration=calib)
    assert found[5]["allowances"] == search_allowances(6, 5) == [6, 5, 4, 3, 2]
    assert found[5]["evaluations_per_budget"] is None
    calls = [found[n]["cost"]["evaluator_calls"] for n in range(1, 6)]
    assert calls == [6, 11, 15, 18, 20]
    assert [found[n]["cost"]["forward_passes"] for n in range(1, 6)] == [c + 1 for c in calls]
    slebs = sleb(model, calib, [1, 2, 3, 4, 5])
    for n in range(1, 6):
        assert found[n]["cost"]["evaluator_calls"] <= slebs[n].evaluator_calls == sum(6 - k for k in range(n))
        assert found[n]["cost"]["forward_passes"] <= slebs[n].forward_passes
    # budget 2 scores every protocol's own pair inside the allowance, its value in the record;
    # a later budget's own set only where the prediction ranks it in (else its value is None)
    assert all(e is None or e["value"] is not None for e in found[2]["protocol_sets"].values())
    f = SetObjective(model, calib, "removal_kl")
    for n in range(2, 6):
        for e in found[n]["protocol_sets"].values():
            if e is not None:
                assert e["value"] in (None, f([e["set"]])[0]) and found[n]["value"] <= f([e["set"]])[0]


def test_an_exhaustive_budget_stays_within_what_budgets_one_to_n_may_spend():
    """5 removable blocks. By default budget 2's 10 sets are not all scored (5 + 10 would pass
    SLEB's 5 + 4): each budget scores its U - (n - 1). With 10 sets a budget, budgets 2, 3, 4
    and 5 fit (10, 10, 5 and 1 sets) and are scored exhaustively, their allowances raised."""
    from tests.conftest import tiny_model

    model = tiny_model("llama", num_blocks=7)
    f = _TableObjective({i: 0.1 * i for i in range(1, 6)}, {})
    found = search_select(None, [1, 2, 3, 4, 5], model=model, calibration=None, evaluator=f)
    assert [found[n]["cost"]["evaluator_calls"] for n in range(1, 6)] == [5, 9, 12, 14, 15]
    assert found[5]["allowances"] == [5, 4, 3, 2, 1]
    f = _TableObjective({i: 0.1 * i for i in range(1, 6)}, {})
    found = search_select(None, [1, 2, 3, 4, 5], model=model, calibration=None, evaluator=f, evaluations_per_budget=10)
    assert [found[n]["cost"]["evaluator_calls"] for n in range(1, 6)] == [5, 15, 25, 30, 31]
    assert found[5]["allowances"] == [5, 10, 10, 10, 10] and found[2]["selected"] == [1, 2]


def test_search_allowances_refuses_bad_input():
    assert search_allowances(28, 6) == [28, 27, 26, 25, 24, 23] and sum(search_allowances(28, 6)) == 153
    assert search_allowances(16, 3, evaluations_per_budget=4) == [16, 4, 4]
    with pytest.raises(ValueError, match="evaluations_per_budget=0"):
        search_allowances(16, 3, evaluations_per_budget=0)
    with pytest.raises(ValueError, match="removable=4, top=5"):
        search_allowances(4, 5)


def test_select_layers_refuses_an_option_the_strategy_does_not_take_and_sets_the_search_budget(setup):
    """select_layers(..., strategy="search", num_prompts=4) used to fail inside the search
    with a TypeError naming an internal function; now the option is refused up front,
    naming it and what the strategy accepts, and the search's budget is set through it."""
    model, calib, report = setup
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(TypeError, match=r"strategy='search' does not take the option\(s\) \['num_prompts'\]: it "
                       r"accepts \[.*'evaluations_per_budget'.*'max_evaluations'.*\]"):
        hl.select_layers(report, 2, strategy="search", model=model, calibration=calib, num_prompts=4)
    with pytest.raises(TypeError, match=r"strategy='greedy' does not take the option\(s\) \['max_evaluations'\]: it "
                       r"takes no options"):
        hl.select_layers(report, 2, max_evaluations=5)
    with pytest.raises(TypeError, match=r"strategy='sleb' does not take the option\(s\) \['width'\]: it accepts "
                       r"\['resume'\]"):
        hl.select_layers(report, 2, strategy="sleb", model=model, calibration=calib, width=2)
    handle.remove()
    assert calls == []
    # the budget: 6 removable blocks; budget 1 scores the sweep (6 sets), budget 2 at most 2 sets,
    # the protocols' greedy pairs included (exhaustive_below=0: else its 15 sets, fewer than the
    # local search's 24, would be scored had they fit)
    before = len(report.selections)
    chosen = hl.select_layers(report, 2, strategy="search", model=model, calibration=calib, evaluations_per_budget=2,
                              exhaustive_below=0)
    record = report.selections[-1]
    assert len(report.selections) == before + 1 and record["selected"] == chosen
    pairs = {tuple(e["set"]) for e in record["protocol_sets"].values()}
    assert len(pairs) == 2 and record["evaluations_per_budget"] == 2
    assert record["total_cost"]["evaluator_calls"] == 6 + 2
    hl.select_layers(report, 2, strategy="search", model=model, calibration=calib, max_evaluations=7,
                     exhaustive_below=0)
    assert report.selections[-1]["total_cost"]["evaluator_calls"] == 7


# ----------------------------------------------------------- the progress bar


def test_the_search_bar_shows_the_block_passes_of_each_batch_of_sets(progress_bars, matrix_llama, matrix_tokenizer):
    calib = hl.build_calibration(PARAGRAPHS, matrix_tokenizer, num_prompts=6, seq_len=24)
    hl.search_select(None, 2, model=matrix_llama, calibration=calib, max_evaluations=12, batch_size=2, progress=True)
    sets = [b for b in progress_bars if b.desc.startswith("removal-set search")]
    inner = [b for b in progress_bars if b.desc == "removal KL of the candidate sets"]
    assert len(sets) == 1 and inner
    for bar in inner:  # each call of the objective: its own bar, moving per forward pass
        assert sum(bar.updates) == bar.total and max(bar.updates) <= 6
    assert sum(len(b.updates) for b in inner) > 3 * len(sets[0].updates)


def test_prune_gives_the_search_engines_the_users_budget(monkeypatch):
    """``prune(..., max_memory="16MiB")``: the scoring engine, the search's engine calls and
    its kept reference share that one budget (they took the device's 1 GiB each before)."""
    from hf_layerswap.scoring.engine import Engine
    from hf_layerswap.scoring.reference import ReferenceCache
    from conftest import tiny_batch, tiny_model

    engines, caches = [], []
    engine_init, cache_init = Engine.__init__, ReferenceCache.__init__

    def record_engine(self, *args, **kwargs):
        engine_init(self, *args, **kwargs)
        engines.append((self.desc, self.budget, self.budget_source))

    def record_cache(self, max_bytes):
        cache_init(self, max_bytes)
        caches.append(max_bytes)

    monkeypatch.setattr(Engine, "__init__", record_engine)
    monkeypatch.setattr(ReferenceCache, "__init__", record_cache)
    cfg = hl.LayerSwapConfig(num_to_remove=2, calibration=tiny_batch(), num_prompts=3, progress=False)
    hl.prune(tiny_model("llama"), cfg, max_memory="16MiB")
    scoring = [b for desc, b, _ in engines if desc == "swap-KL probes"]
    search = [(b, source) for desc, b, source in engines if desc == "removal KL of the candidate sets"]
    assert scoring == [16 << 20]
    assert search and {b for b, _ in search} == {8 << 20}
    assert all(source.startswith("given") for _, source in search)
    assert caches == [8 << 20]  # the kept reference: the other half


def test_set_objective_splits_its_budget_between_the_reference_and_the_engine(setup):
    model, calib, _ = setup
    f = SetObjective(model, calib, max_memory="64MiB")
    assert f.reference.max_bytes == 32 << 20 and f.engine_memory.bytes == 32 << 20
    given = SetObjective(model, calib, max_memory="64MiB", reference_memory="16MiB")
    assert given.reference.max_bytes == 16 << 20 and given.engine_memory.bytes == 48 << 20
    with pytest.raises(ValueError, match="max_memory='lots'"):
        SetObjective(model, calib, max_memory="lots")


# ------------------------------------------- the exhaustive optimum at SLEB's cost


@pytest.mark.parametrize("family, calibration_seed", [("llama", 3), ("gemma3", 2)])
def test_search_reaches_the_exhaustive_optimum_at_no_more_sets_than_sleb(family, calibration_seed):
    """8 blocks, 6 removable: at n = 2 and 3 the search's set is the best of all 15 pairs
    and all 20 triples (the same objective on the same prompts), found with at most the
    candidate sets SLEB scores for n (11 and 15). Before the pair model and the ranked
    proposals, it picked {4, 5, 6} on the Llama at n = 3 (5.5% above the optimum) and
    {5, 6} on the Gemma-3 at n = 2 (1.2% above)."""
    from tests.conftest import tiny_batch, tiny_model

    model = tiny_model(family, num_blocks=8)
    batch = tiny_batch(batch=6, length=16, seed=calibration_seed)
    calib = CalibrationSet(batch["input_ids"], batch["attention_mask"], "tensors")
    report = hl.score_layers(model, calib, progress=False)
    brute = SetObjective(model, calib, "removal_kl")
    for n in (2, 3):
        chosen = hl.select_layers(report, n, strategy="search", model=model, calibration=calib)
        record = report.selections[-1]
        best, value = _brute_force(brute, n)
        assert chosen == record["selected"] == best and record["value"] == value, (family, n)
        calls = record["total_cost"]["evaluator_calls"]
        assert calls <= sleb(model, calib, n).evaluator_calls == sum(6 - k for k in range(n)), (family, n)


def test_search_reaches_the_exhaustive_optimum_of_the_eight_block_setup_at_slebs_cost(setup):
    """tests/test_search.py's 8-block Llama: the optimum at n = 2, 3 and 4 within SLEB's
    count (before: {3, 4, 5} at n = 3, 6.2% above {2, 3, 5}; {1, 3, 4, 5} at n = 4, 11.5% above)."""
    model, calib, report = setup
    found = search_select(report, [1, 2, 3, 4], model=model, calibration=calib)
    brute = SetObjective(model, calib, "removal_kl")
    for n in (2, 3, 4):
        best, value = _brute_force(brute, n)
        assert found[n]["selected"] == best and found[n]["value"] == value, n
        assert found[n]["cost"]["evaluator_calls"] <= sum(6 - k for k in range(n))
    assert found[3]["selected"] == [2, 3, 5]


def test_a_search_takes_the_set_values_its_report_holds_from_the_same_prompts(setup):
    """Values an earlier search measured on the report's own prompts (report.removal_kl) are
    taken, not scored again: a search given them decides exactly as one that scored them (the
    same set, value, trace and evaluator calls) with no pass for them; on other prompts (or
    another objective) nothing is taken."""
    model, calib, report = setup
    report = copy.deepcopy(report)
    fresh = search_select(report, [1, 2, 3], model=model, calibration=calib, evaluations_per_budget=4)
    first = SetObjective(model, calib)
    search_select(report, [1, 2, 3], model=model, calibration=calib, evaluations_per_budget=4, evaluator=first)
    report.removal_kl.update(first.cache)
    again = search_select(report, [1, 2, 3], model=model, calibration=calib, evaluations_per_budget=4)
    for n in (1, 2, 3):
        assert again[n]["selected"] == fresh[n]["selected"] and again[n]["value"] == fresh[n]["value"]
        assert again[n]["trace"] == fresh[n]["trace"]
    cost = again[3]["total_cost"]
    assert cost["evaluator_calls"] == fresh[3]["total_cost"]["evaluator_calls"] == cost["reused"] == len(first.cache)
    assert cost["forward_passes"] == cost["block_passes"] == cost["head_passes"] == 0
    # a value only the report holds is what the search reads: proof it was taken, not measured
    report.removal_kl[again[1]["selected"][0].__str__()] = -1.0
    assert search_select(report, 1, model=model, calibration=calib)[1]["value"] == -1.0
    other = CalibrationSet(calib.input_ids[:5].clone(), calib.attention_mask[:5].clone(), "five of the prompts")
    elsewhere = search_select(report, 1, model=model, calibration=other)[1]
    assert elsewhere["total_cost"]["reused"] == 0 and elsewhere["value"] >= 0
    assert search_select(report, 1, model=model, calibration=calib, objective="nll")[1]["total_cost"]["reused"] == 0


def test_a_prune_on_other_prompts_than_its_reports_records_no_set_value_in_it(setup):
    """The search's set values go into report.removal_kl only when they were measured on the
    report's own prompts (its calibration content hash), so a later search never takes a value
    of other prompts."""
    model, calib, report = setup
    other = CalibrationSet(calib.input_ids[:5].clone(), calib.attention_mask[:5].clone(), "five of the prompts")
    for prompts, recorded in ((other, False), (calib, True)):
        given = copy.deepcopy(report)
        given.removal_kl.clear()  # what earlier tests' prunes recorded in the shared report
        hl.prune(copy.deepcopy(model), hl.LayerSwapConfig(num_to_remove=2, strategy="search"), report=given,
                 calibration=prompts)
        assert bool(given.removal_kl) is recorded
        assert given.selections[-1]["strategy"] == "search"


def test_a_search_takes_no_set_value_of_a_report_of_another_model_on_the_same_prompts(setup):
    """A report's set values are taken only when it was scored on this model: a report of
    another model of the same depth (its fingerprint differs) on the same prompts gives its
    layer scores as candidates, but every set is scored on this model."""
    model, calib, report = setup
    given = copy.deepcopy(report)
    given.removal_kl.clear()
    mine = SetObjective(model, calib)
    search_select(given, [1, 2], model=model, calibration=calib, evaluations_per_budget=3, evaluator=mine)
    given.removal_kl.update(mine.cache)  # the values of `model`, on `calib`
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    blank = copy.deepcopy(given)
    blank.removal_kl.clear()
    fresh = search_select(blank, [1, 2], model=other, calibration=calib, evaluations_per_budget=3)
    found = search_select(given, [1, 2], model=other, calibration=calib, evaluations_per_budget=3)
    assert found[2]["total_cost"]["reused"] == 0
    assert found[2]["total_cost"]["forward_passes"] == fresh[2]["total_cost"]["forward_passes"] > 0
    for n in (1, 2):
        assert found[n]["selected"] == fresh[n]["selected"] and found[n]["value"] == fresh[n]["value"]
    assert found[1]["value"] != given.removal_kl[str(found[1]["selected"][0])]  # not model's value


def test_set_values_taken_from_a_report_survive_its_json_round_trip(setup, tmp_path):
    """A report written and read back (SwapReport.to_json / from_json) keeps its calibration
    content hash and its model's fingerprint, so a search on it takes the same values and
    decides as on the report in memory."""
    model, calib, report = setup
    given = copy.deepcopy(report)
    given.removal_kl.clear()
    first = SetObjective(model, calib)
    search_select(given, [1, 2], model=model, calibration=calib, evaluations_per_budget=3, evaluator=first)
    given.removal_kl.update(first.cache)
    loaded = hl.SwapReport.from_json(given.to_json(tmp_path / "report.json"))
    in_memory = search_select(given, [1, 2], model=model, calibration=calib, evaluations_per_budget=3)
    again = search_select(loaded, [1, 2], model=model, calibration=calib, evaluations_per_budget=3)
    assert again[2]["total_cost"]["reused"] == in_memory[2]["total_cost"]["reused"] == len(first.cache)
    assert again[2]["total_cost"]["forward_passes"] == 0
    for n in (1, 2):
        assert again[n]["selected"] == in_memory[n]["selected"] and again[n]["value"] == in_memory[n]["value"]


def test_auto_on_other_prompts_than_its_reports_neither_takes_nor_records_their_set_values(setup):
    """protocol='auto' compares its two greedy sets (here {4, 6} and {3, 6} at n = 2) on the
    calibration it is given: on other prompts than the report's it neither reads the report's
    values (measured on the report's prompts) nor writes its own into the report, where a
    later search on the report's prompts would take them as theirs."""
    model, calib, report = setup
    other = CalibrationSet(calib.input_ids[:5].clone(), calib.attention_mask[:5].clone(), "five of the prompts")
    sets = [[3, 6], [4, 6]]
    on_calib = dict(zip(("3,6", "4,6"), SetObjective(model, calib)(sets)))
    on_other = dict(zip(("3,6", "4,6"), SetObjective(model, other)(sets)))
    assert on_calib != on_other
    given = copy.deepcopy(report)
    given.removal_kl.clear()
    hl.select_layers(given, 2, protocol="auto", model=model, calibration=other)
    record = given.selections[-1]
    assert record["removal_kl"] == pytest.approx({"interchange": on_other["4,6"], "replacement": on_other["3,6"]})
    assert given.removal_kl == {}
    found = search_select(given, 2, model=model, calibration=calib)[2]
    assert found["protocol_sets"]["interchange"]["value"] == pytest.approx(on_calib["4,6"])
    # the report's own values (of its prompts) are not compared on other prompts
    given.removal_kl.update(on_calib)
    hl.select_layers(given, 2, protocol="auto", model=model, calibration=other)
    assert given.selections[-1]["removal_kl"] == pytest.approx({"interchange": on_other["4,6"],
                                                                "replacement": on_other["3,6"]})
    assert given.removal_kl == on_calib
    # on the report's own prompts the values are recorded, and taken the next time
    given.removal_kl.clear()
    hl.select_layers(given, 2, protocol="auto", model=model, calibration=calib)
    assert given.removal_kl == pytest.approx(on_calib)


def test_swap_guided_auto_with_a_report_of_other_prompts_leaves_its_set_values_alone(setup):
    """The comparison harness's auto criterion (swap_guided) given a report scored on other
    prompts values both greedy sets on its own prompts and writes none into that report."""
    from hf_layerswap.selection.greedy import swap_guided

    model, calib, report = setup
    other = CalibrationSet(calib.input_ids[:5].clone(), calib.attention_mask[:5].clone(), "five of the prompts")
    on_calib = dict(zip(("3,6", "4,6"), SetObjective(model, calib)([[3, 6], [4, 6]])))
    on_other = SetObjective(model, other)([[3, 6], [4, 6]])
    given = copy.deepcopy(report)
    given.removal_kl.clear()
    given.removal_kl.update(on_calib)
    result = swap_guided(model, other, 2, protocol="auto", report=given)
    assert result.details["removal_kl"] == pytest.approx({"replacement": on_other[0], "interchange": on_other[1]})
    assert given.removal_kl == on_calib


def test_the_cards_count_of_candidate_sets_says_how_many_were_valued_by_an_earlier_search(setup):
    """The card's reason counts the candidate sets and forward passes of the search; sets whose
    values were taken from the report (no pass) are said to be, so "N candidate sets, 0 forward
    passes" does not read as N sets scored without a pass."""
    from hf_layerswap.selection.registry import strategy_entry

    model, calib, report = setup
    given = copy.deepcopy(report)
    given.removal_kl.clear()
    first = SetObjective(model, calib)
    search_select(given, 2, model=model, calibration=calib, evaluations_per_budget=3, evaluator=first)
    card = strategy_entry("search").card_candidates
    fresh = search_select(given, 2, model=model, calibration=calib, evaluations_per_budget=3)[2]
    _, reason = card(fresh, given, fresh["selected"], str, str)
    calls, passes = fresh["cost"]["evaluator_calls"], fresh["cost"]["forward_passes"]
    assert f"({calls} candidate sets, {passes} forward passes)" in reason and passes > 0
    given.removal_kl.update(first.cache)
    again = search_select(given, 2, model=model, calibration=calib, evaluations_per_budget=3)[2]
    _, reason = card(again, given, again["selected"], str, str)
    assert again["cost"]["reused"] == calls == len(first.cache)
    assert (f"({calls} candidate sets, {calls} of them valued by an earlier search on the same prompts and model, "
            "with no pass, 0 forward passes)") in reason


def test_the_search_criterion_scores_every_set_whatever_values_its_report_holds(setup):
    """The comparison harness's search criterion measures its own cost: set values another
    criterion recorded in the shared report (same prompts, same model) are not taken, so its
    forward passes and calls are those of a search on a report that holds none."""
    from hf_layerswap.selection.search import search_criterion

    model, calib, report = setup
    clean = copy.deepcopy(report)
    clean.removal_kl.clear()
    alone = search_criterion(model, calib, 2, report=clean)
    held = copy.deepcopy(clean)
    earlier = SetObjective(model, calib)
    search_select(held, [1, 2], model=model, calibration=calib, evaluator=earlier)
    held.removal_kl.update(earlier.cache)
    shared = search_criterion(model, calib, 2, report=held)
    assert shared.details["search_cost"]["reused"] == 0
    assert shared.forward_passes == alone.forward_passes > 0
    assert shared.details["search_cost"]["forward_passes"] == alone.details["search_cost"]["forward_passes"]
    assert shared.removed == alone.removed and held.removal_kl == earlier.cache
