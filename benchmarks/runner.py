"""One runner for the benchmarks: experiments as config files; run, resume, merge, render.

An *experiment* is a small TOML file in ``benchmarks/experiments/<name>.toml`` (read with
:func:`load_experiment`): its settings and its cells, listed by group as grids (every
list-valued field of a grid is an axis; the cells are the product of the axes in the order
the file lists them, see :func:`expand_grid`). A benchmark script keeps only what differs
between benchmarks: how to run one cell and how to render its page.

The runner owns the rest:

- **run** (:func:`run_cells`): cell by cell; each finished cell is stored at once in the
  results JSON (:class:`CellStore`, written all or nothing with
  :func:`hf_layerswap.utils.jsonio.write_json_atomic`), so a stopped run loses at most the cell in
  progress; a results file that is not one complete JSON object (cut short by another tool,
  edited by hand) is refused with its name (:func:`read_state`) and never written over;
- **resume**: a cell whose key is stored is not run again; with ``shared=True`` the store
  re-reads the file under a lock (``<json>.lock``) before each cell and merges each new cell
  into the file under that lock, so several processes can fill one results file at once;
- **merge** (:func:`merge_states`, :func:`merge_files`): results of runs made in separate
  processes or machines combine into one file; a cell (or any other stored value) present in
  two of them with different values is refused with :class:`MergeConflict`, never overwritten;
- **render** (``--render-only``, :func:`add_runner_arguments`): the page is rewritten from
  the JSON alone; no model is loaded.

Every benchmark with cells runs on the runner: ``heal.py`` (``experiments/heal.toml``),
``sparsity.py`` (``experiments/sparsity.toml``, a shared store), ``quality.py``
(``experiments/quality.toml``: a cell is a criterion at a budget, run by the library's
``compare_criteria`` into its own state, read back through a nested store, ``depth=2``),
``precision.py``, ``recovery.py``, ``streaming.py`` and ``speed.py`` (their ``.toml`` files):
these four keep their cells as lists of records (:class:`ListCellStore`), and ``speed.py``
stores a model's record batch by batch and merges with ``progress`` (the record further along
is kept). ``scale.py``, ``gpu.py``, ``peeling.py`` and ``train_tiny.py`` are single runs with
no cells.

Usage from a benchmark script::

    store = CellStore(path, fresh=new_state)
    run_cells(store, ((cell_key(c), c) for c in cells), run_one, tag="heal")
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from hf_layerswap.utils.jsonio import write_json_atomic

__all__ = [
    "EXPERIMENTS",
    "CellStore",
    "ListCellStore",
    "MergeConflict",
    "add_runner_arguments",
    "cell_node",
    "expand_grid",
    "experiment_cells",
    "load_experiment",
    "merge_files",
    "merge_keyed_lists",
    "merge_states",
    "merge_values",
    "read_state",
    "run_cells",
]

#: Folder of the experiment config files.
EXPERIMENTS = Path(__file__).resolve().parent / "experiments"


class MergeConflict(ValueError):
    """Two results files hold different values under one key (a cell run twice with
    different outcomes, or other settings): the merge is refused."""


def read_state(path: Path, what: str = "results file") -> dict:
    """The results state stored at ``path`` (a JSON object).

    Raises:
        FileNotFoundError: no such file (the message names ``what`` and the path).
        ValueError: a file that is not one complete JSON object (a copy or a write cut short,
            an edit by hand): the message names it, where it breaks and what to do; the file
            is left as it is (no store overwrites it, so no stored cell is lost).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path} is not complete JSON ({err.msg} at character {err.pos} of {len(text)}): "
                         "cut short or edited; restore it (e.g. from version control) or move it away to start "
                         "anew; it is left as it is") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what} {path} holds a JSON {type(state).__name__}, not a results state (an object); "
                         "restore it or move it away to start anew")
    return state


def load_experiment(name: str | Path) -> dict:
    """The experiment ``name`` (``benchmarks/experiments/<name>.toml``) or the TOML file at a path.

    Raises:
        FileNotFoundError: no such file; the message lists the experiments there are.
        ValueError: the file has no ``[groups]`` table.
    """
    path = Path(name) if str(name).endswith(".toml") else EXPERIMENTS / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in EXPERIMENTS.glob("*.toml"))
        raise FileNotFoundError(f"experiment {str(name)!r}: no file {path}; allowed: {known}")
    with path.open("rb") as handle:
        experiment = tomllib.load(handle)
    if not isinstance(experiment.get("groups"), dict):
        raise ValueError(f"experiment file {path} has no [groups] table: it lists its cells by group")
    return experiment


