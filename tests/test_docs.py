"""The documentation holds together: every relative link in README.md and docs/*.md points
to a file (and, for a ``#fragment`` into a Markdown page, to one of its headings), every
``hf_layerswap.…`` / ``hl.…`` name the pages show in code exists, the README's first
screen is the quickstart, the README shows the exact test command CI runs, and the
supported-architectures page shows the table the architecture tests generate."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Lines of the README that count as its first screen.
FIRST_SCREEN = 40

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Targets of the inline Markdown links and images in ``text``, in order."""
    return _LINK.findall(_prose(text))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (lowercase, punctuation
    dropped, spaces to hyphens; repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"`|\*|_(?=\W)|(?<=\W)_", "", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


_API_NAME = re.compile(r"\b(?:hf_layerswap|hl)(?:\.[A-Za-z_]\w*)+")


def api_names(text: str) -> list[str]:
    """Dotted ``hf_layerswap.…`` / ``hl.…`` names inside the code spans and blocks of
    ``text`` (a one-letter part such as ``hf_layerswap.x`` is a placeholder, not a name)."""
    code = [m.group(0) for m in _FENCE.finditer(text)] + [m.group(0) for m in _CODE_SPAN.finditer(_FENCE.sub("", text))]
    names = [n for chunk in code for n in _API_NAME.findall(chunk)]
    return [n for n in dict.fromkeys(names) if not any(len(part) == 1 for part in n.split(".")[1:])]


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module prefix, then attributes
    (``hl`` stands for ``hf_layerswap``). Raises ImportError / AttributeError."""
    parts = dotted.split(".")
    parts[0] = "hf_layerswap"
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for part in parts[k:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _relative(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def test_link_and_anchor_helpers():
    text = (
        "# How it works\n## Choosing the set: the paper's rule\n## Notes\n## Notes\n"
        "[a](docs/x.md) ![p](img.png) `[not](code.md)` [web](https://example.org) [frag](#notes)\n"
        "```\n[also not](fenced.md)\n```\n"
    )
    assert links(text) == ["docs/x.md", "img.png", "https://example.org", "#notes"]
    assert heading_anchors(text) == {"how-it-works", "choosing-the-set-the-papers-rule", "notes", "notes-1"}
    assert [t for t in links(text) if _relative(t)] == ["docs/x.md", "img.png", "#notes"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if not _relative(target):
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in heading_anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


def test_api_name_helpers():
    text = "Call `hl.select_layers(report)` or `hf_layerswap.x`.\n```python\nhl.models.bundled_checkpoint_dir('a')\n```\n"
    assert api_names(text) == ["hl.models.bundled_checkpoint_dir", "hl.select_layers"]
    assert resolve("hl.select_layers") is resolve("hf_layerswap.selection.select_layers")
    with pytest.raises(AttributeError):
        resolve("hl.no_such_function")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_api_exists(page):
    missing = []
    for name in api_names(page.read_text(encoding="utf-8")):
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            missing.append(f"{name} ({err})")
    assert missing == [], f"{page.relative_to(ROOT)} names what the package does not have: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    readme_links = {(ROOT / t.partition("#")[0]).resolve() for t in links((ROOT / "README.md").read_text()) if _relative(t)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in readme_links]
    assert unlinked == []


def test_readme_first_screen_is_the_quickstart():
    first = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])
    for needle in ("LayerSwapConfig(", "from_pretrained", "save_pretrained", "bash scripts/install.sh", "hf-layerswap prune"):
        assert needle in first, needle


def test_readme_shows_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = [line for line in ci if "pytest" in line]
    assert command == ["bash scripts/install.sh --test && HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -n 2"]
    readme = [line.strip() for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()]
    assert command[0] in readme
    tomllib = pytest.importorskip("tomllib")  # `-n 2` is pytest-xdist's option: the test extra installs it
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]["test"]
    assert any(requirement.startswith("pytest-xdist") for requirement in extra)


def test_ci_lints_and_type_checks_with_the_tools_the_test_extra_installs():
    tomllib = pytest.importorskip("tomllib")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert ".venv/bin/ruff check hf_layerswap tests benchmarks optimum scripts" in ci
    assert ".venv/bin/python -m mypy hf_layerswap" in ci
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extra = " ".join(project["project"]["optional-dependencies"]["test"])
    assert "ruff" in extra and "mypy==" in extra
    mypy = project["tool"]["mypy"]  # the strictness docs/architecture.md states
    assert (mypy["check_untyped_defs"], mypy["strict_optional"], mypy["ignore_missing_imports"]) == (False, False, True)
    assert "`check_untyped_defs = false`" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def test_architectures_page_shows_the_generated_support_table():
    from arch_matrix import support_table

    assert support_table() in (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")


def _docs_tables():
    """scripts/docs_tables.py, the writer of the page's generated options tables."""
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_page_shows_the_options_tables_generated_from_the_registries():
    from hf_layerswap.utils.registry import options_tables

    writer = _docs_tables()
    _, generated, _ = writer.split_page((ROOT / "docs" / "python.md").read_text(encoding="utf-8"))
    assert generated == options_tables(), f"docs/python.md's options tables are stale: run `{writer.COMMAND}`"


def test_the_docs_tables_writer_rewrites_only_the_generated_part(tmp_path, capsys):
    from hf_layerswap.utils.registry import options_tables

    writer = _docs_tables()
    assert writer.COMMAND == "python scripts/docs_tables.py" and writer.COMMAND in writer.START
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nprose kept\n{writer.START}| stale | table |\n{writer.END}\n\nafter, kept\n")
    assert writer.main([str(page), "--check"]) == 1
    assert capsys.readouterr().err == f"{page}: the options tables are stale; run `python scripts/docs_tables.py`\n"
    assert "| stale | table |" in page.read_text()  # --check writes nothing
    assert writer.main([str(page)]) == 0
    assert page.read_text() == f"# Title\n\nprose kept\n{writer.START}{options_tables()}{writer.END}\n\nafter, kept\n"
    assert writer.main([str(page), "--check"]) == 0  # written once, up to date
    for broken in (f"{writer.END}\n{writer.START}", f"{writer.START}{writer.START}{writer.END}", "no markers"):
        page.write_text(broken)
        with pytest.raises(ValueError, match=r"page\.md: "):
            writer.main([str(page)])
        assert page.read_text() == broken


# ----------------------------------------------------------------------------- extending, executed
def _extension_examples() -> list[tuple[str, str]]:
    """(file, test) code pairs of docs/architecture.md's "Extending" section: the strategy,
    the protocol and the recovery method, each one file and its test."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Extending: one module, one decorator", 1)[1].split("**Sparsity.**", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return list(zip(blocks[::2], blocks[1::2]))


def _unregister(names: set[str]) -> None:
    from hf_layerswap.scoring.protocols import SWAP_PROTOCOLS, unregister_protocol
    from hf_layerswap.recovery import RECOVERY_METHODS
    from hf_layerswap.selection.registry import MODEL_STRATEGIES, STRATEGIES, STRATEGY_ENTRIES, STRATEGY_OPTIONS

    for name in names:
        for table in (STRATEGIES, STRATEGY_ENTRIES, STRATEGY_OPTIONS, RECOVERY_METHODS):
            table.pop(name, None)
        MODEL_STRATEGIES.discard(name)
        if name in SWAP_PROTOCOLS:
            unregister_protocol(name)


def test_the_extension_examples_run_as_shown(tmp_path):
    from hf_layerswap.scoring.protocols import SWAP_PROTOCOLS
    from hf_layerswap.recovery import RECOVERY_METHODS
    from hf_layerswap.selection import STRATEGIES

    def registered():
        return set(STRATEGIES) | set(SWAP_PROTOCOLS) | set(RECOVERY_METHODS)

    examples = _extension_examples()
    assert len(examples) == 3
    before = registered()
    try:
        for k, (module, test) in enumerate(examples):
            exec(compile(module, f"architecture.md example {k}", "exec"), {"__name__": f"docs_example_{k}"})
            namespace: dict = {"__name__": f"docs_example_test_{k}"}
            exec(compile(test, f"architecture.md example {k} test", "exec"), namespace)
            tests = [fn for name, fn in namespace.items() if name.startswith("test_")]
            assert len(tests) == 1
            (tmp_path / str(k)).mkdir()
            tests[0](tmp_path / str(k))
        assert registered() - before == {"lowest_interchange", "skip_pair", "measured_only"}
    finally:
        _unregister(registered() - before)
    assert registered() == before


# ----------------------------------------------------------------------------- test files named
#: Where the project names its own test files: the pages, the benchmark pages and scripts
#: that cite a test as evidence, and the scripts that run tests by path.
_NAMING_TESTS = [*PAGES, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks").glob("*.py")),
                 *sorted((ROOT / "benchmarks" / "results").glob("*.md")), *sorted((ROOT / "scripts").iterdir())]
_TEST_FILE = re.compile(r"\btests/[\w/]*test_\w+\.py\b")
#: The header line of an example test file a page shows for the reader to create.
_EXAMPLE_FILE = re.compile(r"^# (tests/[\w/]*test_\w+\.py)$", re.M)


def test_every_test_file_the_docs_and_scripts_name_exists():
    """A test cited as evidence, or run by path (scripts/check_lowest.sh), is a file of
    tests/: after test_devices.py and test_extras.py became test_utils_devices.py and
    test_utils_extras.py, three pages still cited the old names and check_lowest.sh ran
    pytest on two files that no longer existed. The extension examples' files
    (docs/architecture.md: "# tests/test_skip_pair.py") are for the reader to create."""
    assert _TEST_FILE.findall("see tests/test_utils_devices.py and `tests/test_docs.py`.") == [
        "tests/test_utils_devices.py", "tests/test_docs.py"]
    missing = []
    for path in _NAMING_TESTS:
        if not path.is_file() or path.suffix not in {".md", ".py", ".sh"}:
            continue
        text = path.read_text(encoding="utf-8")
        examples = set(_EXAMPLE_FILE.findall(text))
        missing += [f"{path.relative_to(ROOT)}: {name}" for name in dict.fromkeys(_TEST_FILE.findall(text))
                    if name not in examples and not (ROOT / name).is_file()]
    assert missing == []
