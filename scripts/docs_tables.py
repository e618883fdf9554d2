"""Rewrite the generated options tables of docs/python.md from the registries, in place.

    python scripts/docs_tables.py            # rewrite the tables between the markers
    python scripts/docs_tables.py --check    # exit 1 (and say so) when the page is stale

The tables are :func:`hf_layerswap.utils.registry.options_tables` of every registry once
``hf_layerswap`` is imported (each registry package imports all of its modules): after
adding a strategy, a repair, a sparsity entry or a healing method, this one command brings
the page up to date. Only the text between :data:`START` and :data:`END` changes; the file
is replaced all or nothing (``write_text_atomic``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import hf_layerswap  # noqa: F401  (imports every registry, so every entry is in the tables)
from hf_layerswap.utils.jsonio import write_text_atomic
from hf_layerswap.utils.registry import options_tables

#: The page the tables live in, relative to the repository root.
PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"
#: The command that writes them, as the markers and the messages name it.
COMMAND = "python scripts/docs_tables.py"
START = f"<!-- options tables: generated from the registries by `{COMMAND}`; do not edit by hand -->\n"
END = "<!-- end of the options tables -->"


def split_page(text: str, where: str = "docs/python.md") -> tuple[str, str, str]:
    """``(before, generated, after)``: the page around the text between :data:`START` and
    :data:`END` (``before`` ends with ``START``, ``after`` starts with ``END``).

    Raises:
        ValueError: a marker is missing, given twice, or ``END`` comes before ``START``.
    """
    for marker in (START, END):
        if text.count(marker) != 1:
            raise ValueError(f"{where}: the marker {marker.strip()!r} appears {text.count(marker)} times; "
                             "it must appear exactly once")
    head, rest = text.split(START)
    if END not in rest:
        raise ValueError(f"{where}: {END!r} comes before {START.strip()!r}")
    generated, tail = rest.split(END)
    return head + START, generated, END + tail


def rewrite(text: str, tables: str, where: str = "docs/python.md") -> str:
    """``text`` with the generated part replaced by ``tables`` (see :func:`split_page`)."""
    head, _, tail = split_page(text, where)
    return head + tables + tail


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or, with ``--check``, compare) the page's tables; returns the exit status
    (0: up to date or rewritten, 1: ``--check`` found it stale)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("page", nargs="?", type=Path, default=PAGE, help="the page (default: docs/python.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new = rewrite(text, options_tables(), str(args.page))
    if new == text:
        print(f"{args.page}: the options tables are up to date")
        return 0
    if args.check:
        print(f"{args.page}: the options tables are stale; run `{COMMAND}`", file=sys.stderr)
        return 1
    write_text_atomic(new, args.page)
    print(f"{args.page}: the options tables rewritten from the registries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
