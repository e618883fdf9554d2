"""Swap-KL scoring: the masked KL against a hand computation, the probes' symmetries
(identity exactly 0, interchange symmetric, replacement not), prefix reuse equal to a full
forward, right padding changing no value, and a model left exactly as it was after scoring,
also when a probe raises; non-finite KL kept as a result (warned with the first broken
batch), bad indices refused by the removal KL, and the progress bar's block passes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from arch_matrix import NUM_BLOCKS, build, prompts
from conftest import (
    NONFINITE_ADVICE,
    assert_model_unchanged,
    overflowing_model,
    snapshot_model,
    tiny_batch,
    tiny_model,
)

import hf_layerswap as hl
from hf_layerswap import NonFiniteScoresError, SwapReport, score_layers, select_layers
from hf_layerswap.calibration import build_calibration
from hf_layerswap.layerplan import (
    apply_plan,
    capture_residual_stream,
    decoder_blocks,
    identity_plan,
    interchange_plan,
    model_fingerprint,
    replacement_plan,
)
from hf_layerswap.scoring import masked_kl, plan_kl, removal_kl


# ---------------------------------------------------------------- hand-checkable KL
def test_masked_kl_matches_hand_computation():
    # two prompts, 3 positions, vocab 2; second prompt has one padding position
    ref_logits = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], [[0.0, 1.0], [3.0, 0.0], [9.0, 9.0]]])
    mod_logits = torch.tensor([[[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0], [-5.0, 5.0]]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    def kl(p_logits, q_logits):
        p = [math.exp(x) / sum(math.exp(y) for y in p_logits) for x in p_logits]
        q = [math.exp(x) / sum(math.exp(y) for y in q_logits) for x in q_logits]
        return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))

    expected0 = sum(kl(ref_logits[0, t].tolist(), mod_logits[0, t].tolist()) for t in range(3)) / 3
    expected1 = sum(kl(ref_logits[1, t].tolist(), mod_logits[1, t].tolist()) for t in range(2)) / 2
    got = masked_kl(torch.log_softmax(ref_logits, -1), mod_logits, mask)
    assert got.dtype == torch.float64
    assert got[0].item() == pytest.approx(expected0, rel=1e-6)
    assert got[1].item() == pytest.approx(expected1, rel=1e-6)
    # position 0 of prompt 1 is identical: contributes exactly 0
    assert masked_kl(torch.log_softmax(ref_logits, -1), ref_logits, mask).tolist() == [0.0, 0.0]


def test_masked_kl_rejects_all_padding_prompt():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="all padding"):
        masked_kl(x, x, torch.tensor([[1, 1, 0], [0, 0, 0]]))


def test_identity_plan_gives_exactly_zero_and_probe_symmetries():
    model = tiny_model("llama")
    calib = build_calibration(tiny_batch())
    plans = {
        "identity": identity_plan(6),
        "inter_23": interchange_plan(6, 2, 3),
        "inter_32": interchange_plan(6, 3, 2),
        "repl_2<-3": replacement_plan(6, 2, 3),
        "repl_3<-2": replacement_plan(6, 3, 2),
    }
    assert plans["inter_23"] == plans["inter_32"] == [0, 1, 3, 2, 4, 5]
    assert plans["repl_2<-3"] == [0, 1, 3, 3, 4, 5] and plans["repl_3<-2"] == [0, 1, 2, 2, 4, 5]
    values, stats = plan_kl(model, calib, plans)
    assert values["identity"].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(values["inter_23"], values["inter_32"])
    assert not torch.equal(values["repl_2<-3"], values["repl_3<-2"])
    assert all(bool((v > 0).all()) for k, v in values.items() if k != "identity")
    assert stats["forward_passes"] == 1 + len(plans)


def test_prefix_reuse_equals_full_forward():
    model = tiny_model("gemma3")
    batch = tiny_batch()
    streams, _ = capture_residual_stream(model, **batch)
    plan = replacement_plan(6, 3, 4)
    with torch.no_grad():
        with apply_plan(model, plan):
            full = model(**batch, use_cache=False).logits
        with apply_plan(model, plan, start=3, start_hidden=streams[3]):
            reused = model(**batch, use_cache=False).logits
    assert torch.equal(full, reused)


def test_right_padding_changes_no_kl():
    model = tiny_model("qwen3")
    batch = tiny_batch(batch=2, length=10, pad_last=0)
    # the same prompts, each right-padded with 5 extra pad tokens
    padded = {
        "input_ids": torch.cat([batch["input_ids"], torch.zeros(2, 5, dtype=torch.long)], dim=1),
        "attention_mask": torch.cat([batch["attention_mask"], torch.zeros(2, 5, dtype=torch.long)], dim=1),
    }
    # and one prompt padded because its neighbour in the batch is longer
    short = {"input_ids": batch["input_ids"][:1, :6], "attention_mask": batch["attention_mask"][:1, :6]}
    mixed = {
        "input_ids": torch.cat([padded["input_ids"][:1, :10].clone(), batch["input_ids"][1:]]),
        "attention_mask": torch.cat([torch.tensor([[1] * 6 + [0] * 4]), batch["attention_mask"][1:]]),
    }
    a = hl.score_layers(model, batch, progress=False)
    b = hl.score_layers(model, padded, progress=False)
    for pa, pb in zip(a.pairs, b.pairs):
        assert (pa.replacement_ij, pa.replacement_ji, pa.interchange) == (pb.replacement_ij, pb.replacement_ji, pb.interchange)
    plans = {"x": interchange_plan(6, 2, 3)}
    alone, _ = plan_kl(model, build_calibration(short), plans)
    together, _ = plan_kl(model, build_calibration(mixed), plans)
    # batch shape changes GEMM summation order: equal up to float32 rounding of the logits
    assert together["x"][0].item() == pytest.approx(alone["x"][0].item(), rel=1e-4)


def test_plan_restored_after_a_probe_raises():
    model = tiny_model("gemma3")
    before = snapshot_model(model)
    _, _, blocks = decoder_blocks(model)
    calls = {"n": 0}

    def explode(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] > 8:  # let the reference pass through, fail inside a probe
            raise RuntimeError("boom")

    handle = blocks[4].register_forward_pre_hook(explode, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        hl.score_layers(model, tiny_batch(), progress=False)
    handle.remove()
    assert_model_unchanged(model, before)
    assert model.config.num_hidden_layers == 6 and len(model.config.layer_types) == 6


def test_scoring_leaves_model_exactly_as_it_was():
    model = tiny_model("qwen3")
    before = snapshot_model(model)
    report = hl.score_layers(model, tiny_batch(), max_gap=2, progress=False)
    assert_model_unchanged(model, before)
    assert [(p.i, p.j) for p in report.pairs] == [(i, j) for i in range(6) for j in range(i + 1, min(6, i + 3))]
    assert report.metadata["forward_passes"] == 1 + 3 * len(report.pairs)
    assert report.metadata["model"]["class"] == "Qwen3ForCausalLM"
    assert report.metadata["model"]["fingerprint"] == model_fingerprint(model)

    model.config._name_or_path = "org/tiny-qwen3"
    hl.remove_layers(model, [2])
    after = hl.score_layers(model, tiny_batch(), max_gap=1, progress=False, protocols=("interchange",))
    assert after.metadata["model"]["base_model"] == model.config.layerswap["base_model"] == "org/tiny-qwen3"


def test_prompts_longer_than_a_learned_position_table_are_refused_before_any_forward():
    """GPT-2 has one learned position row per position (n_positions): prompts longer than
    that used to fail with an IndexError inside the embedding; the engine refuses them with
    the rule of evaluate_perplexity, before the model runs at all."""
    from arch_matrix import build

    from hf_layerswap.evaluation import perplexity_from_ids

    model = build("gpt2", 4, 0, n_positions=32)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"a calibration prompt of 40 tokens is longer than the model's "
                       r"max_position_embeddings=32 .*lower seq_len \(tokens per prompt\) to at most 32"):
        hl.score_layers(model, tiny_batch(batch=2, length=40, pad_last=0), num_prompts=2, progress=False)
    with pytest.raises(ValueError, match=r"window=33 is longer than the model's max_position_embeddings=32 .*lower "
                       r"window to at most 32"):
        perplexity_from_ids(model, torch.arange(1, 100) % 50, window=33, stride=16)
    assert calls == []
    report = hl.score_layers(model, tiny_batch(batch=2, length=32, pad_last=0), num_prompts=2, progress=False)  # the limit itself
    assert report.num_blocks == 4 and calls


def test_a_compiled_model_is_scored_through_its_eager_module_without_recompiling():
    """torch.compile guards on the block plan and the hooks each probe changes, so scoring a
    compiled model recompiled at every probe until dynamo's recompile limit (~100x slower);
    the probes now run on ``_orig_mod`` (same weights, same numbers) and dynamo sees none."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    eager = hl.score_layers(model, tiny_batch(), progress=False)
    compiled = torch.compile(model, backend="eager")  # dynamo's guards without a code generator
    with torch.no_grad():
        reference = compiled(tiny_batch()["input_ids"]).logits
    counters.clear()
    with pytest.warns(UserWarning, match=r"torch.compile'd: .*original eager module \(model._orig_mod"):
        report = hl.score_layers(compiled, tiny_batch(), progress=False)
    assert [p.to_dict() for p in report.pairs] == [p.to_dict() for p in eager.pairs]
    assert report.metadata["model"]["fingerprint"] == eager.metadata["model"]["fingerprint"]
    with pytest.warns(UserWarning, match="torch.compile'd"):
        assert removal_kl(compiled, tiny_batch(), [2, 3]) == removal_kl(model, tiny_batch(), [2, 3])
    assert counters["frames"]["total"] == 0 and not counters["recompiles"]  # no frame went through dynamo
    with torch.no_grad():
        assert torch.equal(compiled(tiny_batch()["input_ids"]).logits, reference)  # the wrapper still works


