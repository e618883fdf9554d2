"""The benchmark pages re-render byte for byte from their stored runs with today's code:
the quality pages and their index, speed, recovery, precision, streaming, heal and the two sparsity pages are
rewritten from the JSON beside them with each script's ``--render-only`` (no model is
loaded), so a refactoring that changes a stored number or its rendering fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


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
    for model in ("smollm2-135m", "gemma3-270m"):
        out = tmp_path / f"sparsity-{model}.md"
        _run([str(ROOT / "benchmarks" / "sparsity.py"), "--model", model, "--render-only",
              "--json", str(RESULTS / f"sparsity-{model}.json"), "--output", str(out)], ROOT)
        assert out.read_bytes() == (RESULTS / out.name).read_bytes(), out.name


def test_precision_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "precision.md"
    _run([str(ROOT / "benchmarks" / "precision.py"), "--render-only", "--json", str(RESULTS / "precision.json"),
          "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "precision.md").read_bytes()


def test_heal_page_rerenders_unchanged(tmp_path):
    shutil.copy(RESULTS / "heal.json", tmp_path / "heal.json")
    _run([str(ROOT / "benchmarks" / "heal.py"), "--render-only", "--json", str(tmp_path / "heal.json"),
          "--out", str(tmp_path / "heal.md")], ROOT)
    assert (tmp_path / "heal.md").read_bytes() == (RESULTS / "heal.md").read_bytes()


def test_streaming_page_rerenders_unchanged(tmp_path):
    shutil.copy(RESULTS / "streaming.json", tmp_path / "streaming.json")
    _run([str(ROOT / "benchmarks" / "streaming.py"), "--render-only", "--out", str(tmp_path / "streaming.md")], ROOT)
    assert (tmp_path / "streaming.md").read_bytes() == (RESULTS / "streaming.md").read_bytes()