def expand_grid(grid: dict) -> list[dict]:
    """The cells of one grid: every list-valued field is an axis, in the grid's order (the first
    axis varies slowest); scalar fields are copied into every cell.

    ``{"model": ["a", "b"], "n": [2, 4], "tokens": 8}`` -> a/2, a/4, b/2, b/4, each with tokens 8.
    """
    axes = [(k, v) for k, v in grid.items() if isinstance(v, list)]
    cells = []
    for values in itertools.product(*(v for _, v in axes)):
        cell = dict(grid)  # the grid's field order
        cell.update(zip((k for k, _ in axes), values))
        cells.append(cell)
    return cells


def experiment_cells(experiment: dict) -> dict[str, list[dict]]:
    """``{group: [cell, ...]}`` in the file's order: each group is a list of grids (:func:`expand_grid`).

    Raises:
        ValueError: a group that is not a list of tables.
    """
    out = {}
    for group, grids in experiment["groups"].items():
        if not isinstance(grids, list) or not all(isinstance(g, dict) for g in grids):
            raise ValueError(f"group {group!r}: {grids!r} is not a list of grids ([[groups.{group}]] tables)")
        out[group] = [cell for grid in grids for cell in expand_grid(grid)]
    return out


def merge_values(a, b, where: str = "$", volatile: Iterable[str] = (),
                 keyed: dict[str, Callable[[dict], str]] | None = None,
                 progress: dict[str, Callable[[dict], int]] | None = None):
    """``a`` and ``b`` combined: mappings key by key (recursively), any other value only
    when both are equal. Under a key named in ``volatile`` (timings such as ``eval_s``, or a
    mapping of them: a second measurement of the same result) the first value is kept whole.
    Under a key named in ``keyed`` (at any depth) two lists of records are merged record by
    record, each named by the given key function (:func:`merge_keyed_lists`); ``progress``
    as for :func:`merge_keyed_lists`.

    Raises:
        MergeConflict: a key holds different values in ``a`` and ``b``; the message names
            the key path and both values.
    """
    volatile, keyed, progress = frozenset(volatile), dict(keyed or {}), dict(progress or {})
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            if key not in a:
                out[key] = value
            elif key in keyed and isinstance(a[key], list) and isinstance(value, list):
                out[key] = merge_keyed_lists(a[key], value, keyed[key], f"{where}.{key}", volatile, keyed,
                                             progress.get(key), progress)
            elif key not in volatile:
                out[key] = merge_values(a[key], value, f"{where}.{key}", volatile, keyed, progress)
        return out
    if a != b:
        raise MergeConflict(f"{where}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}; the results differ, "
                            "so they are not merged (rerun the cell in one place, or drop one of the files)")
    return a


def merge_keyed_lists(a: list, b: list, key: Callable[[dict], str], where: str = "$",
                      volatile: Iterable[str] = (), keyed: dict[str, Callable[[dict], str]] | None = None,
                      step: Callable[[dict], int] | None = None,
                      progress: dict[str, Callable[[dict], int]] | None = None) -> list:
    """Two lists of records (a store older than the mapping layout, see :class:`ListCellStore`)
    combined by ``key(record)``: ``a``'s order, then ``b``'s new records; records with one key
    are merged with :func:`merge_values`.

    ``step``: ``record -> int``, how far a cell stored part by part has got (e.g. its finished
    batches, see ``done`` of :class:`ListCellStore`). Of two records of one key at different
    steps the further one is kept whole (it holds the other's parts and more); records at the
    same step are merged as above. ``progress`` is passed on to nested merges.

    Raises:
        MergeConflict: a record with different values in ``a`` and ``b`` (at the same step).
    """
    out = {key(r): r for r in a}
    for record in b:
        k = key(record)
        if k not in out:
            out[k] = record
        elif step is not None and step(out[k]) != step(record):
            out[k] = max(out[k], record, key=step)
        else:
            out[k] = merge_values(out[k], record, f"{where}[{k}]", volatile, keyed, progress)
    return list(out.values())


