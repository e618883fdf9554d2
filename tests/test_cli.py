"""The hf-layerswap command line on a tiny checkpoint and (slow) the demo on SmolLM2-135M."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from arch_matrix import tiny_tokenizer
from conftest import overflowing_model, tiny_checkpoint, tiny_model
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap import SwapReport
from hf_layerswap.cli import demo as demo_verb
from hf_layerswap.cli import main
from hf_layerswap.models import load_model


_tiny_checkpoint = tiny_checkpoint


def _calibration_file(path, n=6):
    paragraphs = [" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(30)) for p in range(n)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def test_score_and_prune_verbs(tmp_path, capsys):
    model = _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    rc = main(["score", str(tmp_path / "base"), "--calibration", str(calib), "--num-prompts", "4", "-o",
               str(tmp_path / "r.json")])
    assert rc == 0
    report = SwapReport.from_json(tmp_path / "r.json")
    assert report.num_blocks == 6 and len(report.pairs) == 5
    assert report.metadata["num_prompts"] == 4
    assert "| layer | replacement s(i) | rank | interchange s(i) | rank |" in capsys.readouterr().out

    rc = main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--num-to-remove", "2",
               "--report", str(tmp_path / "r.json"), "--calibration", str(calib), "--num-prompts", "4"])
    assert rc == 0
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    from hf_layerswap import select_layers

    assert config["layerswap"]["removed_layers"] == select_layers(report, 2)
    assert (tmp_path / "pruned" / "README.md").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", attn_implementation="eager")
    assert reloaded.config.num_hidden_layers == 4
    ids = torch.tensor([[1, 2, 3, 4]])
    from hf_layerswap import remove_layers

    remove_layers(model, select_layers(report, 2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)

    # explicit layers; an existing output folder is refused and left untouched
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--layers", "1"]) == 2
    assert json.loads((tmp_path / "pruned" / "config.json").read_text()) == config
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p2"), "--layers", "1", "-1"]) == 0
    assert json.loads((tmp_path / "p2" / "config.json").read_text())["layerswap"]["removed_layers"] == [1, 5]
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p3"), "--layers", "9"]) == 2
    assert not (tmp_path / "p3").exists()


@pytest.mark.slow
def test_demo_on_smollm2_small_budget(smollm2, tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--num-prompts", "8", "--seq-len", "32", "--budgets", "1", "--eval-max-words", "400",
               "--output", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "calibration budget: 8 prompts" in text and "\nestimated time: about " in text
    assert "perplexity evaluations" in captured.err  # progress bar over the base model and each removal set
    contract = next(line for line in text.splitlines() if line.startswith("contract: "))
    assert contract.startswith("contract: matched: first 400 words of ") and "window 512, stride 256" in contract
    assert str(Path.home()) not in text
    assert "| 1 | replacement |" in text and "| 1 | interchange |" in text and "| 1 | search |" in text
    assert "final: removed" in text and "(strategy search:" in text
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 28 and len(config["layerswap"]["removed_layers"]) == 2
    report = SwapReport.from_json(out / "layerswap_report.json")
    assert report.num_blocks == 30 and report.selections[-1]["selected"] == config["layerswap"]["removed_layers"]
    decision = report.selections[-1]
    assert decision["strategy"] == "search" and decision["total_cost"]["evaluator_calls"] <= 90
    for entry in decision["protocol_sets"].values():  # the searched set is never worse than a protocol's set
        assert entry is None or decision["value"] <= entry["value"]
    assert (out / "README.md").is_file()


def test_prompts_longer_than_the_position_table_exit_2_before_scoring(tmp_path, capsys):
    from arch_matrix import build

    _tiny_checkpoint(tmp_path / "gpt2", build("gpt2", 4, 0, n_positions=32))
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(60)) for p in range(3)) + "\n")
    rc = main(["score", str(tmp_path / "gpt2"), "--calibration", str(calib), "--num-prompts", "2", "--seq-len", "32",
               "-o", str(tmp_path / "fits.json")])
    assert rc == 0  # 32 tokens fit
    capsys.readouterr()
    rc = main(["score", str(tmp_path / "gpt2"), "--calibration", str(calib), "--num-prompts", "2", "--seq-len", "128",
               "-o", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "IndexError" not in err
    assert ("error: a calibration prompt of 60 tokens is longer than the model's max_position_embeddings=32 (the "
            "longest sequence it has positions for): lower seq_len (tokens per prompt) to at most 32") in err
    assert not (tmp_path / "r.json").exists()


def test_demo_states_its_estimate_first_and_its_final_search_repeats_the_compared_one(tmp_path, capsys):
    """The demo prints its planned work and estimated time before any scoring; its final cut
    (through hl.prune) gets the evaluations the compared search spent up to that budget, so it
    values the same candidates (taken from the report, no pass) and keeps the same set."""
    _tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", num_blocks=10, max_position_embeddings=512))
    calib = _calibration_file(tmp_path / "calib.txt", n=12)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"w{(k * 13) % 120}" for k in range(1500)))
    rc = main(["demo", "--model", str(tmp_path / "base"), "--calibration", str(calib), "--eval-text", str(text),
               "--num-prompts", "8", "--budgets", "1", "2", "--output", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    plan = next(k for k, line in enumerate(lines) if line.startswith("planned work: scoring 27 probes; the search at most 10 "))
    estimate = next(k for k, line in enumerate(lines) if line.startswith("estimated time: about "))
    assert plan < estimate < next(k for k, line in enumerate(lines) if line.startswith("per-layer swap-KL scores"))
    cost = next(k for k, line in enumerate(lines) if line.startswith("estimated cost (upper bound: selection): "))
    assert estimate < cost < next(k for k, line in enumerate(lines) if line.startswith("per-layer swap-KL scores"))
    assert "at most 7 perplexity evaluations of 999 tokens (1512 through the model)" in lines[plan]
    assert "matched contract on the first 1000 words" in out  # the demo's default held-out text
    searched = next(line for line in lines if line.startswith("  n = 2: search "))
    report = SwapReport.from_json(tmp_path / "out" / "layerswap_report.json")
    final = report.selections[-1]
    assert final["strategy"] == "search" and searched.startswith(f"  n = 2: search {final['selected']} ")
    # the single-removal sweep (8 sets) and the allowance of 8 // 3 = 2 (the protocols' greedy pairs inside)
    assert final["max_evaluations"] == final["total_cost"]["evaluator_calls"] <= 8 + 2
    # ... whose values the final search takes from the report, measured on the same prompts: no pass
    assert final["total_cost"]["reused"] == final["total_cost"]["evaluator_calls"]
    assert final["total_cost"]["forward_passes"] == final["total_cost"]["block_passes"] == 0
    assert "the final cut's search takes the values of its 10 from it (no pass)" in lines[plan]
    assert f"budgets [1, 2] in one call): {final['total_cost']['evaluator_calls']} candidate sets," in out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layerswap"]["removed_layers"] == final["selected"]


def _demo_fixture(tmp_path, num_blocks=10, paragraphs=40):
    _tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", num_blocks=num_blocks, max_position_embeddings=512))
    calib = _calibration_file(tmp_path / "calib.txt", n=paragraphs)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"w{(k * 13) % 120}" for k in range(1500)))
    return ["demo", "--model", str(tmp_path / "base"), "--calibration", str(calib), "--eval-text", str(text),
            "--budgets", "1", "2", "--output", str(tmp_path / "out")]


def _planned_seconds(out: str) -> dict[str, float]:
    """The parts of the demo's printed estimate, in seconds (its plan line)."""
    line = next(x for x in out.splitlines() if x.startswith("estimated time: about "))
    parts = {}
    for name in ("scoring", "search", "perplexity"):
        text = line.split(f"{name} ", 1)[1].split(",", 1)[0].split(")", 1)[0]
        parts[name] = float(text.split()[0]) * (60 if text.endswith("min") else 1)
    return parts


