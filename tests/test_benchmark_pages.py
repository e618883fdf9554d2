"""The benchmark pages re-render byte for byte from their stored runs with today's code:
the quality pages and their index, speed, recovery, precision, streaming, heal and the two sparsity pages are
rewritten from the JSON beside them with each script's ``--render-only`` (no model is
loaded), so a refactoring that changes a stored number or its rendering fails here. The pages
of the benchmarks on the runner (heal, sparsity) are rendered from their state split in two
files and merged back with ``--merge-from``, so the merge keeps every stored value too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _split(state_path: Path, cells: str, folder: Path) -> tuple[Path, Path]:
    """The stored state cut in two files, as two processes of the runner would leave them: the
    first half of the cells with everything else, and the second half of the cells alone."""
    state = json.loads(state_path.read_text(encoding="utf-8"))
    keys = list(state[cells])
    half = len(keys) // 2
    first, second = folder / "a" / state_path.name, folder / "b" / state_path.name  # the page may name its file
    first.parent.mkdir(exist_ok=True)
    second.parent.mkdir(exist_ok=True)
    first.write_text(json.dumps({**state, cells: {k: state[cells][k] for k in keys[:half]}}), encoding="utf-8")
    second.write_text(json.dumps({cells: {k: state[cells][k] for k in keys[half:]}}), encoding="utf-8")
    return first, second


def _run(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_quality_pages_rerender_unchanged(tmp_path):
    states = sorted(RESULTS.glob("quality-*.json"))
    assert len(states) >= 2
    for state in states:
        shutil.copy(state, tmp_path / state.name)
    _run([str(ROOT / "benchmarks" / "quality.py"), "--render-only", "--results", str(tmp_path)], ROOT)
    pages = [s.with_suffix(".md").name for s in states] + ["quality.md"]
    for page in pages:
        assert (tmp_path / page).read_bytes() == (RESULTS / page).read_bytes(), page


def test_speed_page_rerenders_unchanged(tmp_path):
    shutil.copy(RESULTS / "speed.json", tmp_path / "speed.json")
    _run([str(ROOT / "benchmarks" / "speed.py"), "--render-only", "--out", str(tmp_path / "speed.md")], ROOT)
    assert (tmp_path / "speed.md").read_bytes() == (RESULTS / "speed.md").read_bytes()


def test_recovery_page_rerenders_unchanged(tmp_path):
    for state in RESULTS.glob("recovery*.json"):
        shutil.copy(state, tmp_path / state.name)
    _run([str(ROOT / "benchmarks" / "recovery.py"), "--render-only", "--out", str(tmp_path / "recovery.md"),
          "--models", "smollm2-135m", "gemma3-270m", "--budgets", "1", "2", "3", "4", "5", "6"], ROOT)
    assert (tmp_path / "recovery.md").read_bytes() == (RESULTS / "recovery.md").read_bytes()


def test_sparsity_pages_rerender_unchanged(tmp_path):
    """Each page from its stored cache, split in two and merged back by the runner first."""
    for model in ("smollm2-135m", "gemma3-270m"):
        out = tmp_path / f"sparsity-{model}.md"
        first, second = _split(RESULTS / f"sparsity-{model}.json", "runs", tmp_path)
        _run([str(ROOT / "benchmarks" / "sparsity.py"), "--model", model, "--render-only",
              "--json", str(first), "--merge-from", str(second), "--output", str(out)], ROOT)
        assert out.read_bytes() == (RESULTS / out.name).read_bytes(), out.name


def test_precision_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "precision.md"
    _run([str(ROOT / "benchmarks" / "precision.py"), "--render-only", "--json", str(RESULTS / "precision.json"),
          "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "precision.md").read_bytes()


def test_heal_page_rerenders_unchanged(tmp_path):
    """The page from its stored state, split in two and merged back by the runner first."""
    first, second = _split(RESULTS / "heal.json", "cells", tmp_path)
    _run([str(ROOT / "benchmarks" / "heal.py"), "--render-only", "--json", str(first), "--merge-from", str(second),
          "--out", str(tmp_path / "heal.md")], ROOT)
    assert (tmp_path / "heal.md").read_bytes() == (RESULTS / "heal.md").read_bytes()


def test_streaming_page_rerenders_unchanged(tmp_path):
    shutil.copy(RESULTS / "streaming.json", tmp_path / "streaming.json")
    _run([str(ROOT / "benchmarks" / "streaming.py"), "--render-only", "--out", str(tmp_path / "streaming.md")], ROOT)
    assert (tmp_path / "streaming.md").read_bytes() == (RESULTS / "streaming.md").read_bytes()
