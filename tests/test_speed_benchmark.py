"""benchmarks/speed.py on the runner: a smoke run on a tiny random model stores each model's
record batch by batch, an interrupted comparison continues from its stored batches and ends with
the values and counts of an uninterrupted run, a run of another process merges in (the record
further along is kept, one measured with other settings is refused), and the experiment's
cost-growth rows are the committed page's, none measured again once stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, benchmark_script

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from runner import ListCellStore, MergeConflict, merge_states  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def _speed(tmp_path, *extra):
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "speed.py"), "--smoke", "--num-prompts", "8",
           "--seq-len", "16", "--batch-size", "2", "--no-growth", *extra]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_speed_benchmark_resumes_batch_by_batch(tmp_path):
    """An interrupted comparison (2 of 4 batches) continues from its stored batches and
    ends with the KL values and counts of an uninterrupted run; a smoke run must not
    write over the measured results page."""
    refused = _speed(tmp_path)
    assert refused.returncode == 2 and "--smoke needs --out" in refused.stderr
    first = _speed(tmp_path, "--batches", "2", "--out", str(tmp_path / "a.md"))
    assert first.returncode == 0, first.stderr
    stored = json.loads((tmp_path / "a.json").read_text())["models"][0]
    assert stored["batches_done"] == 2
    # ours' peak memory measured alone in a child process, once; the memory target is judged on it
    assert stored["fresh_peak"]["ours"] >= stored["fresh_peak"]["rss_before"] > 0
    assert first.stderr.count("peak RSS of ours alone in a fresh process") == 1
    resumed = _speed(tmp_path, "--out", str(tmp_path / "a.md"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming tiny-gemma3 after 2 batches" in resumed.stderr
    assert "peak RSS of ours alone" not in resumed.stderr
    page = (tmp_path / "a.md").read_text()
    gib = f"{stored['fresh_peak']['ours'] / 2**30:.2f} GiB"
    assert f"| **peak RSS, ours alone in a fresh process, first batch** (target: under model + 1.5 GiB) | **{gib}**" in page
    whole = _speed(tmp_path, "--out", str(tmp_path / "b.md"))
    assert whole.returncode == 0, whole.stderr
    a = json.loads((tmp_path / "a.json").read_text())["models"][0]
    b = json.loads((tmp_path / "b.json").read_text())["models"][0]
    assert a["batches_done"] == b["batches_done"] == 4
    assert a["values"] == b["values"] and len(a["values"]["ours"]) == 4
    for part in ("naive", "ours"):
        for count in ("model_calls", "block_evaluations", "head_positions"):
            assert a[part][count] == b[part][count], (part, count)
    # the naive scheme rounds its log-softmax in fp32, the engine sums in float64 (one KL arithmetic):
    # they differ by the naive scheme's rounding, and a resumed run by nothing
    assert a["max_rel_diff_prompt"] == b["max_rel_diff_prompt"] < 1e-4
    assert "4 of 4 batches of 2" in (tmp_path / "a.md").read_text()
    # a run in another process merges in: nothing is measured again, the recorded command omits the piece
    merged = _speed(tmp_path, "--out", str(tmp_path / "c.md"), "--merge-from", str(tmp_path / "a.json"))
    assert merged.returncode == 0, merged.stderr
    assert "batch" not in merged.stderr.replace("batches", "")
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["merged_runs"] == 2 and c["models"][0]["values"] == a["values"]
    assert "--merge-from" not in c["command"] and "Measured in 1 separate run(s)" in (tmp_path / "c.md").read_text()
    missing = _speed(tmp_path, "--out", str(tmp_path / "d.md"), "--merge-from", str(tmp_path / "none.json"))
    assert missing.returncode == 1 and "none.json: no such file" in missing.stderr
    (tmp_path / "e.json").write_text(json.dumps({**json.loads((tmp_path / "a.json").read_text()), "batch_size": 4}))
    other = _speed(tmp_path, "--out", str(tmp_path / "d.md"), "--merge-from", str(tmp_path / "e.json"))
    assert other.returncode == 1 and "e.json: measured with {'threads': 1, 'batch_size': 4" in other.stderr


def test_growth_rows_are_the_committed_ones_and_stored_rows_are_not_measured_again(tmp_path):
    speed = benchmark_script("speed")
    stored = json.loads((RESULTS / "speed.json").read_text())
    settings = speed.EXPERIMENT["settings"]
    cells = speed.growth_cells(None, settings["batch_size"], settings["seq_len"])
    assert [label for label, _ in cells] == [row["label"] for row in stored["growth"]]
    assert {k: stored[k] for k in ("num_prompts", "seq_len", "batch_size", "threads")} == settings
    assert stored["requested"] == [c["model"] for c in speed.experiment_cells(speed.EXPERIMENT)["models"]]
    path = tmp_path / "speed.json"
    path.write_text(json.dumps({"growth": stored["growth"]}))

    def load():
        raise AssertionError("the growth model was loaded although every row is stored")

    rows = speed.run_growth(ListCellStore(path, fresh=dict, key=speed.growth_key, cells="growth", shared=True), load,
                            settings["batch_size"], settings["seq_len"])
    assert rows == stored["growth"]


def test_merge_keeps_the_record_further_along_and_refuses_two_measurements():
    speed = benchmark_script("speed")
    two = {"model": "m", "batches_done": 2, "values": [1, 2], "seconds": 3.0}
    four = {"model": "m", "batches_done": 4, "values": [1, 2, 3, 4], "seconds": 7.0}
    options = {"union": (), "keyed": {"models": speed.model_key}, "progress": {"models": speed.batches_done}}
    assert merge_states([{"models": [two]}, {"models": [four]}], **options) == {"models": [four]}
    assert merge_states([{"models": [four]}, {"models": [two]}], **options) == {"models": [four]}
    with pytest.raises(MergeConflict, match=r"\$\.models\[m\]\.seconds: 7\.0 != 8\.0"):
        merge_states([{"models": [four]}, {"models": [{**four, "seconds": 8.0}]}], **options)


def test_growth_rows_on_a_tiny_model_are_stored_one_by_one(tmp_path):
    """Every row of the cost-growth table measured on a tiny 12-block Llama (batches of 2 prompts
    x 16 tokens): the rows carry their settings, and a rerun finds them all stored."""
    from arch_matrix import tiny_tokenizer
    from conftest import tiny_model

    speed = benchmark_script("speed")
    model = tiny_model("llama", 12, max_position_embeddings=256)
    path = tmp_path / "speed.json"

    def store():
        return ListCellStore(path, fresh=dict, key=speed.growth_key, cells="growth", shared=True)

    with pytest.warns(UserWarning, match="calibration set smaller than requested"):  # the random-token rows
        rows = speed.run_growth(store(), lambda: (model, tiny_tokenizer()), 2, 16)
    assert [(r["label"], r["num_blocks"], r["num_prompts"], r["seq_len"], r["vocab"], r["probes"]) for r in rows] == [
        ("L = 10 (first 10 blocks)", 10, 2, 16, 128, 27), ("prompts = 2 (6 probes)", 12, 2, 16, 128, 6),
        ("prompts = 8 (6 probes)", 12, 8, 16, 128, 6), ("prompts = 16 (6 probes)", 12, 16, 16, 128, 6),
        ("T = 4", 12, 2, 4, 128, 33), ("V = 8192 (random weights, L = 8)", 8, 2, 16, 8192, 21),
        ("V = 65536 (random weights, L = 8)", 8, 2, 16, 65536, 21)]
    assert json.loads(path.read_text())["growth"] == rows
    assert [("naive_seconds" in r) for r in rows] == [True, False, False, False, True, True, True]

    def load():
        raise AssertionError("loaded although every row is stored")

    assert speed.run_growth(store(), load, 2, 16) == rows