def test_the_demos_estimate_prices_every_part_at_the_measured_rates(tmp_path, capsys, monkeypatch):
    """The demo's printed estimate is the library's cost model at the rates measured on this
    machine: its scoring is estimate_cost's scoring of the same prompts, its perplexity the
    evaluations' forwards (window_batches of the matched contract, two windows per forward)
    priced by the same rates; the per-block rates come from measure_throughput at the run's
    threads (one probe, used for every part)."""
    rates = hl.cost.Throughput(block_flops_per_second=4e8, head_flops_per_second=2e8, source="given")
    probes = []
    monkeypatch.setattr(demo_verb, "measure_throughput", lambda *a, **k: probes.append(a) or rates)
    rc = main(_demo_fixture(tmp_path) + ["--num-prompts", "16"])
    assert rc == 0 and len(probes) == 1
    out = capsys.readouterr().out
    parts = _planned_seconds(out)
    model, tok = load_model(str(tmp_path / "base"))
    calib = hl.calibration.build_calibration(str(tmp_path / "calib.txt"), tok, num_prompts=16, seq_len=128)
    cfg = demo_verb.demo_config(_demo_args(tmp_path), 10, 16, 8 + 2)
    scoring = hl.estimate_cost(model, cfg, calibration=calib, throughput=rates).phases["scoring"]["seconds"]
    assert 1 < scoring < 59 and parts["scoring"] == pytest.approx(scoring, abs=0.5)  # printed in whole seconds
    forwards, _ = demo_verb.eval_forwards(model, str(tmp_path / "eval.txt"), tok, demo_verb.DEMO_EVAL_WORDS)
    counted = []
    from hf_layerswap.layerplan import decoder_blocks
    hooks = [b.register_forward_hook(lambda *_: counted.append(1)) for b in decoder_blocks(model)[2]]
    hl.evaluate_perplexity(model, str(tmp_path / "eval.txt"), tokenizer=tok, max_words=demo_verb.DEMO_EVAL_WORDS,
                           batch_size=demo_verb.DEMO_EVAL_BATCH)
    for h in hooks:
        h.remove()
    phase = hl.cost.estimate.forwards_phase(hl.cost.steps.ModelShape(model), forwards, 10)
    assert phase["block_passes"] == len(counted)  # the forwards the evaluation runs, exactly
    assert 1 < 7 * rates.seconds(phase) < 59
    assert parts["perplexity"] == pytest.approx(7 * rates.seconds(phase), abs=0.5)  # 1 + 3 x 2 budgets