# --------------------------- refused indices, non-finite KL, the progress bar


@pytest.mark.parametrize("layers", [[6], [1, 1], list(range(NUM_BLOCKS))])
def test_removal_kl_refuses_the_same_indices(matrix_llama, layers):
    with pytest.raises(ValueError, match=r"out of range|duplicate|no block"):
        removal_kl(matrix_llama, prompts(), layers)


def test_masked_kl_keeps_inf_and_nan():
    ref = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    mask = torch.ones(2, 3, dtype=torch.long)
    logits = ref.clone()
    logits[0, 1, 2] = -math.inf  # the modified model gives a token the reference allows probability 0
    logits[1, 0, :] = math.nan
    kl = masked_kl(ref, logits, mask)
    assert math.isinf(kl[0].item()) and kl[0] > 0 and math.isnan(kl[1].item())


class _InjectNonFinite:
    """Make chosen probes of a real model end in NaN or -inf logits (what fp16 overflow on
    a boundary pair looks like). The probe is recognised by the plan the scoring engine
    passes to ``apply_plan``; the decoder output of that probe is replaced (NaN) or
    marked so that the output head gives token 0 a log-probability of -inf."""

    MARK = 1e30

    def __init__(self, model, plans: dict[tuple[int, ...], str], monkeypatch):
        import contextlib

        import hf_layerswap.scoring.engine as scoring

        self.plans = plans
        self.current = None
        self.injected: set[tuple[int, ...]] = set()
        real_apply_plan = scoring.apply_plan

        @contextlib.contextmanager
        def recording_apply_plan(model_, plan, **kwargs):
            with real_apply_plan(model_, plan, **kwargs):
                self.current = tuple(plan)
                try:
                    yield
                finally:
                    self.current = None

        monkeypatch.setattr(scoring, "apply_plan", recording_apply_plan)
        owner, _, _ = decoder_blocks(model)
        self.handles = [
            owner.register_forward_hook(self._decoder_hook),
            model.get_output_embeddings().register_forward_hook(self._head_hook),
        ]

    def _decoder_hook(self, module, args, output):
        kind = self.plans.get(self.current)
        if kind is None:
            return output
        self.injected.add(self.current)
        hidden = output.last_hidden_state.clone()
        if kind == "nan":
            hidden[:] = math.nan
        else:
            hidden[..., 0] = self.MARK
        output.last_hidden_state = hidden
        return output

    def _head_hook(self, module, args, output):
        marked = args[0][..., 0] == self.MARK
        if not bool(marked.any()):
            return output
        output = output.clone()
        output[..., 0] = torch.where(marked, -math.inf, output[..., 0])
        return output

    def remove(self):
        for h in self.handles:
            h.remove()