def merge_states(states: Sequence[dict], *, union: Iterable[str] = ("commands",),
                 first: Iterable[str] = (), volatile: Iterable[str] = (),
                 keyed: dict[str, Callable[[dict], str]] | None = None,
                 progress: dict[str, Callable[[dict], int]] | None = None,
                 drop: Iterable[str] = ()) -> dict:
    """One results state from several (runs of disjoint cells in other processes or machines).

    Args:
        states: parsed results JSON, in order.
        union: top-level keys holding lists: their entries are concatenated, duplicates dropped.
        first: top-level keys whose first stored value is kept (e.g. the machine description).
        volatile: key names, at any depth, whose values may differ (timings); the first is kept.
        keyed: key names, at any depth, holding lists of records, each named by the given key
            function (``{"models": lambda m: m["model"]}``): merged record by record
            (:func:`merge_keyed_lists`).
        progress: for keys of ``keyed`` whose records are cells stored part by part, ``record ->
            int``, how far each has got: the further record of a key is kept (``step`` of
            :func:`merge_keyed_lists`).
        drop: top-level keys left out of the merged state: summaries of a whole run (its table,
            its command) that the run after the merge writes anew from the merged cells.

    Every other key is merged with :func:`merge_values`: cells present in two states must be
    equal (but for their ``volatile`` fields).

    Raises:
        ValueError: no states.
        MergeConflict: a cell or setting with different values in two states.
    """
    if not states:
        raise ValueError("merge_states: no states given; pass at least one results file")
    union, first, keyed, dropped = set(union), set(first), dict(keyed or {}), set(drop)
    merged: dict = {}
    for state in states:
        for key, value in state.items():
            if key in dropped:
                continue
            if key not in merged:
                merged[key] = list(value) if key in union else value
            elif key in union:
                merged[key] = list(dict.fromkeys([*merged[key], *value]))
            elif key not in first:
                merged = merge_values(merged, {key: value}, "$", volatile, keyed, progress)
    return merged


def merge_files(destination: Path, sources: Sequence[Path], **options) -> dict:
    """Merge ``destination`` (when it exists) and ``sources`` into ``destination``, written all
    or nothing; options as for :func:`merge_states`. Returns the merged state.

    Raises:
        FileNotFoundError: a source that does not exist.
        ValueError: a file that is not a complete results state (:func:`read_state`).
        MergeConflict: see :func:`merge_states` (``destination`` is then left as it was).
    """
    pieces = [read_state(s, "--merge-from results file") for s in sources]
    merged = merge_states(([read_state(destination)] if destination.is_file() else []) + pieces, **options)
    write_json_atomic(merged, destination)
    return merged


def cell_node(state: dict, path: str | tuple[str, ...], fresh: Callable[[], object] = dict):
    """The value at ``path`` (a key of ``state``, or a tuple of keys, nested) of a results state,
    created (``fresh()``, and empty mappings on the way) where missing."""
    path = (path,) if isinstance(path, str) else tuple(path)
    node = state
    for name in path[:-1]:
        node = node.setdefault(name, {})
    return node.setdefault(path[-1], fresh())


