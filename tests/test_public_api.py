"""The top-level namespace is the user API: ``from hf_layerswap import *`` gives exactly
``__all__``, every name in it is its owning module's object, the internals it used to
export still resolve with one DeprecationWarning naming their new import path, nothing of
the project's own (package, benchmarks, model cards, scripts, tests, docs) uses those old
paths, and ``import hf_layerswap`` registers the quantizer plugin with transformers."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_docs import PAGES, api_names

import hf_layerswap as hl

ROOT = Path(__file__).resolve().parents[1]

#: The user API (what README.md and docs/*.md show) -> the module that owns each name.
PUBLIC = {
    "__version__": "hf_layerswap.provenance",
    "LayerSwapConfig": "hf_layerswap.config",
    "RecoveryConfig": "hf_layerswap.config",
    "SparsityConfig": "hf_layerswap.config",
    "prune": "hf_layerswap.pipeline",
    "PruneResult": "hf_layerswap.pipeline",
    "prune_loaded_model": "hf_layerswap.integration",
    "load_model": "hf_layerswap.models",
    "build_calibration": "hf_layerswap.calibration",
    "CalibrationSet": "hf_layerswap.calibration",
    "CalibrationShortfallWarning": "hf_layerswap.calibration",
    "score_layers": "hf_layerswap.scoring",
    "SwapReport": "hf_layerswap.report",
    "select_layers": "hf_layerswap.selection",
    "search_select": "hf_layerswap.selection",
    "STRATEGIES": "hf_layerswap.selection",
    "NonFiniteScoresError": "hf_layerswap.selection",
    "NonFiniteScoresWarning": "hf_layerswap.selection",
    "remove_layers": "hf_layerswap.surgery",
    "recover": "hf_layerswap.recovery",
    "RecoveryReport": "hf_layerswap.recovery",
    "sparsify": "hf_layerswap.sparsity",
    "SparsityReport": "hf_layerswap.sparsity",
    "evaluate_perplexity": "hf_layerswap.evaluation",
    "PerplexityResult": "hf_layerswap.evaluation",
    "delta_ppl_percent": "hf_layerswap.evaluation",
    "generation_check": "hf_layerswap.evaluation",
    "evaluate_tasks": "hf_layerswap.tasks",
    "TaskResults": "hf_layerswap.tasks",
    "compare_criteria": "hf_layerswap.baselines",
    "save_for_hub": "hf_layerswap.hub",
    "push_to_hub": "hf_layerswap.hub",
    "PushRefusedError": "hf_layerswap.hub",
    "HubPushError": "hf_layerswap.hub",
    "save_gguf": "hf_layerswap.gguf_export",
    "export_gguf": "hf_layerswap.gguf_export",
    "GGUFLayoutError": "hf_layerswap.gguf_export",
}

#: Internals the namespace used to export -> where they are imported from now.
MOVED = {
    "LayerSwapQuantizer": "hf_layerswap.integration",
    "PairResult": "hf_layerswap.report",
    "apply_plan": "hf_layerswap.plan",
    "capture_residual_stream": "hf_layerswap.plan",
    "check_surgery_invariants": "hf_layerswap.surgery",
    "decoder_blocks": "hf_layerswap.plan",
    "embedded_text": "hf_layerswap.calibration",
    "masked_kl": "hf_layerswap.scoring",
    "model_fingerprint": "hf_layerswap.plan",
    "num_blocks": "hf_layerswap.plan",
    "removal_kl": "hf_layerswap.scoring",
    "render_card": "hf_layerswap.card",
    "write_card_files": "hf_layerswap.card",
}


def _moved_in_package() -> dict[str, str]:
    """The package's own table of moved names (``_MOVED`` of ``hf_layerswap/__init__.py``,
    read statically: name -> owning module)."""
    init = ROOT / "hf_layerswap" / "__init__.py"
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "_MOVED" for t in targets) and isinstance(node.value, ast.Dict):
            return {ast.literal_eval(k): f"hf_layerswap.{v.id}" for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError(f"no _MOVED table in {init}")


#: What the old-path finder looks for: the package's table, so a newly moved name is sought at once.
PACKAGE_MOVED = _moved_in_package()


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


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_warns_once_with_its_new_path_and_is_the_same_object(name):
    owner = importlib.import_module(MOVED[name])
    assert name not in hl.__all__ and name not in vars(hl) and name not in dir(hl)
    expected = f"use {MOVED[name]}.{name} (from {MOVED[name]} import {name})"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        obj = getattr(hl, name)
    [warning] = _deprecations(record)
    assert obj is getattr(owner, name)
    assert str(warning.message).startswith(f"hf_layerswap.{name} is deprecated") and expected in str(warning.message)
    assert warning.filename == __file__  # points at the caller
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exec(f"from hf_layerswap import {name}", namespace)
    [warning] = _deprecations(record)  # once, although the import system looks the name up twice
    assert namespace[name] is getattr(owner, name) and expected in str(warning.message)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'hf_layerswap' has no attribute 'no_such_name'"):
        hl.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from hf_layerswap import no_such_name", {})
    assert not hasattr(hl, "no_such_name")


def _old_paths(code: str, label: str, package_depth: int | None = None) -> list[str]:
    """Uses of a moved name through the package's top level in Python source: ``from
    hf_layerswap import name``, ``hl.name`` for ``import hf_layerswap as hl`` and, inside
    the package (``package_depth``: folders below ``hf_layerswap/``), ``from .. import name``."""
    tree = ast.parse(code)
    aliases, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name == "hf_layerswap")
        elif isinstance(node, ast.ImportFrom):
            top = (node.module == "hf_layerswap" and not node.level) or (
                package_depth is not None and node.module is None and node.level == package_depth + 1
            )
            out += [f"{label}:{node.lineno} imports {a.name}" for a in node.names if top and a.name in PACKAGE_MOVED]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr in PACKAGE_MOVED:
                out.append(f"{label}:{node.lineno} {node.value.id}.{node.attr}")
    return sorted(out)


def test_the_old_path_finder_sees_every_form():
    code = "from hf_layerswap import masked_kl, prune\nimport hf_layerswap as hl\nhl.num_blocks; hl.prune; hl.plan.num_blocks\n"
    assert _old_paths(code, "a.py") == ["a.py:1 imports masked_kl", "a.py:3 hl.num_blocks"]
    relative = "from .. import apply_plan, prune\nfrom . import apply_plan\nfrom ..plan import apply_plan\n"
    assert _old_paths(relative, "sub/b.py", package_depth=1) == ["sub/b.py:1 imports apply_plan"]
    assert _old_paths(relative, "b.py", package_depth=0) == ["b.py:2 imports apply_plan"]
    assert _old_paths(relative, "b.py") == []  # outside the package only absolute imports count


def test_the_project_uses_the_owning_modules():
    """Tests included: the ones that check the deprecation itself (above) reach the old paths
    through ``getattr(hl, name)`` and ``exec`` of a string, which the finder does not read."""
    assert PACKAGE_MOVED == MOVED  # the finder seeks every name the package moved; each is checked above
    files = [p for folder in ("hf_layerswap", "benchmarks", "model_cards", "optimum", "scripts", "tests")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    bad = []
    for path in files:
        rel = path.relative_to(ROOT)
        depth = len(rel.parts) - 2 if rel.parts[0] == "hf_layerswap" else None
        bad += _old_paths(path.read_text(encoding="utf-8"), str(rel), depth)
    docs = [page for page in PAGES + [ROOT / "benchmarks" / "README.md"] if page.exists()]
    bad += [f"{page.relative_to(ROOT)}: {n}" for page in docs for n in api_names(page.read_text(encoding="utf-8"))
            if n.split(".")[0] in ("hl", "hf_layerswap") and n.split(".")[1] in PACKAGE_MOVED]
    assert bad == [], "old top-level paths (import from the owning module):\n" + "\n".join(bad)


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