def test_non_finite_kl_is_kept_sorts_last_is_never_selected_and_round_trips(tmp_path, monkeypatch):
    model = build("llama")
    plans = {
        (0, 1, 3, 2, 4, 5): "nan",  # interchange 2<->3
        (0, 1, 2, 4, 3, 5): "nan",  # interchange 3<->4
        (0, 1, 3, 3, 4, 5): "inf",  # replacement 2<-3
        (0, 1, 2, 4, 4, 5): "inf",  # replacement 3<-4
    }
    injected = _InjectNonFinite(model, plans, monkeypatch)
    try:
        report = score_layers(model, prompts(), batch_size=2, progress=False)
    finally:
        injected.remove()
    assert injected.injected == set(plans)
    p23, p34 = report.pair(2, 3), report.pair(3, 4)
    assert math.isnan(p23.interchange) and math.isnan(p34.interchange)
    assert math.isinf(p23.replacement_ij) and math.isinf(p34.replacement_ij)
    assert math.isfinite(p23.replacement_ji) and math.isinf(p23.replacement)  # max keeps the inf
    assert p23.ratio is None
    inter, repl = report.layer_scores("interchange"), report.layer_scores("replacement")
    assert math.isnan(inter[3]) and math.isinf(repl[3])
    assert all(math.isfinite(inter[i]) and math.isfinite(repl[i]) for i in (0, 1, 2, 4, 5))
    for protocol in ("interchange", "replacement"):
        assert report.ranking(protocol)[-1] == 3
        assert select_layers(report, 5, protocol=protocol, spacing=0, protect=()) == [0, 1, 2, 4, 5]
        shown = "NaN" if protocol == "interchange" else "inf"  # the pairs' values: the layer's both partners
        with pytest.raises(NonFiniteScoresError, match=(
                rf"^cannot select 5 block\(s\) on finite {protocol} swap-KL scores: non-finite values: "
                rf"pair \(2, 3\) {protocol} = {shown}; pair \(3, 4\) {protocol} = {shown}; the values first broke at "
                r"calibration batch 0 \(0-based\)\. non-finite values are reported, never a basis for removal: load the "
                r"model in float32")) as err:
            select_layers(report, 5, protocol=protocol, spacing=0, protect=(0,))
        assert err.value.first_batch == 0 and list(err.value.nonfinite) == [f"pair (2, 3) {protocol}", f"pair (3, 4) {protocol}"]
    # JSON round trip keeps NaN and inf as such
    path = report.to_json(tmp_path / "report.json")
    back = SwapReport.from_json(path)
    assert back == report
    assert math.isnan(back.pair(2, 3).interchange) and math.isinf(back.pair(3, 4).replacement_ij)
    assert '"NaN"' in path.read_text() and '"Infinity"' in path.read_text()
    assert math.isnan(back.layer_scores("interchange")[3])


