"""benchmarks/gpu.py: its smoke run on the CPU (tiny shapes) writes a page of the
measured page's structure, the committed page says no GPU run was made, and its FLOP
counter counts matrix products by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu.py"


def _module():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def test_gpu_benchmark_smoke_run_writes_the_page_and_its_json(tmp_path):
    refused = _run("--smoke", cwd=tmp_path)
    assert refused.returncode == 2 and "--smoke needs --out" in refused.stderr
    done = _run("--smoke", "--out", str(tmp_path / "gpu.md"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "gpu.md").read_text()
    data = json.loads((tmp_path / "gpu.json").read_text())
    headings = [line for line in page.splitlines() if line.startswith("#")]
    assert headings == [
        "# GPU check: bf16 vs fp32, an 8B-shaped model, a model split between GPU and CPU", "## Targets",
        "## (a) bf16 vs fp32 agreement", "### tiny-llama (8 prompts x 16 tokens, adjacent pairs)",
        "## (b) Llama-3.1-8B's shape, random bf16 weights", "## (c) A model split between devices",
    ]
    assert "(smoke run: tiny shapes on the CPU, not a measurement)" in page
    assert data["targets"] == dict.fromkeys(data["targets"], "not measured") and len(data["targets"]) == 6
    assert page.count("| not measured |") == 6
    a = data["agreement"][0]
    assert set(a["spearman"]) == {"replacement", "interchange"} and set(a["same_selection"]) == {"1", "2"}
    for p, rho in a["spearman"].items():  # the page shows the JSON's numbers
        assert f"| {p} | {rho:.4f} | {a['pair_rel_error'][p]['max']:.2e} |" in page
    b = data["llama_8b"]
    assert [r["max_memory_arg"] for r in b["scoring"]] == ["16MiB", "64MiB", None]
    assert [r["max_memory"] for r in b["scoring"]][:2] == [16 * 2**20, 64 * 2**20]
    assert b["scoring"][2]["source"].startswith("auto: 25% of ")
    assert len({r["block_evaluations"] for r in b["scoring"]}) == 1  # the budget changes how, not what
    prune = b["prune"]
    assert len(prune["removed"]) == 2 and prune["flops"] > 0 and prune["seconds"] > 0
    # the search's candidate sets, from its cost record (the selection record has no "evaluations")
    assert isinstance(prune["evaluations"], int) and prune["evaluations"] >= 1
    # the estimate of (b)'s prune is printed before any part runs
    estimate = data["estimate"]
    assert estimate["lines"] and estimate["lines"][0] in done.stderr
    assert done.stderr.index(estimate["lines"][0]) < done.stderr.index("(a) smollm2-135m")
    assert done.stderr.index("(b)'s default prune, estimated before the run (hl.estimate_cost):") == 0
    # bf16 bytes of the smoke shape: embeddings and head 2 x 512 x 64, six blocks of q/o 64 x 64,
    # k/v 64 x 32 (2 KV heads of 16), gate/up/down 64 x 160 and two norms of 64, a final norm of 64
    assert b["weights_bytes"] == 2 * (2 * 512 * 64 + 6 * (2 * 4096 + 2 * 2048 + 3 * 10240 + 128) + 64)
    c = data["split"]
    assert c["runs"]["split"]["placement"] == {"cpu": 7, "disk": 3} and c["max_rel_diff"] == 0.0 and c["same_greedy"]
    assert "| split | cpu: 7, disk: 3 |" in page
    assert "Largest relative difference of the split model's pair KLs from the in-memory model's: 0.00e+00" in page


def test_committed_page_says_no_gpu_run_was_made_and_lists_the_targets():
    gpu = _module()
    page = (REPO_ROOT / "benchmarks" / "results" / "gpu.md").read_text()
    assert page == gpu.pending_page()
    assert page.count("| not yet measured |") == len(gpu.TARGETS) == 6
    assert "No GPU run has been made yet. The numbers of this page come from `python benchmarks/gpu.py`" in page


def test_matmul_flop_counter_by_hand():
    gpu = _module()
    x, w = torch.randn(3, 5, 7), torch.randn(11, 7)
    with gpu.MatmulFlops() as counter:
        torch.nn.functional.linear(x, w)  # 15 rows x 11 outputs x 7 multiply-adds
        torch.randn(4, 6) @ torch.randn(6, 2)  # 4 x 2 x 6
        torch.addmm(torch.zeros(4, 2), torch.randn(4, 6), torch.randn(6, 2))  # 4 x 2 x 6
        q = torch.randn(1, 2, 5, 8)
        torch.nn.functional.scaled_dot_product_attention(q, torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8))
        torch.randn(100).exp()  # not a product
    assert counter.flops == 2 * 15 * 11 * 7 + 2 * (2 * 4 * 2 * 6) + 4 * (2 * 5 * 8) * 9


def test_a_failing_part_keeps_the_parts_measured_before_it(tmp_path, monkeypatch):
    """Each part's results are written as it ends: a crash in part (b) leaves (a) in the JSON
    (and no page, which needs all three parts)."""
    gpu = _module()

    def crash(*args, **kwargs):
        raise RuntimeError("out of memory in part (b)")

    monkeypatch.setattr(gpu, "llama_8b", crash)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(RuntimeError, match="out of memory in part"):
        gpu.main(["--smoke", "--out", str(tmp_path / "gpu.md"), "--parts", "a", "b"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert [m["model"] for m in data["agreement"]] == ["tiny-llama"] and data["llama_8b"] is None
    assert set(data["agreement"][0]["spearman"]) == {"replacement", "interchange"}
    assert not (tmp_path / "gpu.md").exists()


def test_parts_a_and_c_build_the_real_shapes_from_the_configs_in_the_tree(tmp_path, monkeypatch):
    """Without the real checkpoints (a GPU machine gets the working tree only), parts (a) and
    (c) build each model's shape from ``benchmarks/configs/<name>.json`` with random weights
    and random tokens; ``--weights real`` refuses instead, naming why."""
    gpu = _module()
    tiny = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
            "tie_word_embeddings": True, "max_position_embeddings": 64}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.json").write_text(json.dumps(tiny))
    monkeypatch.setattr(gpu, "CONFIGS", tmp_path / "configs")

    def not_installed(name):
        raise ModuleNotFoundError(f"the package shipping {name} is not installed")

    monkeypatch.setattr(gpu, "bundled_checkpoint_dir", not_installed)
    assert gpu.model_source("tiny", "random") is None and gpu.model_source("tiny", "auto") is None
    with pytest.raises(SystemExit, match="--weights real: tiny: the package shipping tiny is not installed"):
        gpu.model_source("tiny", "real")
    path, calib, used = gpu.checkpoint_and_calibration("tiny", "auto", tmp_path / "ckpt", 4, 8)
    assert used == "random" and path == tmp_path / "ckpt"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (3, 32, 97)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as configured
    ids = calib.input_ids
    assert tuple(ids.shape) == (4, 8) and int(ids.min()) >= 0 and int(ids.max()) < 97
    # the same seed gives the same weights: a rerun measures the same model
    again, _, _ = gpu.checkpoint_and_calibration("tiny", "random", tmp_path / "again", 4, 8)
    twin = AutoModelForCausalLM.from_pretrained(again)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_configs_in_the_tree_are_the_real_checkpoints_configs(name):
    """``benchmarks/configs/<name>.json`` holds the real checkpoint's shape: every key it has
    equals the checkpoint's ``config.json`` value, and it leaves out only the name and the
    writing library's version."""
    from hf_layerswap.models import bundled_checkpoint_dir

    real = json.loads((bundled_checkpoint_dir(name) / "config.json").read_text())
    ours = json.loads((REPO_ROOT / "benchmarks" / "configs" / f"{name}.json").read_text())
    assert {k: real[k] for k in ours} == ours
    assert set(real) - set(ours) == {"_model_name_or_path", "transformers_version"}
