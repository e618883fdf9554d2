"""The hf-layerswap command line on a tiny checkpoint and (slow) the demo on SmolLM2-135M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_layerswap import SwapReport
from hf_layerswap.cli import main


def _tiny_checkpoint(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_model("qwen3")
    vocab = {f"w{i}": i for i in range(model.config.vocab_size - 1)}
    vocab["[UNK]"] = model.config.vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


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
    assert report.num_layers == 6 and len(report.pairs) == 5
    assert report.metadata["num_prompts"] == 4
    assert "| layer | replacement s(i) | rank | interchange s(i) | rank |" in capsys.readouterr().out

    rc = main(["prune", str(tmp_path / "base"), str(tmp_path / "pruned"), "--num-layers", "2",
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
    assert "calibration budget: 8 prompts" in text
    assert "perplexity evaluations" in captured.err  # progress bar over the base model and each removal set
    contract = next(line for line in text.splitlines() if line.startswith("contract: "))
    assert contract.startswith("contract: matched: first 400 words of ") and "window 512, stride 256" in contract
    assert str(Path.home()) not in text
    assert "| 1 | replacement |" in text and "| 1 | interchange |" in text and "| 1 | search |" in text
    assert "final: removed" in text and "(strategy search:" in text
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 28 and len(config["layerswap"]["removed_layers"]) == 2
    report = SwapReport.from_json(out / "layerswap_report.json")
    assert report.num_layers == 30 and report.selections[-1]["selected"] == config["layerswap"]["removed_layers"]
    decision = report.selections[-1]
    assert decision["strategy"] == "search" and decision["total_cost"]["evaluator_calls"] <= 90
    for entry in decision["protocol_sets"].values():  # the searched set is never worse than a protocol's set
        assert entry is None or decision["value"] <= entry["value"]
    assert (out / "README.md").is_file()


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