class CellStore:
    """A results JSON holding finished cells under ``state[cells]`` (a mapping key -> record).

    Args:
        path: the JSON file (read when it exists, else ``fresh()`` is the state).
        fresh: builds the state of a new file.
        cells: the key of the cell mapping in the state, or a tuple of keys (nested).
        shared: other processes may fill the same file at once: each :meth:`has` re-reads it,
            and :meth:`put` / :meth:`update` merge into the file under an exclusive lock
            (``<path>.lock``), so no process loses another's cells. Use it also when the cell's
            own code writes the file (a library function with its own resumable state): the
            store then writes over the latest file, never over what it read before.
        depth: the cell mapping is nested ``depth`` levels deep; a cell key names a record by
            its keys at each level joined with ``/`` (``depth=2``: ``"search/3"`` is
            ``state[cells]["search"]["3"]``, the layout of a table by criterion and budget).

    Raises:
        ValueError: ``depth`` below 1; a file that is not a complete results state
            (:func:`read_state`: refused, never overwritten); from :meth:`put` and
            :func:`run_cells` (before the cell runs), a key without ``depth`` parts.
    """

    def __init__(self, path: Path, fresh: Callable[[], dict], *, cells: str | tuple[str, ...] = "cells",
                 shared: bool = False, depth: int = 1):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: the cell mapping's nesting must be an int >= 1")
        self.path, self.fresh, self.cells_key, self.shared, self.depth = Path(path), fresh, cells, shared, depth
        self.state = self._read()

    def _read(self) -> dict:
        if self.path.is_file():
            return read_state(self.path)
        return self.fresh()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self.shared:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.state = self._read()
            yield

    def check_key(self, key: str) -> list[str]:
        """The keys of the cell ``key`` at each level.

        Raises:
            ValueError: a store of ``depth`` > 1 and a key that is not ``depth`` non-empty
                keys joined with ``/`` (a key holding ``/`` itself would land at another level).
        """
        parts = key.split("/") if self.depth > 1 else [key]
        if len(parts) != self.depth or not all(parts):
            raise ValueError(f"cell key {key!r}: a store of depth {self.depth} names a cell by {self.depth} "
                             "non-empty keys joined with '/' (none of them holding '/')")
        return parts

    @property
    def cells(self) -> dict:
        """The cell mapping (``depth`` 1), or ``{key: record}`` of every stored cell (a view)."""
        node = cell_node(self.state, self.cells_key)
        for _ in range(self.depth - 1):
            node = {f"{outer}/{inner}": record for outer, sub in node.items() for inner, record in sub.items()}
        return node

    def has(self, key: str) -> bool:
        """Whether the cell ``key`` is stored (in a shared store: by any process so far)."""
        if self.shared:
            self.state = self._read()
        return key in self.cells

    def update(self, change: Callable[[dict], None] | None = None) -> dict:
        """Apply ``change`` to the state (in a shared store: to the file's latest state, under
        the lock) and write it. Returns the state."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if change is not None:
                change(self.state)
            write_json_atomic(self.state, self.path)
        return self.state

    def save(self) -> None:
        """Write the state as it is (all or nothing)."""
        self.update()

    def put(self, key: str, record: dict) -> None:
        """Store the finished cell ``key`` and write the file."""
        *outer, last = self.check_key(key)
        self.update(lambda state: cell_node(state, (*self._path(), *outer)).__setitem__(last, record))

    def _path(self) -> tuple[str, ...]:
        return (self.cells_key,) if isinstance(self.cells_key, str) else tuple(self.cells_key)


class ListCellStore(CellStore):
    """A :class:`CellStore` over a results JSON that keeps its cells as a list of records (a
    layout older than the mapping), each record naming its own key: ``key(record)``.

    Args:
        path, fresh, shared: as for :class:`CellStore`.
        key: ``record -> str``, the cell key a record is stored under.
        cells: where the list is: a key of the state, or a tuple of keys (nested, e.g.
            ``("result", "evaluated")``).
        done: ``record -> bool``; a stored record counts as finished (:meth:`has`) only when
            true, so a cell can store partial records as it goes (default: every record).

    :meth:`put` replaces the stored record of its key in place, or appends. Merge such files
    with ``keyed={last key of cells: key}`` (:func:`merge_states`).

    Raises:
        ValueError (from :meth:`put`): a record whose ``key(record)`` is not the key it is put under.
    """

    def __init__(self, path: Path, fresh: Callable[[], dict], *, key: Callable[[dict], str],
                 cells: str | tuple[str, ...] = "cells", shared: bool = False,
                 done: Callable[[dict], bool] | None = None):
        self.key, self.done = key, done or (lambda record: True)
        super().__init__(path, fresh, cells=cells, shared=shared)

    def records(self, state: dict | None = None) -> list:
        """The stored list of records (created empty where missing)."""
        return cell_node(self.state if state is None else state, self.cells_key, list)

    @property
    def cells(self) -> dict:
        """``{key: record}`` of the stored list (a view: change records through :meth:`put`)."""
        return {self.key(r): r for r in self.records()}

    def has(self, key: str) -> bool:
        """Whether the cell ``key`` is stored and finished (``done``)."""
        if self.shared:
            self.state = self._read()
        record = self.cells.get(key)
        return record is not None and self.done(record)

    def get(self, key: str) -> dict | None:
        """The stored record of ``key`` (finished or not), or None."""
        return self.cells.get(key)

    def put(self, key: str, record: dict) -> None:
        """Store the record of the cell ``key`` (replacing its stored one) and write the file."""
        if self.key(record) != key:
            raise ValueError(f"record named {self.key(record)!r} put under the key {key!r}; they must match")

        def change(state: dict) -> None:
            records = self.records(state)
            keys = [self.key(r) for r in records]
            if key in keys:
                records[keys.index(key)] = record
            else:
                records.append(record)

        self.update(change)


def _log(tag: str, message: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_cells(store: CellStore, cells: Iterable[tuple[str, object]], run_one: Callable[[object], dict], *,
              tag: str, describe: Callable[[dict], str] | None = None) -> dict:
    """Run every cell not stored yet, in order, storing each as it finishes; returns the state.

    Args:
        store: the results file.
        cells: ``(key, cell)`` pairs; the key is what a rerun looks up.
        run_one: ``cell -> record`` (the JSON-able result stored under the key).
        tag: log prefix. describe: ``record -> str`` for the log line of a finished cell.

    Raises:
        ValueError: a key the store cannot hold (:meth:`CellStore.check_key`), before its cell runs.
    """
    for key, cell in cells:
        store.check_key(key)  # refused before the cell runs, not after
        if store.has(key):
            continue
        _log(tag, f"{key} ...")
        record = run_one(cell)
        store.put(key, record)
        _log(tag, f"{key}: {describe(record) if describe else 'done'}")
    return store.state


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options on a benchmark's parser: ``--render-only`` and ``--merge-from``."""
    parser.add_argument("--render-only", action="store_true",
                        help="only rewrite the page (and plot) from the stored JSON; no model is loaded")
    parser.add_argument("--merge-from", nargs="+", default=[], metavar="JSON", type=Path,
                        help="first merge these results files (runs of other cells in other processes or machines) "
                             "into this one; a cell stored with different values in two files is refused")
