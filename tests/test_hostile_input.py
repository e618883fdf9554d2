"""Input a hostile or careless user gives: private paths that must not be published, paths
that do not exist, files that are not text, models that are not causal LMs, budgets and
configs that cannot be met, reports of another model, interrupted saves, and what the
command line prints and exits with. Each test fails on the defect it names."""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_matrix import build, prompts, single_thread, tiny_tokenizer
from test_hub import TOKEN, hub  # noqa: F401 (hub: the loopback Hub fixture)

import hf_layerswap as hl

PARAGRAPHS = [
    "Layer removal keeps the kept blocks in order, and the cache is renumbered after the cut.",
    "A swap probe runs the model under a temporary plan and restores the original plan exactly.",
    "Interchange swaps two neighbouring blocks; replacement runs one block twice in a row here.",
    "The calibration prompts are real prose, split at blank lines and truncated to a budget.",
    "Perplexity is measured in sliding windows, and only the new tokens of a window are scored.",
    "A model card records the removed blocks, the scores of both protocols and the contract.",
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _write_text(path: Path, paragraphs=PARAGRAPHS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- 1. local paths


def _fetch_every_file(hub, repo_id: str, out: Path) -> Path:  # noqa: F811 (hub: the fixture's server)
    """Download every file of ``repo_id`` through the stand-in, in a fresh process (the
    download helpers read the endpoint when huggingface_hub is imported)."""
    script = "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], local_dir=sys.argv[2])"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(out.parent / "hf_home"), HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0",
               HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run([sys.executable, "-c", script, repo_id, str(out)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_published_files_carry_no_local_path_component(hub, tmp_path):  # noqa: F811 (fixture)
    from transformers import AutoModelForCausalLM

    user = getpass.getuser()
    home = tmp_path / "home" / f"{user}-x7q" / "private projects" / "run-2031"
    checkpoint = home / "ckpt-final"
    build("llama").save_pretrained(checkpoint)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(checkpoint)
    calibration = _write_text(home / "calib data" / "valid.txt")
    eval_text = _write_text(home / "eval data" / "held-out.txt", PARAGRAPHS[::-1])

    base = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    config = hl.LayerSwapConfig(num_layers=1, calibration=str(calibration), tokenizer=tokenizer,
                                num_prompts=4, seq_len=24, batch_size=2, progress=False)
    pruned = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config,
                                                  attn_implementation="eager").eval()
    options = dict(tokenizer=tokenizer, window=64, stride=32, bootstrap=20)
    evaluation = {"base": hl.evaluate_perplexity(base, eval_text, **options),
                  "pruned": hl.evaluate_perplexity(pruned, eval_text, **options)}
    # the identity names the folder and the weights, nothing above the folder
    assert evaluation["base"].contract["model"]["name"] == "ckpt-final"
    assert len(evaluation["base"].contract["model"]["fingerprint"]) == 64
    assert pruned.layerswap_report.metadata["model"]["name"] == "ckpt-final"

    hl.push_to_hub(pruned, "user/private-check", tokenizer=tokenizer, report=pruned.layerswap_report,
                   evaluation=evaluation, token=TOKEN, endpoint=hub.url)
    fetched = _fetch_every_file(hub, "user/private-check", tmp_path / "fetched")
    files = {p.relative_to(fetched).as_posix(): p.read_bytes() for p in fetched.rglob("*")
             if p.is_file() and ".cache" not in p.relative_to(fetched).parts}
    assert {"config.json", "model.safetensors", "README.md", "layerswap_report.json",
            "layerswap_evaluation.json", "tokenizer.json"} <= set(files)
    assert files == hub.files("user/private-check") | {".gitattributes": files[".gitattributes"]}

    private = {part for path in (checkpoint, calibration, eval_text) for part in path.parent.parts if part != "/"}
    private |= {user, str(tmp_path)}
    leaks = {name: sorted(part for part in private if part.encode() in data) for name, data in files.items()}
    assert {name: parts for name, parts in leaks.items() if parts} == {}
    # the folder and file names may be named, but only bare, never after a separator
    for bare in ("ckpt-final", "valid.txt", "held-out.txt"):
        behind_separator = [name for name, data in files.items() if re.search(rb"[/\\]" + re.escape(bare.encode()), data)]
        assert behind_separator == []
    assert b'"ckpt-final"' in files["layerswap_report.json"]
