"""benchmarks/nll_offload.py: both arms on a tiny checkpoint, and the page from its JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import benchmark_script, tiny_checkpoint, tiny_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_both_arms_run_sleb_on_a_tiny_checkpoint_with_its_head_on_disk(tmp_path):
    """Each arm loads the tiny Llama with its head and half its blocks on disk and runs SLEB;
    today's reads the head once (one batch, one head phase) and never through accelerate's
    hook, and the page names both arms."""
    bench = benchmark_script("nll_offload")
    tiny_checkpoint(tmp_path / "ckpt", tiny_model("llama", 4))
    out = tmp_path / "page.md"
    assert bench.main(["--checkpoint", str(tmp_path / "ckpt"), "--baseline", "HEAD", "--n", "1", "--num-prompts", "2",
                       "--seq-len", "16", "--max-memory", "64MiB", "--out", str(out)]) == 0
    rows = {r["arm"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"before", "after"}
    assert rows["after"]["head_loads"] == 1 and rows["after"]["hook_loads"] == 0
    assert rows["before"]["removed"] == rows["after"]["removed"] and len(rows["after"]["removed"]) == 1
    text = out.read_text()
    assert "| before |" in text and "| after |" in text and "same blocks removed: yes" in text


def test_the_page_rerenders_from_its_json(tmp_path):
    """``--render-only`` rewrites the stored page byte for byte from the JSON beside it."""
    shutil.copy(RESULTS / "nll_offload.json", tmp_path / "nll_offload.json")
    out = tmp_path / "nll_offload.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nll_offload.py"), "--render-only", "--out", str(out)],
                   cwd=ROOT, check=True)
    assert out.read_bytes() == (RESULTS / "nll_offload.md").read_bytes()