def _demo_args(tmp_path):
    return demo_verb.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args(
        ["--model", str(tmp_path / "base"), "--calibration", str(tmp_path / "calib.txt"), "--budgets", "1", "2"])


def test_num_prompts_auto_takes_the_most_whole_batches_whose_planned_work_fits_the_time_budget(tmp_path, capsys,
                                                                                              monkeypatch):
    """--num-prompts auto chooses the most prompts (whole batches of --batch-size, 8 to 64) whose
    estimated demo (scoring, searches, perplexities) fits --time-budget: with the budget set
    between the estimates of 16 and 24 prompts it takes 16; below the 8-prompt estimate, 8."""
    rates = hl.cost.Throughput(block_flops_per_second=2e7, head_flops_per_second=1e7, source="given")
    monkeypatch.setattr(demo_verb, "measure_throughput", lambda *a, **k: rates)
    seen = {}
    real_plan = demo_verb.plan_demo

    def plan(model, args, calib, prompts, *rest):
        if "total" not in seen:  # before anything runs (the final cut prunes the model in place)
            seen["total"] = {n: sum(real_plan(model, args, calib, n, *rest)[0].values()) for n in (8, 16, 24)}
        return real_plan(model, args, calib, prompts, *rest)

    monkeypatch.setattr(demo_verb, "plan_demo", plan)
    assert main(_demo_fixture(tmp_path) + ["--num-prompts", "auto", "--time-budget", "1e9", "--output",
                                           str(tmp_path / "probe")]) == 0
    assert "calibration budget: 40 prompts x up to 128 tokens" in capsys.readouterr().out  # all the source has
    total = seen["total"]
    assert total[8] < total[16] < total[24]
    budget = (total[16] + total[24]) / 2
    assert main(_demo_fixture(tmp_path) + ["--num-prompts", "auto", "--time-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert out.count("calibration budget: 16 prompts x up to 128 tokens") == 1
    assert f"chosen to fit about {budget / 60:.1f} min of planned work on this machine" in out
    assert main(_demo_fixture(tmp_path) + ["--num-prompts", "auto", "--time-budget", str(total[8] / 2),
                                           "--output", str(tmp_path / "few")]) == 0
    out = capsys.readouterr().out
    # the fewest, and said so: the line used to claim they were "chosen to fit" a budget the estimate exceeds
    assert "calibration budget: 8 prompts x up to 128 tokens" in out and "chosen to fit" not in out
    note = re.search(r"\(the fewest --num-prompts auto takes: their planned work, about (.+?), is above the "
                     r"--time-budget of ([\d.]+) (s|min) on this machine\)", out)
    estimated = next(x for x in out.splitlines() if x.startswith("estimated time: about ")).split()[3:5]
    assert note and note.group(1) == " ".join(estimated)  # the estimate printed below it
    budget = float(note.group(2)) * (60 if note.group(3) == "min" else 1)  # printed to 0.1 min or 1 s
    assert abs(budget - total[8] / 2) <= 3 and sum(_planned_seconds(out).values()) > total[8] / 2


def test_demo_runs_on_a_model_whose_embedding_is_offloaded_to_disk(tmp_path, capsys, monkeypatch):
    """The demo's timing pass sends the prompts to the input embedding's execution device
    (hl.utils.devices.input_device), not to the device of the model's first parameter: an
    embedding offloaded to disk has its weight on "meta" between calls."""
    _tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", num_blocks=4, max_position_embeddings=512))
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(4)}}

    def offloaded(args):
        return load_model(args.model, device_map=device_map, offload_folder=str(tmp_path / "offload"))

    monkeypatch.setattr(demo_verb, "load", offloaded)
    model, _ = offloaded(type("Args", (), {"model": str(tmp_path / "base")}))
    assert next(model.parameters()).device.type == "meta"  # the embedding's weight, offloaded
    calib = _calibration_file(tmp_path / "calib.txt", n=8)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"w{(k * 13) % 120}" for k in range(600)))
    rc = main(["demo", "--model", str(tmp_path / "base"), "--calibration", str(calib), "--eval-text", str(text),
               "--num-prompts", "4", "--budgets", "1", "--final-num-to-remove", "1", "--eval-max-words", "300",
               "--output", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("estimated time: about "))
    assert len(json.loads((tmp_path / "out" / "config.json").read_text())["layerswap"]["removed_layers"]) == 1


def test_demo_refuses_a_missing_eval_text_before_loading(tmp_path, capsys):
    """A misspelt --eval-text fails at once (exit 2, the value named), not after minutes of scoring;
    nothing is written."""
    missing = tmp_path / "wiki.test.raw"
    code = main(["demo", "--model", str(tmp_path / "no-such-model"), "--eval-text", str(missing),
                 "--output", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--eval-text {str(missing)!r} is not a file" in err and "loading" not in err
    assert not (tmp_path / "out").exists()


def test_demo_final_cut_at_a_searched_budget_is_that_searchs_set_with_every_value_taken(tmp_path, capsys):
    """Where --final-num-to-remove is one of --budgets, the final cut's search runs with the
    comparison search's schedule (a third of the removable blocks per further budget) and the
    evaluations it spent up to that budget: it chooses the set printed for that budget and
    takes every value from the report (no forward pass). With the search's default schedule
    it chose {6, 7, 8} here where the comparison printed {4, 6, 8}, scoring 2 sets again."""
    argv = _demo_fixture(tmp_path)
    argv = argv[:argv.index("--budgets")] + argv[argv.index("--budgets") + 3:]
    assert main(argv + ["--budgets", "1", "2", "3", "--final-num-to-remove", "3"]) == 0
    out = capsys.readouterr().out
    printed = json.loads(next(line for line in out.splitlines() if line.startswith("  n = 3: search "))
                         .split("search ", 1)[1].split("]", 1)[0] + "]")
    layerswap = json.loads((tmp_path / "out" / "config.json").read_text())["layerswap"]
    cost = layerswap["steps"][-1]["decision"]["total_cost"]
    assert layerswap["removed_layers"] == printed
    assert cost["reused"] == cost["evaluator_calls"] > 0 and cost["forward_passes"] == cost["block_passes"] == 0
    assert layerswap["steps"][-1]["config"]["strategy_options"] == {"evaluations_per_budget": 2}  # (10 - 2) // 3


@pytest.mark.parametrize(("extra", "message"), [
    (["--budgets", "1", "9"], "--budgets 9: at most 8 for this model (its 10 blocks less the first and last"),
    (["--final-num-to-remove", "9"], "--final-num-to-remove 9: at most 8 for this model (its 10 blocks"),
    (["--max-evaluations", "7"], "--max-evaluations 7: at least 8, one set per removable block for this model"),
])
def test_demo_refuses_a_budget_or_evaluation_count_the_model_cannot_take_naming_the_option(tmp_path, capsys, extra, message):
    """A budget above the blocks a cut may remove fails before any calibration or measurement,
    with an error naming the option, the value and the limit; nothing is written."""
    code = main(_demo_fixture(tmp_path) + extra)
    assert code == 2
    captured = capsys.readouterr()
    assert f"error: {message}" in captured.err
    assert "calibration budget" not in captured.out
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ consistency of the verbs


def _exit_code(argv) -> int:
    """What the shell sees: main's return value, or the code argparse exits with."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_scoring_memory_option_of_score_and_prune(tmp_path, capsys):
    _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    common = ["--calibration", str(calib), "--num-prompts", "4"]
    assert main(["score", str(tmp_path / "base"), *common, "--scoring-memory", "64MiB", "-o", str(tmp_path / "r.json")]) == 0
    meta = SwapReport.from_json(tmp_path / "r.json").metadata
    assert (meta["max_memory"], meta["max_memory_source"]) == (64 * 2**20, "given")
    assert main(["score", str(tmp_path / "base"), *common, "-o", str(tmp_path / "auto.json")]) == 0
    assert SwapReport.from_json(tmp_path / "auto.json").metadata["max_memory_source"].startswith("auto: 25% of ")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--num-to-remove", "1", "--strategy", "greedy",
                 *common, "--scoring-memory", "32MiB"]) == 0
    assert json.loads((tmp_path / "out" / "layerswap_report.json").read_text())["metadata"]["max_memory"] == 32 * 2**20
    capsys.readouterr()
    assert _exit_code(["score", str(tmp_path / "base"), "--scoring-memory", "lots"]) == 2
    assert "--scoring-memory: 'lots': expected 'auto' or a size of at least 1MiB such as 800MiB or 2GB" in capsys.readouterr().err


def test_prune_warns_a_calibration_shortfall_once(tmp_path):
    """The estimate printed before the run builds the same calibration as the run: a source
    with fewer prompts than asked warns once (from the run), not once per build."""
    _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt", n=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--num-to-remove", "1",
                     "--calibration", str(calib), "--num-prompts", "8", "--strategy", "greedy"]) == 0
    shortfalls = [w for w in caught if issubclass(w.category, hl.CalibrationShortfallWarning)]
    assert len(shortfalls) == 1
    assert "8 prompt(s) requested, the source gave 3" in str(shortfalls[0].message)


def test_prune_prints_the_resolved_0_based_indices(tmp_path, capsys):
    _tiny_checkpoint(tmp_path / "base")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--layers", "-1", "1"]) == 0
    assert "removed layers [1, 5] (0-based)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layerswap"]["removed_layers"] == [1, 5]


BAD_ARGUMENTS = [
    (["prune", "--num-to-remove", "1", "--num-prompts", "0"], "--num-prompts: '0': expected an int >= 1"),
    (["prune", "--num-to-remove", "1", "--num-prompts", "many"], "--num-prompts: 'many' is not an int"),
    (["prune", "--num-to-remove", "0"], "--num-to-remove: '0': expected an int >= 1"),
    (["prune", "--num-to-remove", "1", "--seq-len", "1"], "--seq-len: '1': expected an int >= 2"),
    (["prune", "--num-to-remove", "1", "--batch-size", "0"], "--batch-size: '0': expected an int >= 1"),
    (["prune", "--num-to-remove", "1", "--max-gap", "0"], "--max-gap: '0': expected an int >= 1"),
    (["prune", "--num-to-remove", "1", "--spacing", "-1"], "--spacing: '-1': expected an int >= 0"),
    (["prune", "--num-to-remove", "1", "--max-evaluations", "0"], "--max-evaluations: '0': expected an int >= 1"),
    (["prune", "--num-to-remove", "1", "--sparsity", "1.5"], "--sparsity: '1.5': expected a float in [0, 1)"),
    (["prune", "--num-to-remove", "1", "--strategy", "greedy", "--max-evaluations", "5"],
     "--max-evaluations applies to --strategy search, not 'greedy'"),
    (["prune", "--layers", "1", "--protect", "1"], "LayerSwapConfig(layers=[1], protect=[1]) is contradictory"),
    (["prune", "--num-to-remove", "1", "--allocation", "owl"],
     "--allocation owl given without --sparsity: add --sparsity FRACTION"),
    (["prune", "--num-to-remove", "1", "--pruner", "magnitude"], "--pruner magnitude given without --sparsity"),
    (["prune", "--num-to-remove", "1", "--sparsity-pattern", "2:4"], "--sparsity-pattern 2:4 given without --sparsity"),
    (["prune", "--num-to-remove", "1", "--strategy", "greedy", "--objective", "nll"],
     "LayerSwapConfig(strategy='greedy', objective='nll'): strategy 'greedy' minimises no objective; objective "
     "applies to ['beam', 'search']"),
    (["score", "--num-prompts", "0"], "--num-prompts: '0': expected an int >= 1"),
    (["demo", "--num-prompts", "0"], "--num-prompts: '0': expected an int >= 1"),
    (["demo", "--budgets", "0"], "--budgets: '0': expected an int >= 1"),
    (["demo", "--final-num-to-remove", "0"], "--final-num-to-remove: '0': expected an int >= 1"),
    (["demo", "--time-budget", "0"], "--time-budget: '0': expected finite seconds > 0"),
    (["demo", "--time-budget", "-5"], "--time-budget: '-5': expected finite seconds > 0"),
    (["demo", "--time-budget", "nan"], "--time-budget: 'nan': expected finite seconds > 0"),
    (["demo", "--time-budget", "inf"], "--time-budget: 'inf': expected finite seconds > 0"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a[1:]) for a, _ in BAD_ARGUMENTS])
def test_every_argument_error_exits_2_with_error_before_the_model_loads(tmp_path, capsys, argv, message):
    _tiny_checkpoint(tmp_path / "base")
    verb, rest = argv[0], argv[1:]
    if verb == "prune":
        full = [verb, str(tmp_path / "base"), str(tmp_path / "out"), *rest]
    elif verb == "score":
        full = [verb, str(tmp_path / "base"), "-o", str(tmp_path / "r.json"), *rest]
    else:
        full = [verb, "--model", str(tmp_path / "base"), "--output", str(tmp_path / "out"), *rest]
    assert _exit_code(full) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err
    assert "loading" not in err  # refused before the model loads
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()


def test_a_checkpoint_without_tokenizer_asks_for_one_when_text_calibration_needs_it(tmp_path, capsys):
    model = _tiny_checkpoint(tmp_path / "with-tokenizer")
    model.save_pretrained(tmp_path / "weights-only")
    code = main(["prune", str(tmp_path / "weights-only"), str(tmp_path / "out"), "--num-to-remove", "1",
                 "--num-prompts", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "error: text calibration needs a tokenizer" in err and "--tokenizer" in err
    assert "Couldn't instantiate the backend tokenizer" not in err  # not transformers' raw error
    assert not (tmp_path / "out").exists()
    assert _exit_code(["score", str(tmp_path / "weights-only"), "-o", str(tmp_path / "r.json")]) == 2
    assert "pass --tokenizer with a tokenizer folder or Hub id" in capsys.readouterr().err
    # explicit blocks need no tokenizer; --tokenizer supplies one for scoring
    assert main(["prune", str(tmp_path / "weights-only"), str(tmp_path / "explicit"), "--layers", "2"]) == 0
    assert not (tmp_path / "explicit" / "tokenizer.json").exists()
    calib = _calibration_file(tmp_path / "calib.txt")
    assert main(["prune", str(tmp_path / "weights-only"), str(tmp_path / "scored"), "--num-to-remove", "1",
                 "--strategy", "greedy", "--calibration", str(calib), "--num-prompts", "2",
                 "--tokenizer", str(tmp_path / "with-tokenizer")]) == 0
    assert (tmp_path / "scored" / "tokenizer.json").is_file()


def test_each_verb_is_registered_by_its_own_module():
    import argparse

    from hf_layerswap import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    runs = {name: parser.get_default("func") for name, parser in sub.choices.items()}
    assert runs == {
        "demo": cli.demo.run_demo, "score": cli.score.run_score, "prune": cli.prune.run_prune,
        "heal": cli.heal.run_heal, "push": cli.push.run_push, "peel": cli.peel.run_peel, "eval": cli.eval_verb.run_eval,
        "export-gguf": cli.export_gguf.run_export_gguf,
    }
    # the names scripts use from hf_layerswap.cli are the verb modules' objects
    assert (cli.run_demo, cli.run_score, cli.run_prune, cli.prune_config, cli.demo_config) == (
        cli.demo.run_demo, cli.score.run_score, cli.prune.run_prune, cli.prune.prune_config, cli.demo.demo_config)
    assert cli.format_scores_table is cli.score.format_scores_table and cli.DEFAULT_MODEL == "smollm2-135m"


def test_python_dash_m_runs_the_same_parser():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "hf_layerswap.cli", "prune", "model"], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr
    assert "usage: hf-layerswap prune" in done.stderr
    assert "error: the following arguments are required: output" in done.stderr


def test_registered_methods_are_choices_of_the_command_line():
    """A recovery method / allocator / pruner registered before the parser is built is a
    valid choice of ``hf-layerswap prune`` (the registries, not fixed lists)."""
    from hf_layerswap.cli import build_parser
    from hf_layerswap.recovery import RECOVERY_METHODS
    from hf_layerswap.selection.objectives import OBJECTIVES
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS

    parser = build_parser()
    prune = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" prune"))
    choices = {a.dest: a.choices for a in prune._actions if a.choices is not None}
    assert choices["recovery"] == [m for m in RECOVERY_METHODS if m != "none"]
    assert choices["allocation"] == list(ALLOCATORS) and choices["pruner"] == list(PRUNERS)
    assert choices["objective"] == list(OBJECTIVES)
    RECOVERY_METHODS["my_repair"] = RECOVERY_METHODS["ghosted"]
    try:
        args = build_parser().parse_args(["prune", "m", "out", "--num-to-remove", "1", "--recovery", "my_repair"])
        assert args.recovery == "my_repair"
    finally:
        del RECOVERY_METHODS["my_repair"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prune", "m", "out", "--num-to-remove", "1", "--recovery", "my_repair"])


def test_every_verbs_help_states_each_default_once(capsys):
    """An option whose help text already names its default gets no second ``(default: ...)``,
    and a ``None`` default is not printed."""
    import re

    from hf_layerswap.cli import build_parser

    parser = build_parser()
    verbs = parser._subparsers._group_actions[0].choices
    for name, sub in verbs.items():
        for action in sub._actions:
            if not action.help:
                continue
            text = sub._get_formatter()._expand_help(action)
            assert len(re.findall(r"\(default", text)) <= 1 and "(default: None)" not in text, (name, text)
    prune = verbs["prune"].format_help()
    assert "(default: 64)" in prune and "(default removal_kl)" in prune and "(default: None)" not in prune


# ------------------------- non-finite scores: warned once, kept in the report


def test_cli_score_warns_once_and_keeps_the_values(tmp_path, capsys):
    model = overflowing_model(torch.float32, scale=1e15, family="qwen3")  # overflows float32 too
    model.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(f"paragraph {k} of plain calibration text, long enough to count as a prompt here" for k in range(4)) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.NonFiniteScoresWarning)  # said once, as the warning: line below
        warnings.simplefilter("ignore", hl.CalibrationShortfallWarning)
        assert main(["score", str(tmp_path / "base"), "--calibration", str(calib), "--num-prompts", "4",
                     "--seq-len", "12", "-o", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1
    assert "warning: 15 swap-KL value(s) are kept in the report as results: non-finite values: pair (0, 1) " \
           "replacement_ij = NaN; " in err and "; and 3 more; the values first broke at calibration batch 0" in err
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["pairs"][0]["interchange"] == "NaN" and len(saved["metadata"]["nonfinite"]["values"]) == 15
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--num-to-remove", "1", "--strategy",
                 "greedy", "--report", str(tmp_path / "r.json")]) == 2
    assert "error: cannot select 1 block(s) on finite interchange swap-KL scores" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_re_pruning_a_pruned_checkpoint_by_score_saves_it_with_the_new_report(tmp_path, capsys):
    _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    common = ["--calibration", str(calib), "--num-prompts", "4"]
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p1"), "--layers", "2", "4"]) == 0
    assert main(["prune", str(tmp_path / "p1"), str(tmp_path / "p2"), "--num-to-remove", "1", "--strategy", "greedy",
                 "--protocol", "interchange", *common]) == 0
    record = json.loads((tmp_path / "p2" / "config.json").read_text())["layerswap"]
    report = SwapReport.from_json(tmp_path / "p2" / "layerswap_report.json")
    assert report.num_blocks == 4  # scored on the pruned checkpoint's current blocks
    (local,) = record["steps"][1]["removed_layers"]
    assert [local] == hl.select_layers(report, 1, strategy="greedy", protocol="interchange")
    assert record["steps"][1]["removed_original_layers"] == [[0, 1, 3, 5][local]]
    assert record["removed_layers"] == sorted([2, 4, [0, 1, 3, 5][local]])
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "p2").config.num_hidden_layers == 3
    card = (tmp_path / "p2" / "README.md").read_text()
    assert "measured on the 4-block checkpoint that removal step 1 started from" in card
    assert f"| {local} | " in card and "**removed** |" in card


def test_sparsity_0_records_nothing_so_the_checkpoint_still_heals(tmp_path, capsys):
    _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "p"), "--layers", "2", "--sparsity", "0",
                 "--calibration", str(calib), "--num-prompts", "2"]) == 0
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert "layerswap_sparsity" not in config and config["layerswap"]["removed_layers"] == [2]
    assert not (tmp_path / "p" / "layerswap_sparsity.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    assert all(int((p == 0).sum()) == 0 for p in reloaded.model.layers.parameters() if p.dim() == 2)


def test_version_prints_the_library_version(capsys):
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-layerswap {hl.__version__}"