def _equal_length_prompts(n: int = 4, length: int = 12) -> dict:
    ids = torch.randint(4, 128, (n, length), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _head_blocks(model) -> float:
    """Output-head multiply-adds per position over a block's parameters (the bar's exchange rate)."""
    block = decoder_blocks(model)[2][0]
    vocab, hidden = model.get_output_embeddings().weight.shape
    return vocab * hidden / sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize("vocab_chunk", [None, 40])
def test_the_scoring_bar_counts_block_passes_as_they_run(progress_bars, vocab_chunk):
    model = build("llama")  # 6 blocks
    report = hl.score_layers(model, _equal_length_prompts(), num_prompts=4, batch_size=2, progress=True,
                             vocab_chunk=vocab_chunk)
    (bar,) = [b for b in progress_bars if b.desc == "swap-KL probes"]
    meta = report.metadata
    probes, batches, positions = meta["distinct_probes"], 2, 2 * 12
    # the total is the engine's own work: block passes plus the head rows at the head's exchange rate
    assert bar.total == round(meta["block_evaluations"] + _head_blocks(model) * meta["head_rows"] / positions)
    assert sum(bar.updates) == bar.n == bar.total
    # one move per forward pass at least (the reference and every probe, each batch), none bigger
    # than a whole-model pass: no batch arrives in one jump at its end
    assert len(bar.updates) >= batches * (1 + probes)
    assert bar.updates.count(1) >= meta["block_evaluations"]  # a step for every block run
    assert max(bar.updates) <= 6
    assert bar.unit == " block pass"


# -------------------------------- non-finite scores from an overflowing model


def test_the_overflowing_model_gives_all_nan_scores(overflow):
    _, _, report = overflow
    assert all(math.isnan(v) for r in report.pairs for v in (r.replacement_ij, r.replacement_ji, r.interchange))
    assert report.metadata["nonfinite"] == {"first_batch": 0}
    assert list(report.nonfinite_values())[:3] == [
        "pair (0, 1) replacement_ij", "pair (0, 1) replacement_ji", "pair (0, 1) interchange"]


def test_score_verbs_warn_with_the_first_broken_batch():
    model = tiny_model("llama")
    calibration = prompts(4, 12, seed=3, pad_last=0, high=100)
    calibration["input_ids"][2, 4] = 120  # only prompt 2 (batch 1 of size 2) carries the marker

    def poison(module, args, output):
        return torch.where((args[0] == 120).any(dim=1)[:, None, None], torch.full_like(output, math.nan), output)

    handle = model.model.embed_tokens.register_forward_hook(poison)
    try:
        with pytest.warns(hl.NonFiniteScoresWarning, match=(
                rf"^15 of 15 swap-KL probe values are non-finite \(NaN or inf\), first at calibration batch 1 "
                rf"\(0-based\); {NONFINITE_ADVICE}$")):
            report = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, progress=False)
        with pytest.warns(hl.NonFiniteScoresWarning, match=(
                r"^2 of 2 removal KL values are non-finite \(NaN or inf\), first at calibration batch 1 \(0-based\)")):
            values = removal_kl(model, calibration, [[1], [2]], batch_size=2, num_prompts=4)
    finally:
        handle.remove()
    assert report.metadata["nonfinite"] == {"first_batch": 1}
    assert all(math.isnan(v) for v in values)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.NonFiniteScoresWarning)  # finite scores: no warning
        clean = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, progress=False)
    assert "nonfinite" not in clean.metadata and clean.nonfinite_values() == {}


def test_adaptive_scoring_stops_at_non_finite_scores_and_reports_them():
    model, calibration = overflowing_model(), tiny_batch(4, 12)
    budget = hl.scoring.AdaptiveBudget(num_to_remove=1, min_prompts=2, step=2)
    with pytest.warns(hl.NonFiniteScoresWarning, match=r"^15 of 15 swap-KL probe values are non-finite"):
        report = hl.score_layers(model, calibration, batch_size=2, num_prompts=4, adaptive=budget, progress=False)
    record = report.metadata["adaptive"]
    assert record["stopped"] == "nonfinite" and record["rounds"] == [
        {"num_prompts": 2, "selected": None, "stable": False, "closest": None}]
    assert record["reason"] == "stopped: the interchange scores cannot fill the budget with finite values"
    assert report.metadata["num_prompts"] == 2 and report.metadata["nonfinite"] == {"first_batch": 0}
