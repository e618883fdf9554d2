"""The optional extras: the package imports, prunes, saves and writes its card with none of
them installed, and each path that needs one refuses by name with the extra to install.

Absence is simulated without uninstalling anything: a fresh interpreter sets
``sys.modules[name] = None`` for every optional package before it imports hf_layerswap
(``import name`` then raises ``ModuleNotFoundError`` and ``importlib.util.find_spec``
returns ``None``, as for a package that is not installed); in-process tests do the same
with ``monkeypatch.setitem``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_checkpoint, tiny_model

import hf_layerswap as hl
from hf_layerswap.cli import main
from hf_layerswap.config import HealConfig
from hf_layerswap.utils.extras import EXTRAS, MissingExtraError, install_hint, require
from hf_layerswap.models import check_gguf_file
from hf_layerswap.plots import PLOT_FILES
from hf_layerswap.evaluation.tasks import offline_documents

ROOT = Path(__file__).resolve().parents[1]

#: Every optional package, as the subprocess hides them (checked against EXTRAS below).
OPTIONAL = ("datasets", "evaluate", "gguf", "lm_eval", "llama_cpp", "matplotlib", "mergekit", "optimum", "peft")

BLOCK = "import sys\nfor _name in {names!r}:\n    sys.modules[_name] = None\n"


def _calibration(path: Path, n: int = 6) -> Path:
    path.write_text("\n\n".join(" ".join(f"w{(7 * p + 3 * k) % 120}" for k in range(30)) for p in range(n)) + "\n")
    return path


def _run(code: str, *, cwd: Path) -> subprocess.CompletedProcess:
    env_code = BLOCK.format(names=OPTIONAL) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", env_code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})


def test_the_hidden_packages_are_every_optional_one():
    assert sorted(OPTIONAL) == sorted(EXTRAS)


def test_import_prune_save_and_card_without_any_extra(tmp_path):
    """import hf_layerswap, a prune inside from_pretrained, save_for_hub (card and report
    written; the card says the plots were not drawn and how to draw them), and
    ``python -m hf_layerswap.cli prune``, with every optional package absent."""
    tiny_checkpoint(tmp_path / "base", tiny_model("qwen3"))
    calib = _calibration(tmp_path / "calib.txt")
    result = _run(f"""
        import json
        import hf_layerswap as hl
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = {str(tmp_path / "base")!r}
        cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration={str(calib)!r}, num_prompts=4,
                                 progress=False)
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg)
        written = hl.save_for_hub(model, {str(tmp_path / "saved")!r}, tokenizer=AutoTokenizer.from_pretrained(base),
                                  report=model.layerswap_report)
        leaked = sorted(name for name in {OPTIONAL!r} if sys.modules.get(name) is not None)
        print(json.dumps({{"removed": model.config.layerswap["removed_layers"], "leaked": leaked,
                          "written": sorted(p.name for p in written.iterdir())}}))
    """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["removed"]) == 1 and out["leaked"] == []
    assert {"README.md", "config.json", "layerswap_report.json"} <= set(out["written"])
    assert not set(PLOT_FILES.values()) & set(out["written"])
    card = (tmp_path / "saved" / "README.md").read_text()
    assert ("The plots (`layerswap_layer_scores.png`) were not drawn: matplotlib is "
            "not installed (`pip install 'hf-layerswap[plots]'` draws them).") in card
    assert "![" not in card  # no image the folder lacks
    assert hl.SwapReport.from_json(tmp_path / "saved" / "layerswap_report.json").num_blocks == 6

    cli = _run(f"""
        import runpy
        sys.argv = ["hf-layerswap", "prune", {str(tmp_path / "base")!r}, {str(tmp_path / "cli")!r},
                    "--num-to-remove", "1", "--strategy", "greedy", "--calibration", {str(calib)!r},
                    "--num-prompts", "4"]
        runpy.run_module("hf_layerswap.cli", run_name="__main__", alter_sys=True)
    """, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert len(json.loads((tmp_path / "cli" / "config.json").read_text())["layerswap"]["removed_layers"]) == 1
    assert "were not drawn: matplotlib is not installed" in (tmp_path / "cli" / "README.md").read_text()


def test_the_card_draws_its_plots_and_says_nothing_when_matplotlib_is_there(tmp_path):
    tiny_checkpoint(tmp_path / "base", tiny_model("qwen3"))
    cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=str(_calibration(tmp_path / "c.txt")),
                             num_prompts=4, progress=False)
    model = hl.load_model(tmp_path / "base")[0]
    hl.prune(model, cfg, tokenizer=hl.load_model(tmp_path / "base")[1])
    written = hl.save_for_hub(model, tmp_path / "saved", report=model.layerswap_report)
    assert PLOT_FILES["layer_scores"] in {p.name for p in written.iterdir()}
    assert "were not drawn" not in (tmp_path / "saved" / "README.md").read_text()


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingExtraError, match=r"^GGUF export needs gguf, which is not installed: "
                                                r"pip install 'hf-layerswap\[gguf\]'$"):
        require("gguf.scripts.gguf_new_metadata", "GGUF export")
    assert isinstance(MissingExtraError("x"), ImportError)
    assert install_hint("matplotlib.figure") == "pip install 'hf-layerswap[plots]'"
    with pytest.raises(ValueError, match=r"'torch' is not an optional dependency; the optional ones are \['datasets'"):
        require("torch", "x")


@pytest.mark.parametrize(("module", "extra", "call"), [
    ("gguf", "gguf", lambda tmp: hl.export_gguf(tmp / "base", tmp / "out.gguf")),
    ("gguf", "gguf", lambda tmp: check_gguf_file(_gguf_magic(tmp / "m.gguf"))),
    ("lm_eval", "lm-eval", lambda tmp: hl.evaluate_tasks(None, ["x"])),
    ("datasets", "lm-eval", lambda tmp: offline_documents().__enter__()),
    ("peft", "heal", lambda tmp: HealConfig(method="lora")),
])
def test_a_path_needing_an_absent_extra_refuses_naming_it(tmp_path, monkeypatch, module, extra, call):
    tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", num_blocks=2))
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtraError, match=rf"needs {module}, which is not installed: "
                                                rf"pip install 'hf-layerswap\[{extra}\]'"):
        call(tmp_path)
    assert not (tmp_path / "out.gguf").exists()


def _gguf_magic(path: Path) -> Path:
    path.write_bytes(b"GGUF" + bytes(20))
    return path


def test_healing_without_peft_takes_the_methods_that_need_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    assert HealConfig(method="adjacent").method == "adjacent"


def test_cli_refuses_a_missing_extra_with_an_error_line_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    tiny_checkpoint(tmp_path / "base", tiny_model("qwen3", num_blocks=2))
    calib = _calibration(tmp_path / "calib.txt")
    capsys.readouterr()
    rc = main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--num-to-remove", "1",
               "--calibration", str(calib), "--heal"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == ("error: healing with method='lora' needs peft, which is not installed: "
                           "pip install 'hf-layerswap[heal]'")
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "gguf", None)
    rc = main(["export-gguf", str(tmp_path / "base"), str(tmp_path / "out.gguf")])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        "error: export-gguf needs gguf, which is not installed: pip install 'hf-layerswap[gguf]'")
