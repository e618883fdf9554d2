"""The top-level namespace is the user API: ``from hf_layerswap import *`` gives exactly
``__all__``, every name in it is its owning module's object, the internals it exported
before 0.1.0 are gone (no shim, no module-level ``__getattr__``: they import from their
owners only), and ``import hf_layerswap`` registers the quantizer plugin with
transformers."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_layerswap as hl

ROOT = Path(__file__).resolve().parents[1]

#: The user API (what README.md and docs/*.md show) -> the module that owns each name.
PUBLIC = {
    "__version__": "hf_layerswap.utils.provenance",
    "LayerSwapConfig": "hf_layerswap.config",
    "RecoveryConfig": "hf_layerswap.config",
    "SparsityConfig": "hf_layerswap.config",
    "HealConfig": "hf_layerswap.config",
    "prune": "hf_layerswap.pipeline",
    "PruneResult": "hf_layerswap.pipeline",
    "prune_loaded_model": "hf_layerswap.integration",
    "load_model": "hf_layerswap.models",
    "estimate_cost": "hf_layerswap.cost",
    "CostEstimate": "hf_layerswap.cost",
    "build_calibration": "hf_layerswap.calibration",
    "CalibrationSet": "hf_layerswap.calibration",
    "CalibrationShortfallWarning": "hf_layerswap.calibration",
    "score_layers": "hf_layerswap.scoring",
    "SwapReport": "hf_layerswap.scoring.report",
    "select_layers": "hf_layerswap.selection",
    "search_select": "hf_layerswap.selection",
    "STRATEGIES": "hf_layerswap.selection",
    "NonFiniteScoresError": "hf_layerswap.scoring.rule",
    "NonFiniteScoresWarning": "hf_layerswap.scoring.rule",
    "remove_layers": "hf_layerswap.surgery",
    "recover": "hf_layerswap.recovery",
    "RecoveryReport": "hf_layerswap.recovery",
    "heal": "hf_layerswap.healing",
    "HealReport": "hf_layerswap.healing",
    "sparsify": "hf_layerswap.sparsity",
    "SparsityReport": "hf_layerswap.sparsity",
    "evaluate_perplexity": "hf_layerswap.evaluation",
    "PerplexityResult": "hf_layerswap.evaluation",
    "delta_ppl_percent": "hf_layerswap.evaluation",
    "generation_check": "hf_layerswap.evaluation",
    "evaluate_tasks": "hf_layerswap.evaluation.tasks",
    "TaskResults": "hf_layerswap.evaluation.tasks",
    "compare_criteria": "hf_layerswap.comparison",
    "save_for_hub": "hf_layerswap.hub",
    "push_to_hub": "hf_layerswap.hub",
    "PushRefusedError": "hf_layerswap.hub",
    "HubPushError": "hf_layerswap.hub",
    "save_gguf": "hf_layerswap.gguf_export",
    "export_gguf": "hf_layerswap.gguf_export",
    "GGUFLayoutError": "hf_layerswap.gguf_export",
}

#: Internals the namespace exported before 0.1.0 -> the module that owns each (the only path).
FORMER = {
    "LayerSwapQuantizer": "hf_layerswap.integration",
    "PairResult": "hf_layerswap.scoring.report",
    "apply_plan": "hf_layerswap.layerplan",
    "capture_residual_stream": "hf_layerswap.layerplan",
    "check_surgery_invariants": "hf_layerswap.surgery",
    "decoder_blocks": "hf_layerswap.layerplan",
    "embedded_text": "hf_layerswap.calibration",
    "masked_kl": "hf_layerswap.scoring",
    "model_fingerprint": "hf_layerswap.layerplan",
    "num_blocks": "hf_layerswap.layerplan",
    "removal_kl": "hf_layerswap.scoring",
    "render_card": "hf_layerswap.card",
    "write_card_files": "hf_layerswap.card",
}


def _deprecations(record) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, DeprecationWarning) and "hf_layerswap" in str(w.message)]


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from hf_layerswap import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(hl.__all__)
    assert len(hl.__all__) == len(set(hl.__all__))


def test_all_is_the_user_api_and_each_name_is_its_owners_object():
    assert sorted(hl.__all__) == sorted(PUBLIC)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for name, owner in PUBLIC.items():
            assert getattr(hl, name) is getattr(importlib.import_module(owner), name), name
    assert _deprecations(record) == []


@pytest.mark.parametrize("name", sorted(FORMER))
def test_a_former_top_level_internal_imports_from_its_owner_only(name):
    assert name not in hl.__all__ and name not in dir(hl) and not hasattr(hl, name)
    with pytest.raises(ImportError, match=name):
        exec(f"from hf_layerswap import {name}", {})
    assert getattr(importlib.import_module(FORMER[name]), name) is not None


def test_no_module_level_getattr_and_no_shim_module():
    """No module of the package serves old names on demand (PEP 562), and the shims of
    unreleased code are gone (tests/test_structure.py checks every module statically)."""
    for module in [m for m in list(sys.modules) if m == "hf_layerswap" or m.startswith("hf_layerswap.")]:
        assert "__getattr__" not in vars(sys.modules[module]), module
    for gone in ("moved", "cli_eval", "cli_peel", "search", "rolling"):
        with pytest.raises(ModuleNotFoundError, match=f"hf_layerswap.{gone}"):
            importlib.import_module(f"hf_layerswap.{gone}")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'hf_layerswap' has no attribute 'no_such_name'"):
        hl.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from hf_layerswap import no_such_name", {})
    assert not hasattr(hl, "no_such_name")


def test_import_registers_the_quantizer_plugin_and_warns_nothing_of_its_own():
    code = (
        "import warnings\n"
        "warnings.filterwarnings('error', message='hf_layerswap', category=DeprecationWarning)\n"
        "import hf_layerswap, hf_layerswap.integration as integration\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING\n"
        "assert AUTO_QUANTIZER_MAPPING['layerswap'] is integration.LayerSwapQuantizer\n"
        "assert AUTO_QUANTIZATION_CONFIG_MAPPING['layerswap'] is hf_layerswap.LayerSwapConfig\n"
        "print('registered')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "registered"
