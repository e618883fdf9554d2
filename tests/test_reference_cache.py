"""The dense reference computed once per calibration batch across evaluator calls."""

from __future__ import annotations

import pytest
import torch

from hf_layerswap.scoring import plan_kl
from hf_layerswap.scoring.reference import ReferenceCache
from hf_layerswap.selection import search_select
from hf_layerswap.selection.objectives import OBJECTIVES, SetObjective
from conftest import eight_block_search_setup


@pytest.fixture(scope="module")
def setup():
    """tests/test_search.py's 8-block random Llama and its six prompts."""
    return eight_block_search_setup()


def test_search_reuses_one_reference_sweep_and_selects_bit_identical_sets(setup):
    """The search with the kept reference selects the sets, with bit-identical values
    (float.hex), that the same search gets when the reference is recomputed in every call,
    with one reference sweep in all: 22 candidates + 1 model calls (an allowance of 8 sets
    a budget). The recomputing search sweeps the reference once per call of the objective."""
    model, calib, report = setup
    options = {"model": model, "calibration": calib, "exhaustive_below": 0, "evaluations_per_budget": 8}
    calls, blocks = [], []
    handles = [model.model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))]
    handles += [blk.register_forward_hook(lambda *_: blocks.append(1)) for blk in model.model.layers]
    try:
        found = search_select(report, [1, 2, 3], **options)
    finally:
        for h in handles:
            h.remove()
    fresh = SetObjective(model, calib, "removal_kl", reference_memory=0)
    recomputed = search_select(report, [1, 2, 3], evaluator=fresh, **options)
    assert [found[n]["selected"] for n in (1, 2, 3)] == [recomputed[n]["selected"] for n in (1, 2, 3)]
    assert [float(found[n]["value"]).hex() for n in (1, 2, 3)] == [
        float(recomputed[n]["value"]).hex() for n in (1, 2, 3)]
    assert fresh.reference.bytes == 0
    cost = found[3]["total_cost"]
    assert (cost["evaluator_calls"], cost["forward_passes"], cost["block_passes"], cost["reference_passes"]) == (
        22, 23, 69, 1)
    assert len(calls) == 23 and len(blocks) == 69  # one batch: block passes are the hooks' count
    # 5 calls of the objective: the sweep and two rounds at each of n = 2 and 3; the
    # reference's head runs again in each, and the recomputing search sweeps it in each
    rounds = 1 + sum(len(found[n]["trace"]["rounds"]) for n in (2, 3))
    assert rounds == 5 and cost["head_passes"] == 22 + rounds
    again = recomputed[3]["total_cost"]
    assert again["evaluator_calls"] == 22 and again["reference_passes"] == rounds
    assert again["block_passes"] == 69 + 8 * (rounds - 1)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_objective_equals_its_recomputed_reference(setup, objective):
    """Kept (default budget) vs recomputed (budget 0) reference: equal values in every
    call; one reference sweep in all vs one per call (ghosted: plus its operator fit)."""
    model, calib, _ = setup
    kept = SetObjective(model, calib, objective, batch_size=4)
    fresh = SetObjective(model, calib, objective, batch_size=4, reference_memory=0)
    rounds = [[[1], [2, 3]], [[5], [3, 5, 6]], [[1, 6], [4]]]
    for sets in rounds:
        assert kept(sets) == fresh(sets)
    fit = 0 if objective in ("removal_kl", "nll") else 1  # a repair objective fits its operators once
    assert kept.reference_passes == 1 + fit and fresh.reference_passes == len(rounds) + fit
    assert kept.reference.misses == 2 and kept.reference.hits == 2 * (len(rounds) - 1)
    assert fresh.reference.bytes == 0 and kept.reference.bytes > 0
    assert fresh.forward_passes - kept.forward_passes == len(rounds) - 1
    assert fresh.block_passes - kept.block_passes == 8 * (len(rounds) - 1)


def test_a_budget_for_one_batch_keeps_one_and_recomputes_the_other(setup):
    """Two batches of three prompts, room for one entry: the first is kept, the second is
    swept again each call (a partial sweep counts as one), values unchanged."""
    model, calib, _ = setup
    probe = SetObjective(model, calib, batch_size=3)
    probe([[2]])
    first = next(iter(probe.reference.entries.values()))
    one_entry = sum(t.numel() * t.element_size() for t in first[0].values()) + first[1].numel() * first[1].element_size()
    tight = SetObjective(model, calib, batch_size=3, reference_memory=one_entry + 1024)
    loose = SetObjective(model, calib, batch_size=3)
    for sets in ([[2]], [[4], [2, 5]], [[6]]):
        assert tight(sets) == loose(sets)
    assert len(tight.reference.entries) == 1 and len(loose.reference.entries) == 2
    assert tight.reference.misses == 4 and loose.reference.misses == 2
    assert tight.reference_passes == 3 and loose.reference_passes == 1


def test_plan_kl_reports_its_reference_passes(setup):
    model, calib, _ = setup
    cache = ReferenceCache(1 << 30)
    plans = {"drop3": [0, 1, 2, 4, 5, 6, 7]}
    first, stats1 = plan_kl(model, calib, plans, batch_size=4, reference_cache=cache)
    again, stats2 = plan_kl(model, calib, plans, batch_size=4, reference_cache=cache)
    plain, stats3 = plan_kl(model, calib, plans, batch_size=4)
    assert (stats1["reference_passes"], stats2["reference_passes"], stats3["reference_passes"]) == (2, 0, 2)
    assert torch.equal(first["drop3"], again["drop3"]) and torch.equal(first["drop3"], plain["drop3"])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GB"])
def test_reference_cache_refuses_a_bad_budget(bad):
    with pytest.raises(ValueError, match="max_bytes=.*int >= 0"):
        ReferenceCache(bad)
