"""``hf-layerswap eval``: perplexity and lm-eval tasks of a checkpoint through the CLI, the
JSON result against the Python API, and bad input refused before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from arch_matrix import tiny_tokenizer
from conftest import tiny_model

import hf_layerswap as hl
from hf_layerswap.cli import main
from hf_layerswap.models import load_model

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
TEXT = "\n\n".join(
    "The river rose in the night and the bridge keepers rang the bell twice before dawn. " * 3 for _ in range(6)
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "pruned"
    model = tiny_model("llama", 6)
    hl.remove_layers(model, [2, 4])
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_perplexity_json_equals_the_python_api(checkpoint, text_file, tmp_path, capsys):
    out = tmp_path / "result.json"
    args = ["eval", str(checkpoint), "--text", str(text_file), "--contract", "matched", "--window", "64",
            "--stride", "32", "--bootstrap", "50", "-o", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    model, tok = load_model(checkpoint)
    direct = hl.evaluate_perplexity(model, str(text_file), tokenizer=tok, window=64, stride=32, bootstrap=50)
    assert result["perplexity"] == json.loads(json.dumps(direct.to_dict()))
    assert result["tasks"] is None
    assert result["model"]["name"] == "pruned" and result["model"]["num_blocks"] == 4
    printed = capsys.readouterr().out
    assert f"perplexity {direct.ppl:.4f} (95% CI" in printed and f"result written to {out}" in printed


def test_rolling_contract_and_lm_eval_tasks_in_one_result(checkpoint, text_file, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    out = tmp_path / "both.json"
    args = ["eval", str(checkpoint), "--text", str(text_file), "--contract", "rolling", "--window", "32",
            "--bootstrap", "0", "--tasks", "layerswap_mc", "layerswap_rolling", "--include-path", str(TASKS),
            "--max-length", "32", "--batch-size", "1", "-o", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["perplexity"]["contract"]["name"] == "rolling" and result["perplexity"]["ci_low"] is None
    tasks = hl.TaskResults.from_dict(result["tasks"])
    assert tasks.n_samples == {"layerswap_mc": 8, "layerswap_rolling": 4}
    assert 0 <= tasks.results["layerswap_mc"]["acc"] <= 1
    assert tasks.settings["max_length"] == 32 and tasks.versions["lm_eval"] == __import__("lm_eval").__version__
    # the rolling task's per-document loglikelihoods are our rolling contract on the same documents
    docs = [json.loads(line)["text"] for line in (TASKS / "layerswap_rolling.jsonl").read_text().splitlines()]
    model, tok = load_model(checkpoint)
    ours = [hl.evaluate_perplexity(model, [d], tokenizer=tok, contract="rolling", window=32, bootstrap=0).nll
            for d in docs]
    assert [-x for x in tasks.loglikelihoods["layerswap_rolling"]] == pytest.approx(ours, abs=1e-4)
    assert "layerswap_mc: acc " in capsys.readouterr().out


def test_tasks_alone_skip_perplexity(checkpoint, tmp_path):
    pytest.importorskip("lm_eval")
    out = tmp_path / "tasks.json"
    assert main(["eval", str(checkpoint), "--tasks", "layerswap_mc", "--include-path", str(TASKS), "--limit", "3",
                 "--max-length", "32", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["perplexity"] is None and result["tasks"]["n_samples"] == {"layerswap_mc": 3}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--contract", "rolling", "--stride", "8"], "takes --window"),
        (["--text", "missing.txt"], "no such file"),
        (["--include-path", "no-such-folder", "--tasks", "x"], "not a folder of task YAML files"),
        (["--num-fewshot", "-1"], "must be >= 0"),
    ],
)
def test_bad_input_is_refused_before_the_model_loads(tmp_path, capsys, extra, message):
    missing_model = tmp_path / "no-such-model"
    assert main(["eval", str(missing_model), "-o", str(tmp_path / "r.json"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "loading" not in err
    assert not (tmp_path / "r.json").exists()


def test_output_folder_and_bad_limit_are_refused(tmp_path, capsys):
    assert main(["eval", "x", "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "x", "--limit", "0"])
    assert "--limit '0'" in capsys.readouterr().err


def test_a_window_below_the_contracts_stride_takes_it_as_stride(checkpoint, text_file, tmp_path, capsys):
    out = tmp_path / "full.json"
    assert main(["eval", str(checkpoint), "--text", str(text_file), "--contract", "full", "--window", "16",
                 "--bootstrap", "0", "-o", str(out)]) == 0
    contract = json.loads(out.read_text())["perplexity"]["contract"]
    assert (contract["window"], contract["stride"]) == (16, 16)
    model, tok = load_model(checkpoint)
    direct = hl.evaluate_perplexity(model, str(text_file), tokenizer=tok, contract="full", window=16, stride=16,
                                    bootstrap=0)
    assert json.loads(out.read_text())["perplexity"]["ppl"] == pytest.approx(direct.ppl, rel=0, abs=0)
    assert main(["eval", str(checkpoint), "--text", str(text_file), "--window", "64", "--bootstrap", "0",
                 "-o", str(tmp_path / "m.json")]) == 0  # matched: stride 256 fits to 64; a larger window keeps 256
    assert json.loads((tmp_path / "m.json").read_text())["perplexity"]["contract"]["stride"] == 64
