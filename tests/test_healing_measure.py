"""What healing measures around its training (hf_layerswap.healing.measure): perplexity of
the dense model, after the cut, after the repair and after healing under one contract, and
lm-eval tasks before and after healing, recorded so the card renders them from the saved
checkpoint alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from transformers import AutoConfig
from arch_matrix import tiny_tokenizer
from conftest import tiny_batch, tiny_checkpoint, tiny_model

import hf_layerswap as hl
from hf_layerswap.card import check_card, render_card
from hf_layerswap.card.healing import healing_section
from hf_layerswap.cli import main
from hf_layerswap.config import HealConfig, LayerSwapConfig
from hf_layerswap.healing.measure import HealMeasures, replayed_cut, repair_of_last_cut
from hf_layerswap.pipeline import prune

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
REMOVED = [2, 3]


def _calibration():
    return tiny_batch(batch=12, length=16, seed=3, pad_last=0)


def _text(path: Path) -> Path:
    path.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 50} x" for k in range(30)) for p in range(8)) + "\n")
    return path


def _dense():  # the matched contract's 512-token window needs 512 positions
    return tiny_model("llama", num_blocks=6, seed=0, max_position_embeddings=512)


def _heal_config(**extra):
    return HealConfig(method="last_k", max_tokens=8 * 16 * 4, seq_len=16, learning_rate=1e-3, eval_every=2,
                      patience=3, options={"k": 2}, **extra)


def _ppl(model, text, tok):
    return hl.evaluate_perplexity(model, str(text), tokenizer=tok, bootstrap=0, progress=False).ppl


@pytest.mark.parametrize("recovery", ["ghosted", None])
def test_pipeline_records_every_stage_with_one_contract(tmp_path, recovery):
    tok, text = tiny_tokenizer(), _text(tmp_path / "eval.txt")
    dense = _dense()
    expected = {"dense": _ppl(dense, text, tok), "after_cut": _ppl(hl.remove_layers(copy.deepcopy(dense), REMOVED), text, tok)}
    if recovery:
        repaired = copy.deepcopy(dense)
        hl.recover(repaired, REMOVED, _calibration(), method=recovery)
        expected["after_repair"] = _ppl(repaired, text, tok)
    model = copy.deepcopy(dense)
    with pytest.warns(UserWarning):  # 12 given prompts, fewer than asked
        result = prune(model, LayerSwapConfig(layers=REMOVED, calibration=_calibration(), recovery=recovery,
                                              heal=_heal_config(perplexity_text=str(text)), progress=False),
                       tokenizer=tok)
    ppl = model.config.layerswap["healing"][-1]["perplexity"]
    assert ppl == result.heal_report.perplexity
    assert ppl["after_healing"] == _ppl(model, text, tok)
    for stage, value in expected.items():  # the cut replayed on the teacher: bit for bit the cut by surgery
        assert ppl[stage] == value, stage
    assert ppl["start"] == ("after_repair" if recovery else "after_cut") and ppl["repair"] == recovery
    assert ("after_repair" in ppl) == bool(recovery)
    assert ppl["contract"] == "matched" and ppl["text"] == "file:eval.txt" and ppl["window"] == 512
    assert model.config.layerswap["steps"][-1]["config"]["heal"]["perplexity_text"] == "eval.txt"
    # the card renders from the saved checkpoint alone
    model.save_pretrained(tmp_path / "ckpt")
    card = str(render_card(AutoConfig.from_pretrained(tmp_path / "ckpt")))
    assert f"| Perplexity of the dense model (the teacher) | {ppl['dense']:.3f} |" in card
    assert f"| Perplexity after the cut | {ppl['after_cut']:.3f} (" in card
    assert ("| Perplexity after the repair (ghosted) |" in card) == bool(recovery)
    assert f"| Perplexity after healing | {ppl['after_healing']:.3f} (" in card
    # and its metadata carries each measured stage exactly (model-index)
    results = ModelCard(card).data.eval_results
    labels = {"dense": "Perplexity of the dense model (the teacher)", "after_cut": "Perplexity after the cut",
              "after_repair": f"Perplexity after the repair ({recovery})",
              "after_healing": "Perplexity after healing (this model)"}
    assert {r.metric_name: r.metric_value for r in results} == {labels[k]: ppl[k] for k in (*expected, "after_healing")}
    assert {(r.dataset_type, r.dataset_name, r.metric_config) for r in results} == {("text", "file:eval.txt", "matched")}
    assert f"vs the start of healing ({'after the repair' if recovery else 'after the cut'})" in card


def test_heal_measures_tokenize_the_perplexity_text_once(tmp_path, monkeypatch):
    """Four stages (dense, after the cut, after the repair, after healing), one tokenization
    of the text; every value bit for bit what evaluate_perplexity gives for that model alone."""
    from hf_layerswap.evaluation import perplexity as perplexity_module

    tok, text = tiny_tokenizer(), _text(tmp_path / "eval.txt")
    dense = _dense()
    repaired = copy.deepcopy(dense)
    hl.recover(repaired, REMOVED, _calibration(), method="ghosted")
    tokenized = []
    tokenize = perplexity_module.tokenize_text
    monkeypatch.setattr(perplexity_module, "tokenize_text", lambda *args: tokenized.append(args) or tokenize(*args))
    measures = HealMeasures(perplexity_text=str(text), tokenizer=tok)
    measures.check()
    perplexity, _ = measures.finish(repaired, measures.start(repaired, dense))
    assert len(tokenized) == 1
    monkeypatch.undo()
    cut = hl.remove_layers(copy.deepcopy(dense), REMOVED)
    expected = {"dense": _ppl(dense, text, tok), "after_cut": _ppl(cut, text, tok),
                "after_repair": _ppl(repaired, text, tok), "after_healing": _ppl(repaired, text, tok)}
    assert {stage: perplexity[stage] for stage in expected} == expected
    contract = hl.evaluate_perplexity(dense, str(text), tokenizer=tok, bootstrap=0, progress=False).contract
    assert perplexity["text_sha256"] == contract["text_sha256"] and perplexity["words"] == contract["words"]
    assert (perplexity["window"], perplexity["stride"], perplexity["start"]) == (512, 256, "after_repair")


def test_replayed_cut_reads_the_record_for_both_teachers():
    dense = tiny_model("llama", num_blocks=6)
    once = hl.remove_layers(copy.deepcopy(dense), [1])
    twice = hl.remove_layers(copy.deepcopy(once), [2, 3])  # original blocks 3 and 4
    assert replayed_cut(twice, dense) == [1, 3, 4]  # heal PRUNED BASE: the original model
    assert replayed_cut(twice, once) == [2, 3]  # the pipeline's copy just before the last cut
    assert replayed_cut(twice, tiny_model("llama", num_blocks=8)) is None
    assert repair_of_last_cut(twice) is None
    hl.recover(once, [2, 3], _calibration(), method="ghosted")
    assert repair_of_last_cut(once) == "ghosted"
    assert replayed_cut(once, dense) == [1, 3, 4]


def test_heal_measures_lm_eval_tasks_before_and_after():
    pytest.importorskip("lm_eval")
    tok = tiny_tokenizer()
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    student = hl.remove_layers(copy.deepcopy(teacher), REMOVED)
    start = copy.deepcopy(student)
    options = dict(include_path=TASKS, limit=4, tokenizer=tok)
    config = _heal_config(eval_tasks=["layerswap_mc"], eval_tasks_path=str(TASKS), eval_tasks_limit=4)
    report = hl.heal(student, teacher, _calibration(), tokenizer=tok, **config.heal_kwargs())
    before, after = (hl.evaluate_tasks(m, ["layerswap_mc"], **options) for m in (start, student))
    assert not report.reverted
    assert report.tasks["before"] == before.results and report.tasks["after"] == after.results
    assert report.tasks["n_samples"] == {"layerswap_mc": 4} and report.tasks["settings"]["limit"] == 4
    assert report.tasks["task_hashes"] == before.task_hashes == after.task_hashes
    assert report.tasks["higher_is_better"] == before.higher_is_better == {"layerswap_mc": {"acc": True, "acc_norm": True}}
    entry = student.config.layerswap["healing"][-1]
    assert entry["tasks"] == json.loads(json.dumps(report.tasks))
    card = healing_section(student.config.layerswap)
    acc0, acc1 = before.results["layerswap_mc"]["acc"], after.results["layerswap_mc"]["acc"]
    assert f"| layerswap_mc | acc | {acc0:.4f}" in card and f"{acc1 - acc0:+.4f} |" in card
    assert "4 docs" in card and "lm-eval tasks before and after healing:" in card


def test_heal_verb_measures_and_cards_the_stages(tmp_path):
    tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", max_position_embeddings=512))
    text = _text(tmp_path / "eval.txt")
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(" ".join(f"w{(5 * p + k) % 90}" for k in range(40)) for p in range(24)) + "\n")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "2", "3", "--recovery",
                 "fused", "--calibration", str(calib)]) == 0
    out = tmp_path / "healed"
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "base"), str(out), "--calibration", str(calib),
                 "--method", "last_k", "--option", "k=2", "--max-tokens", "256", "--seq-len", "16",
                 "--perplexity", str(text)]) == 0
    entry = json.loads((out / "config.json").read_text())["layerswap"]["healing"][-1]
    ppl = entry["perplexity"]
    assert ppl["repair"] == "fused" and ppl["start"] == "after_repair"
    assert all(isinstance(ppl[k], float) for k in ("dense", "after_cut", "after_repair", "after_healing"))
    card = (out / "README.md").read_text()
    assert f"| Perplexity after the repair (fused) | {ppl['after_repair']:.3f} (" in card
    assert check_card(card, out) == []
    missing = tmp_path / "missing.txt"
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "base"), str(tmp_path / "h2"),
                 "--perplexity", str(missing)]) == 2
    assert not (tmp_path / "h2").exists()


def test_heal_config_measurement_fields():
    cfg = HealConfig(perplexity_text="/data/wiki.test.raw", eval_tasks="hellaswag", eval_tasks_path="/tasks/mine",
                     eval_tasks_limit=20.0)
    assert cfg.eval_tasks == ["hellaswag"] and cfg.eval_tasks_limit == 20
    data = cfg.to_dict()
    assert (data["perplexity_text"], data["eval_tasks_path"]) == ("wiki.test.raw", "mine")
    assert HealConfig(perplexity_text="embedded").to_dict()["perplexity_text"] == "embedded"
    round_trip = LayerSwapConfig.from_dict(json.loads(json.dumps(LayerSwapConfig(num_to_remove=1, heal=cfg).to_dict())))
    assert round_trip.heal.eval_tasks == ["hellaswag"] and round_trip.heal.eval_tasks_limit == 20
    with pytest.raises(ValueError, match=r"HealConfig\(eval_tasks=\[\]\)"):
        HealConfig(eval_tasks=[])
    with pytest.raises(ValueError, match=r"HealConfig\(eval_tasks_limit=0\)"):
        HealConfig(eval_tasks=["t"], eval_tasks_limit=0)
    with pytest.raises(ValueError, match="without eval_tasks"):
        HealConfig(eval_tasks_limit=5)
    with pytest.raises(ValueError, match=r"HealConfig\(perplexity_text=3\)"):
        HealConfig(perplexity_text=3)
    teacher = tiny_model("llama")
    with pytest.raises(ValueError, match="eval_tasks=\\['t'\\] needs tokenizer="):
        hl.heal(hl.remove_layers(copy.deepcopy(teacher), REMOVED), teacher, _calibration(), eval_tasks=["t"])


def test_prune_heal_measurement_flags(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    run = ["prune", str(tmp_path / "base"), str(tmp_path / "p"), "--layers", "2"]
    assert main([*run, "--heal", "--heal-perplexity", str(tmp_path / "nope.txt")]) == 2
    assert "--heal-perplexity" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert main([*run, "--heal-eval-tasks", "a", "b"]) == 2
    assert "--heal-* options given without --heal" in capsys.readouterr().err


def test_heal_measures_check_task_fields_like_heal_config():
    tok = tiny_tokenizer()
    measures = HealMeasures(eval_tasks="hellaswag", eval_tasks_limit=20.0, tokenizer=tok)
    measures.check()  # one name is one task, not its letters
    assert measures.eval_tasks == ["hellaswag"] and measures.eval_tasks_limit == 20
    teacher = tiny_model("llama")
    student = hl.remove_layers(copy.deepcopy(teacher), REMOVED)
    with pytest.raises(ValueError, match=r"heal\(eval_tasks_path=None, eval_tasks_limit=5\) without eval_tasks"):
        hl.heal(student, teacher, _calibration(), tokenizer=tok, eval_tasks_limit=5)
    with pytest.raises(ValueError, match=r"heal\(eval_tasks_limit=-3\): must be None, an int >= 1"):
        hl.heal(student, teacher, _calibration(), tokenizer=tok, eval_tasks=["t"], eval_tasks_limit=-3)


def test_bad_perplexity_text_leaves_no_checkpoint_folder(tmp_path):
    tok, empty = tiny_tokenizer(), tmp_path / "empty.txt"
    empty.write_text("")
    teacher = _dense()
    student = hl.remove_layers(copy.deepcopy(teacher), REMOVED)
    with pytest.raises(ValueError, match="0 token"):
        hl.heal(student, teacher, _calibration(), tokenizer=tok, checkpoint_dir=tmp_path / "ck",
                **_heal_config(perplexity_text=str(empty)).heal_kwargs())
    assert not (tmp_path / "ck").exists() and "healing" not in student.config.layerswap


def test_heal_verb_refuses_a_missing_task_folder_before_loading(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "2"]) == 0
    capsys.readouterr()
    missing = tmp_path / "no_tasks"
    assert main(["heal", str(tmp_path / "pruned"), str(tmp_path / "base"), str(tmp_path / "h"), "--eval-tasks", "t",
                 "--eval-tasks-path", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--eval-tasks-path {str(missing)!r} is not a folder" in err and "loading" not in err
    assert not (tmp_path / "h").exists() and not (tmp_path / "h.heal-checkpoints").exists()
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p2"), "--layers", "2", "--heal", "--heal-eval-tasks",
                 "t", "--heal-eval-tasks-path", str(missing)]) == 2
    assert f"--heal-eval-tasks-path {str(missing)!r} is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "p2").exists()


@pytest.mark.parametrize("measures, error, message", [
    ({"perplexity_text": "missing.txt"}, FileNotFoundError, r"text='.*missing\.txt': no such file"),
    ({"perplexity_text": "empty.txt"}, ValueError, r"perplexity_text='.*empty\.txt': the text has 0 token\(s\)"),
    ({"eval_tasks": ["layerswap_mc", "layerswap_nope"], "eval_tasks_path": str(TASKS)}, ValueError,
     r"unknown lm-eval task\(s\) \['layerswap_nope'\]"),
])
def test_prune_refuses_healing_measurements_before_scoring(tmp_path, measures, error, message):
    """What healing would refuse when it measures (after the scoring and the cut) is refused
    before the first forward pass."""
    if "eval_tasks" in measures:
        pytest.importorskip("lm_eval")
    (tmp_path / "empty.txt").write_text("\n")
    if "perplexity_text" in measures:
        measures = {"perplexity_text": str(tmp_path / measures["perplexity_text"])}
    model = _dense()
    calls = []
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: calls.append(1))
    config = LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=_calibration(), progress=False,
                             heal=_heal_config(**measures))
    with pytest.raises(error, match=message):
        prune(model, config, tokenizer=tiny_tokenizer())
    assert calls == []


def test_a_second_healing_run_starts_after_the_first_never_labelled_as_the_repair(tmp_path):
    # run 2 labelled run 1's healed perplexity "after the repair (ghosted)" (260.187 where the
    # repair's value was 260.402)
    tok, text = tiny_tokenizer(), _text(tmp_path / "eval.txt")
    dense = _dense()
    student = copy.deepcopy(dense)
    hl.recover(student, REMOVED, _calibration(), method="ghosted")
    repaired_ppl = _ppl(student, text, tok)
    kwargs = dict(_heal_config().heal_kwargs(), tokenizer=tok, perplexity_text=str(text))
    first = hl.heal(student, dense, _calibration(), **kwargs)
    assert first.perplexity["after_repair"] == repaired_ppl and first.perplexity["start"] == "after_repair"
    second = hl.heal(student, dense, _calibration(), **{**kwargs, "seed": 1})
    ppl = second.perplexity
    assert ppl["start"] == "after_earlier_healing" and ppl["earlier_healing"] == 1
    assert ppl["after_earlier_healing"] == first.perplexity["after_healing"]
    assert "after_repair" not in ppl  # not measured: the repaired weights are gone
    assert ppl["after_cut"] == _ppl(hl.remove_layers(copy.deepcopy(dense), REMOVED), text, tok)
    section = healing_section(student.config.layerswap)
    run2 = section.split("### Healing run 2")[1]
    assert "Perplexity after the repair" not in run2
    assert f"| Perplexity after healing run 1 (where this run started) | {first.perplexity['after_healing']:.3f} (" in run2
    assert "vs the start of healing (after healing run 1)" in run2
    run1 = section.split("### Healing run 2")[0]
    assert f"| Perplexity after the repair (ghosted) | {repaired_ppl:.3f} (" in run1
