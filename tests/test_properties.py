"""Property tests (hypothesis) on tiny models: any plan restores the model exactly, removal
commutes with save/reload, selection respects spacing and protection, and the removal KL
of the empty set is 0. Example counts are small and derandomized (same examples in CI)."""

from __future__ import annotations

import ast
import copy
import functools
import math
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arch_matrix import FAMILIES, NUM_BLOCKS, build, prompts, single_thread
from hf_layerswap import build_calibration, remove_layers
from hf_layerswap.layerplan import apply_plan, decoder_blocks
from hf_layerswap.scoring import plan_kl, removal_kl
from hf_layerswap.scoring.rule import NonFiniteScoresError, greedy_select, resolve_protect

PROPERTY = settings(
    max_examples=20, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@functools.lru_cache(maxsize=None)
def _model_and_reference():
    """Qwen3 tiny (interleaved sliding/full layer_types) and its untouched state."""
    model = build("qwen3")
    batch = prompts()
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
    reference = {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "config": copy.deepcopy(model.config.to_dict()),
        "blocks": list(decoder_blocks(model)[2]),
        "layer_idx": [m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)],
        "logits": logits,
    }
    return model, batch, reference


def _assert_restored(model, batch, ref):
    assert list(decoder_blocks(model)[2]) == ref["blocks"]
    assert model.config.to_dict() == ref["config"]
    assert [m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)] == ref["layer_idx"]
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref["state"].items())
    with torch.no_grad():
        assert torch.equal(model(**batch, use_cache=False).logits, ref["logits"])


class _Boom(Exception):
    pass


plans = st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=NUM_BLOCKS + 2)


@PROPERTY
@given(plan=plans, fail_inside=st.booleans())
def test_any_plan_restores_the_model_exactly(plan, fail_inside):
    model, batch, ref = _model_and_reference()
    try:
        with torch.no_grad(), apply_plan(model, plan):
            out = model(**batch, use_cache=False).logits
            assert out.shape == ref["logits"].shape and bool(torch.isfinite(out).all())
            if plan == list(range(NUM_BLOCKS)):
                assert torch.equal(out, ref["logits"])
            if fail_inside:
                raise _Boom
    except _Boom:
        pass
    _assert_restored(model, batch, ref)


@PROPERTY
@given(probes=st.lists(plans, min_size=1, max_size=3))
def test_plan_kl_restores_the_model_exactly_and_identity_costs_nothing(probes):
    model, batch, ref = _model_and_reference()
    named = dict(enumerate(probes))
    named["identity"] = list(range(NUM_BLOCKS))
    values, _ = plan_kl(model, build_calibration(batch), named, batch_size=1)
    assert torch.equal(values["identity"], torch.zeros(2, dtype=torch.float64))
    for key, plan in enumerate(probes):
        assert values[key].shape == (2,) and bool((values[key] >= 0).all())
    _assert_restored(model, batch, ref)


@settings(PROPERTY, max_examples=15)
@given(
    family=st.sampled_from([f.name for f in FAMILIES]),
    removed=st.sets(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=NUM_BLOCKS - 1),
)
def test_removal_commutes_with_save_and_reload(family, removed):
    from transformers import AutoConfig, AutoModelForCausalLM

    removed = sorted(removed)
    kept = [i for i in range(NUM_BLOCKS) if i not in removed]
    batch = prompts()
    base = build(family)
    pruned = remove_layers(build(family), removed)
    with tempfile.TemporaryDirectory() as tmp:
        pruned.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
        assert type(reloaded) is type(pruned)
        assert AutoConfig.from_pretrained(tmp).to_dict()["layerswap"]["kept_layers"] == kept
    with torch.no_grad():
        direct = pruned(**batch, use_cache=False).logits
        assert torch.equal(reloaded(**batch, use_cache=False).logits, direct)
        # removal is the removal plan made permanent
        with apply_plan(base, kept):
            planned = base(**batch, use_cache=False).logits
    torch.testing.assert_close(direct, planned, rtol=0, atol=1e-6)


score_values = st.one_of(
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False), st.just(math.inf), st.just(math.nan)
)


@settings(PROPERTY, max_examples=25)
@given(scores=st.lists(score_values, min_size=2, max_size=12), data=st.data())
def test_selection_respects_spacing_protection_and_the_greedy_order(scores, data):
    total = len(scores)
    n = data.draw(st.integers(1, total - 1), label="n")
    spacing = data.draw(st.integers(0, 3), label="spacing")
    protect = data.draw(st.lists(st.integers(-total, total - 1), max_size=3), label="protect")
    protected = resolve_protect(protect, total)
    assert protected == {p % total for p in protect}
    eligible = {i for i in range(total) if i not in protected and math.isfinite(scores[i])}
    try:
        chosen = greedy_select(scores, n, spacing=spacing, protect=protect)
    except NonFiniteScoresError as err:
        # only non-finite scores could fill the budget: refused, naming them, never taken
        assert f"cannot select {n} layers of {total} with finite scores" in str(err)
        assert err.nonfinite and not any(math.isfinite(v) for v in err.nonfinite.values())
        assert len(eligible) < n
        return
    except ValueError as err:
        # the message names what the rule could take; that partial set obeys the rules and
        # cannot be extended (fewer than n layers can be taken greedily)
        text = str(err)
        assert f"cannot select {n} layers of {total} with spacing={spacing}" in text
        if "the rules allow at most" in text:
            # refused before looking at scores: the stated maximum is the largest spaced
            # set of unprotected blocks (checked by brute force) and it is below n
            free = [i for i in range(total) if i not in protected]
            most = max(len(c) for c in (
                [b for k, b in enumerate(free) if mask >> k & 1] for mask in range(1 << len(free)))
                if all(b - a > spacing for a, b in zip(c, c[1:])))
            assert f"the rules allow at most {most};" in text and most < n
            return
        found = text[text.index("found only") :]
        partial = ast.literal_eval(found[found.index("(") + 1 : found.index(")")])
        assert len(partial) < n and set(partial) <= eligible
        assert all(any(abs(u - c) <= spacing for c in partial) for u in eligible - set(partial))
        return
    assert chosen == sorted(set(chosen)) and len(chosen) == n
    assert set(chosen) <= eligible  # never protected, never non-finite
    assert all(abs(a - b) > spacing for a in chosen for b in chosen if a != b)
    # greedy order: an unchosen layer scoring strictly below a chosen one was blocked by spacing
    worst = max(scores[c] for c in chosen)
    for u in eligible - set(chosen):
        if scores[u] < worst:
            assert any(abs(u - c) <= spacing for c in chosen)


@settings(PROPERTY, max_examples=15)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    removed=st.sets(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=NUM_BLOCKS - 1),
)
def test_removal_kl_of_the_empty_set_is_zero(seed, lengths, removed):
    model, _, _ = _model_and_reference()
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 120, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    batch = {"input_ids": ids * mask, "attention_mask": mask}
    empty, some = removal_kl(model, batch, [[], sorted(removed)], batch_size=2)
    assert empty == 0.0
    assert some > 0.0 and math.isfinite(some)
