"""benchmarks/memory_budget.py: a run of the budget rows keeps the stored "auto" rows."""

from __future__ import annotations

import json
import subprocess

from conftest import benchmark_script


def test_a_budget_run_keeps_the_auto_rows_of_the_page(tmp_path, monkeypatch):
    """Re-measuring the budget rows replaced the whole JSON, dropping the "auto" section
    (``--headroom-mib``) measured before; now only the budget rows are replaced."""
    bench = benchmark_script("memory_budget")
    limit = {"model": "smollm2-135m", "dtype": "bfloat16", "num_prompts": 8, "seq_len": 128, "weights": 100 << 20,
             "headroom": 256 << 20, "arm": "auto", "budget": 64 << 20, "budget_source": "auto", "baseline_rss": 1 << 30,
             "peak_rss": (1 << 30) + (100 << 20), "above": 100 << 20, "removed": [1, 2], "threads": 1}
    old = {"command": "old", "machine": "old", "rows": [],
           "limit_command": "python benchmarks/memory_budget.py --headroom-mib 256", "limit_rows": [limit],
           "limit_machine": "x86_64, cpu"}
    page = tmp_path / "memory_budget.md"
    page.with_suffix(".json").write_text(json.dumps(old))
    row = {"model": "smollm2-135m", "dtype": "bfloat16", "num_prompts": 8, "seq_len": 128, "weights": 100 << 20,
           "share": 0.15, "budget": 15 << 20, "baseline_rss": 1 << 30, "load_peak": 1 << 30,
           "peak_rss": (1 << 30) + (40 << 20), "above": 40 << 20, "removed": [1, 2], "scoring_max_memory": None,
           "threads": 1}
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, json.dumps(row)))
    assert bench.main(["--threads", "1", "--out", str(page)]) == 0
    data = json.loads(page.with_suffix(".json").read_text())
    assert data["rows"] == [row] and data["limit_rows"] == [limit]
    assert data["limit_command"] == old["limit_command"] and data["command"] != "old"
    text = page.read_text()
    assert "| 15% | 15.0 |" in text and "## `auto` under a load's `max_memory`" in text
