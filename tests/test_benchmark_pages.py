"""The benchmark pages re-render byte for byte from their stored runs with today's code:
the quality pages and their index, speed, recovery, precision, streaming, heal, the two sparsity
pages, scale, gpu, KL arithmetic, the unscored selection, threads and peeling (its training-trajectory section too, from the training run's
record) are rewritten from the JSON beside them with each script's ``--render-only`` (no model is
loaded), so a refactoring that changes a stored number or its rendering fails here. The pages
of the benchmarks on the runner (all but scale, gpu and peeling) are rendered from their state split in two
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
    stored = state[cells]  # a mapping of cells, or a list of records (precision's models)
    half = len(stored) // 2
    if isinstance(stored, list):
        head, tail = stored[:half], stored[half:]
    else:
        keys = list(stored)
        head, tail = {k: stored[k] for k in keys[:half]}, {k: stored[k] for k in keys[half:]}
    assert head and tail, f"{state_path.name}: too few cells to split"
    first, second = folder / "a" / state_path.name, folder / "b" / state_path.name  # the page may name its file
    first.parent.mkdir(exist_ok=True)
    second.parent.mkdir(exist_ok=True)
    first.write_text(json.dumps({**state, cells: head}), encoding="utf-8")
    second.write_text(json.dumps({cells: tail}), encoding="utf-8")
    return first, second


def _run(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_quality_pages_rerender_unchanged(tmp_path):
    """Both models' pages and the index, each model's state split in two (its criteria halved, as
    two processes of the runner would leave them) and merged back by the runner first."""
    states = sorted(RESULTS.glob("quality-*.json"))
    assert len(states) >= 2
    pieces = {state.stem.removeprefix("quality-"): _split(state, "criteria", tmp_path)[1] for state in states}
    for model, piece in pieces.items():
        _run([str(ROOT / "benchmarks" / "quality.py"), "--render-only", "--results", str(tmp_path / "a"),
              "--model", model, "--merge-from", str(piece)], ROOT)
    pages = [s.with_suffix(".md").name for s in states] + ["quality.md"]
    for page in pages:
        assert (tmp_path / "a" / page).read_bytes() == (RESULTS / page).read_bytes(), page
    for state in states:  # the merge restores each stored file's content
        assert json.loads((tmp_path / "a" / state.name).read_text(encoding="utf-8")) == json.loads(
            state.read_text(encoding="utf-8")), state.name


def test_speed_page_rerenders_unchanged(tmp_path):
    """The page from its stored models (a list), split in two and merged back by the runner first."""
    first, second = _split(RESULTS / "speed.json", "models", tmp_path)
    out = first.with_suffix(".md")  # the JSON is read beside the page
    _run([str(ROOT / "benchmarks" / "speed.py"), "--render-only", "--merge-from", str(second), "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "speed.md").read_bytes()
    assert json.loads(first.read_text(encoding="utf-8")) == json.loads((RESULTS / "speed.json").read_text(encoding="utf-8"))


def test_recovery_page_rerenders_unchanged(tmp_path):
    """Each model's file split in two (its removal sets and rows halved, as two processes of the
    runner would leave them) and merged back by the runner first."""
    pieces = []
    for state in RESULTS.glob("recovery*.json"):
        shutil.copy(state, tmp_path / state.name)
    for model in ("smollm2-135m", "gemma3-270m"):
        path = tmp_path / f"recovery-{model}.json"
        state = json.loads(path.read_text(encoding="utf-8"))
        result, half = state["result"], len(state["result"]["evaluated"]) // 2
        head = {**state, "result": {**result, "evaluated": result["evaluated"][:half], "rows": result["rows"][:half],
                                    "complete": False}}
        tail = {**state, "result": {**result, "evaluated": result["evaluated"][half:], "rows": result["rows"][half:]}}
        path.write_text(json.dumps(head), encoding="utf-8")
        (tmp_path / "b").mkdir(exist_ok=True)
        pieces.append(tmp_path / "b" / path.name)
        pieces[-1].write_text(json.dumps(tail), encoding="utf-8")
    _run([str(ROOT / "benchmarks" / "recovery.py"), "--render-only", "--out", str(tmp_path / "recovery.md"),
          "--models", "smollm2-135m", "gemma3-270m", "--budgets", "1", "2", "3", "4", "5", "6",
          "--merge-from", *map(str, pieces)], ROOT)
    assert (tmp_path / "recovery.md").read_bytes() == (RESULTS / "recovery.md").read_bytes()
    for model in ("smollm2-135m", "gemma3-270m"):  # the merge restores each stored file's content
        name = f"recovery-{model}.json"
        assert json.loads((tmp_path / name).read_text(encoding="utf-8")) == json.loads(
            (RESULTS / name).read_text(encoding="utf-8")), name


def test_sparsity_pages_rerender_unchanged(tmp_path):
    """Each page from its stored cache, split in two and merged back by the runner first."""
    for model in ("smollm2-135m", "gemma3-270m"):
        out = tmp_path / f"sparsity-{model}.md"
        first, second = _split(RESULTS / f"sparsity-{model}.json", "runs", tmp_path)
        _run([str(ROOT / "benchmarks" / "sparsity.py"), "--model", model, "--render-only",
              "--json", str(first), "--merge-from", str(second), "--output", str(out)], ROOT)
        assert out.read_bytes() == (RESULTS / out.name).read_bytes(), out.name


def test_precision_page_rerenders_unchanged(tmp_path):
    """The page from its stored models (a list), split in two and merged back by the runner first."""
    out = tmp_path / "precision.md"
    first, second = _split(RESULTS / "precision.json", "models", tmp_path)
    _run([str(ROOT / "benchmarks" / "precision.py"), "--render-only", "--json", str(first), "--merge-from", str(second),
          "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "precision.md").read_bytes()
    assert json.loads(first.read_text(encoding="utf-8")) == json.loads((RESULTS / "precision.json").read_text(encoding="utf-8"))


def test_heal_page_rerenders_unchanged(tmp_path):
    """The page from its stored state, split in two and merged back by the runner first."""
    first, second = _split(RESULTS / "heal.json", "cells", tmp_path)
    _run([str(ROOT / "benchmarks" / "heal.py"), "--render-only", "--json", str(first), "--merge-from", str(second),
          "--out", str(tmp_path / "heal.md")], ROOT)
    assert (tmp_path / "heal.md").read_bytes() == (RESULTS / "heal.md").read_bytes()


def test_streaming_page_rerenders_unchanged(tmp_path):
    """The page from its stored rows (a list), split in two and merged back by the runner first."""
    first, second = _split(RESULTS / "streaming.json", "rows", tmp_path)
    out = first.with_suffix(".md")  # the JSON is read beside the page
    _run([str(ROOT / "benchmarks" / "streaming.py"), "--render-only", "--merge-from", str(second), "--out", str(out)],
         ROOT)
    assert out.read_bytes() == (RESULTS / "streaming.md").read_bytes()
    assert json.loads(first.read_text(encoding="utf-8")) == json.loads((RESULTS / "streaming.json").read_text(encoding="utf-8"))


def test_head_precision_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "head_precision.md"
    shutil.copy(RESULTS / "head_precision.json", tmp_path / "head_precision.json")
    _run([str(ROOT / "benchmarks" / "head_precision.py"), "--render-only", "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "head_precision.md").read_bytes()


def test_kl_arithmetic_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "kl_arithmetic.md"
    shutil.copy(RESULTS / "kl_arithmetic.json", tmp_path / "kl_arithmetic.json")
    _run([str(ROOT / "benchmarks" / "kl_arithmetic.py"), "--render-only", "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "kl_arithmetic.md").read_bytes()


def test_unscored_selection_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "unscored_selection.md"
    shutil.copy(RESULTS / "unscored_selection.json", tmp_path / "unscored_selection.json")
    _run([str(ROOT / "benchmarks" / "unscored_selection.py"), "--render-only", "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "unscored_selection.md").read_bytes()


def test_threads_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "threads.md"
    shutil.copy(RESULTS / "threads.json", tmp_path / "threads.json")
    _run([str(ROOT / "benchmarks" / "threads.py"), "--render-only", "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "threads.md").read_bytes()


def test_scale_page_rerenders_unchanged(tmp_path):
    """scale.md from scale.json (and the quality runs' stored SLEB rows it quotes)."""
    _run([str(ROOT / "benchmarks" / "scale.py"), "--render-only", "--json", str(RESULTS / "scale.json"),
          "--out", str(tmp_path / "scale.md")], ROOT)
    assert (tmp_path / "scale.md").read_bytes() == (RESULTS / "scale.md").read_bytes()


def test_gpu_page_rerenders_unchanged(tmp_path):
    """From gpu.json beside the page; while no GPU run is stored (none yet) the page is the one
    before any run, every target 'not yet measured'."""
    if (RESULTS / "gpu.json").exists():
        shutil.copy(RESULTS / "gpu.json", tmp_path / "gpu.json")
    _run([str(ROOT / "benchmarks" / "gpu.py"), "--render-only", "--out", str(tmp_path / "gpu.md")], ROOT)
    assert (tmp_path / "gpu.md").read_bytes() == (RESULTS / "gpu.md").read_bytes()


def test_peeling_page_rerenders_unchanged(tmp_path):
    """peeling.md from the stored reports under results/peeling/, with the command its header names,
    the training-trajectory section included: drawn from trajectory.json and the training run's
    record trajectory_run.json (blocks, parameters, vocabulary, steps, tokens, seconds), never
    copied from the page (``--skip-trajectory`` leaves the section and its recorded times out)."""
    _run([str(ROOT / "benchmarks" / "peeling.py"), "--render-only", "--models", "smollm2-135m", "gemma3-270m",
          "--out", str(tmp_path / "peeling.md")], ROOT)
    page = (RESULTS / "peeling.md").read_bytes()
    assert (tmp_path / "peeling.md").read_bytes() == page
    _run([str(ROOT / "benchmarks" / "peeling.py"), "--render-only", "--models", "smollm2-135m", "gemma3-270m",
          "--skip-trajectory", "--out", str(tmp_path / "without.md")], ROOT)
    without = (tmp_path / "without.md").read_text(encoding="utf-8")
    assert "## Training trajectory" not in without and "training run:" not in without
    assert "training run:" in page.decode("utf-8")
    section = page.decode("utf-8").split("\n## Training trajectory", 1)[1]
    run = json.loads((RESULTS / "peeling" / "trajectory_run.json").read_text(encoding="utf-8"))
    record = run["record"]
    assert (f"{record['model']['parameters']:,} parameters, BPE vocabulary {record['tokenizer']['vocab_size']} "
            f"trained on the training articles; {record['training']['steps']} AdamW steps") in section
    assert f"{record['seconds']['training']:.0f} s of training" in section
    assert f"Peeling + swap-KL of 6 checkpoints: {run['seconds']:.0f} s." in section


def test_memory_budget_page_rerenders_unchanged(tmp_path):
    out = tmp_path / "memory_budget.md"
    shutil.copy(RESULTS / "memory_budget.json", tmp_path / "memory_budget.json")
    _run([str(ROOT / "benchmarks" / "memory_budget.py"), "--render-only", "--out", str(out)], ROOT)
    assert out.read_bytes() == (RESULTS / "memory_budget.md").read_bytes()


def _measured_section(page: str) -> str:
    """The section "The default prune against SLEB: measured" of a scale page (up to the next one)."""
    return page.split("\n## The default prune against SLEB: measured\n", 1)[1].split("\n## ", 1)[0]


def test_scale_measured_section_rerenders_from_json(tmp_path):
    """scale.md's measured comparison of the default prune and SLEB, re-rendered from scale.json:
    right after the predicted section; each n's row holds the stored CPU seconds (scoring + the
    search to n, SLEB to n) and their ratio; a scale.json without the part gives the page less
    that section; one stopped after the search's budget 3 gives the row of n = 2 only and says
    which budgets are missing."""
    stored = json.loads((RESULTS / "scale.json").read_text(encoding="utf-8"))
    page = (RESULTS / "scale.md").read_text(encoding="utf-8")

    def render(data, name):
        (tmp_path / f"{name}.json").write_text(json.dumps(data), encoding="utf-8")
        _run([str(ROOT / "benchmarks" / "scale.py"), "--render-only", "--json", str(tmp_path / f"{name}.json"),
              "--out", str(tmp_path / f"{name}.md")], ROOT)
        return (tmp_path / f"{name}.md").read_text(encoding="utf-8")

    assert render(stored, "all") == page
    assert (page.index("## The default prune against SLEB: predicted compute")
            < page.index("## The default prune against SLEB: measured") < page.index("## Streaming offloaded blocks"))
    section = _measured_section(page)
    d = stored["measured"]["gemma3-270m"]
    scoring = d["scoring"]["cpu_seconds"]
    for n in (2, 4, 6):
        search, sleb = d["search"][str(n)]["cpu_seconds"], d["sleb"][str(n)]["cpu_seconds"]
        assert (f"| {n} | {scoring:.0f} + {search:.0f} = {scoring + search:.0f} | {sleb:.0f} | "
                f"{(scoring + search) / sleb:.2f}x |") in section
    assert "Stopped before its end" not in section and "Reading: the target" in section
    without = render({k: v for k, v in stored.items() if k != "measured"}, "without")
    assert without == page.replace("## The default prune against SLEB: measured\n" + section + "\n", "")
    stopped = json.loads(json.dumps(stored))
    stopped["measured"]["gemma3-270m"]["search"] = {k: v for k, v in d["search"].items() if int(k) <= 3}
    partial = _measured_section(render(stopped, "stopped"))
    assert [line.split(" |")[0] for line in partial.splitlines() if line.startswith("| ") and line[2].isdigit()] == ["| 2"]
    assert "n = 4, 6 not measured" in partial and "search to n = 3" in partial and "Reading: the target" not in partial
