"""One kind of registry entry, with typed options: :class:`RegistryEntry`, :class:`Registry`,
:class:`Options` and :func:`option`.

Every registry of the package (swap protocols, selection strategies, set objectives, repairs,
healing methods, sparsity allocators and pruners) is a :class:`Registry`: a name -> entry
dict that refuses a name registered twice, looks a name up with an error naming the closest
registered one, and gives a live view of its names. Every entry is a :class:`RegistryEntry`:
its behaviour (the registry's own hooks), ``help`` (one line, for the command line and the
docs), ``option_class`` (the :class:`Options` dataclass of its typed options; a field made
with :func:`option` carries its help and bounds) and ``estimate`` (the hook
:func:`~hf_layerswap.cost.estimate_cost` plans it with; ``None``: it cannot be priced).

Options given as a dict keep working: :meth:`Options.from_mapping` converts them, refusing
an unknown key (naming the allowed ones and the closest) and a value of the wrong type or
outside a field's bounds (naming the field, the value and what is allowed)::

    @dataclass(frozen=True)
    class LastKOptions(Options):
        k: int = option(3, help="kept blocks trained, counted from the last", ge=1)

    LastKOptions.from_mapping({"k": 0}, owner="method='last_k'")
    # ValueError: k=0: must be an int >= 1

A package of entries (``selection/``, ``recovery/``, ``sparsity/``, ``healing/``) ends its
``__init__`` with :func:`import_package_modules`, so a module dropped into the package is
imported with it and its decorators register its entries: a new strategy is one module with
one ``@register_strategy``, no import to add.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import pkgutil
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from .registry_names import RegistryNames

__all__ = ["NoOptions", "Options", "Registry", "RegistryEntry", "import_package_modules", "option", "option_rows",
           "options_subset", "options_table", "options_tables", "untyped_options"]

E = TypeVar("E")
OptionsT = TypeVar("OptionsT", bound="Options")


def option(default: Any = MISSING, *, help: str, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, choices: Iterable[Any] | None = None,
           what: str | None = None) -> Any:
    """A field of an :class:`Options` dataclass with its help and bounds in its metadata.

    Args:
        default: the value when the option is not given (required: every option has one).
        help: what the option does, in one line (the command line's and the docs' text).
        ge, gt, le, lt: the bounds a number must meet (``>=``, ``>``, ``<=``, ``<``); ``None``: none.
        choices: the values allowed (a string option).
        what: a short noun phrase the error message ends with, e.g. ``"the LoRA rank"``.
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt,
            "choices": None if choices is None else tuple(choices), "what": what}
    return field(default=default, metadata=meta)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kinds(hint) -> tuple[tuple[type, ...], bool]:
    """The plain types a field's annotation allows, and whether ``None`` is one of them."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (hint,), False


def _kind_words(kinds: tuple[type, ...]) -> str:
    if Any in kinds:
        return "any value"
    if bool in kinds:
        return "True or False"
    if float in kinds:
        return "a finite number"
    if int in kinds:
        return "an int"
    if str in kinds:
        return "a string"
    return " or ".join(k.__name__ for k in kinds)


def _num(value: float) -> str:
    """A bound as the messages write it: ``1``, ``0.5``, ``4.5036e+15``."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _allowed(f: dataclasses.Field, hint) -> str:
    """What the field allows, in words: ``an int >= 1``, ``a finite number in [0, 1]``, ..."""
    meta = f.metadata
    kinds, optional = _kinds(hint)
    if meta.get("choices"):
        text = f"one of {list(meta['choices'])}"
    else:
        text = _kind_words(kinds)
        ge, gt, le, lt = meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt")
        if ge is not None and ge == le:
            text = _num(ge)
        elif int in kinds and float not in kinds and ge is not None and le is not None:
            text += f" in {ge}..{le}"
        elif ge is not None and le is not None:
            text += f" in [{_num(ge)}, {_num(le)}]"
        else:
            text += " and".join(f" {sign} {_num(bound)}" for sign, bound in ((">=", ge), (">", gt), ("<=", le),
                                                                            ("<", lt)) if bound is not None)
    return text + (" or None" if optional else "")


def _refusal(value: Any, f: dataclasses.Field, hint) -> ValueError:
    """The error for ``value`` of field ``f``: ``<name>=<value>: must be <what is allowed>``
    (and the field's ``what``)."""
    what = f.metadata.get("what")
    return ValueError(f"{f.name}={value!r}: must be {_allowed(f, hint)}" + (f" ({what})" if what else ""))


def _fits(value: Any, f: dataclasses.Field, hint) -> bool:
    kinds, optional = _kinds(hint)
    if Any in kinds:
        return True
    if value is None:
        return optional
    meta = f.metadata
    if meta.get("choices"):
        return value in meta["choices"]
    if bool in kinds:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if float in kinds:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
    elif int in kinds:
        if not isinstance(value, int):
            return False
    elif not isinstance(value, kinds):
        return False
    if isinstance(value, (int, float)):
        ge, gt, le, lt = meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt")
        return not ((ge is not None and value < ge) or (gt is not None and value <= gt)
                    or (le is not None and value > le) or (lt is not None and value >= lt))
    return True


@dataclass(frozen=True)
class Options:
    """Base of an entry's typed options: a frozen dataclass whose fields are made with
    :func:`option` (help and bounds in the metadata), checked at construction.

    Raises:
        ValueError: a field whose value is of the wrong type or outside its bounds, naming
            the field, the value and what is allowed.
    """

    def __post_init__(self):
        hints = _hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not _fits(value, f, hints[f.name]):
                raise _refusal(value, f, hints[f.name])

    @classmethod
    def from_mapping(cls: type[OptionsT], values: Mapping[str, Any] | Options | None, *, owner: str = "") -> OptionsT:
        """The options of a dict (or ``None``: the defaults; an instance: itself).

        Args:
            values: ``{field: value}``; unknown keys are refused.
            owner: what the options belong to, the start of an unknown key's message (e.g.
                ``"method='lora'"``).

        Raises:
            ValueError: an unknown key (naming the allowed ones and the closest), a value
                of the wrong type or outside its bounds (see :class:`Options`).
        """
        if isinstance(values, cls):
            return values
        if isinstance(values, Options):
            values = values.to_dict()
        given = dict(values or {})
        names = cls.names()
        unknown = [key for key in given if key not in names]
        if unknown:
            allowed = f"its options are {', '.join(names)}" if names else "it takes none"
            close = difflib.get_close_matches(str(unknown[0]), list(names), n=1)
            raise ValueError(f"{owner or cls.__name__} has no option {', '.join(map(repr, unknown))}: {allowed}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        return cls(**given)

    @classmethod
    def parse_text(cls, items: Iterable[str], *, owner: str = "") -> dict[str, Any]:
        """``KEY=VALUE`` strings (the command line's) as ``{key: value}``, each value read as
        its field's type: an int, a finite number, ``true``/``false`` for a flag, ``none`` for
        an option that allows ``None``, a string; then checked as :meth:`from_mapping` checks it.

        Raises:
            ValueError: an item without ``=``, an unknown key, a key given twice, a value that
                does not read as its field's type or is out of bounds (naming the key, the value
                and what is allowed).
        """
        by_name, hints = {f.name: f for f in fields(cls)}, _hints(cls)
        out: dict[str, Any] = {}
        for item in items:
            key, sep, text = str(item).partition("=")
            if not sep or not key:
                raise ValueError(f"{item!r}: give KEY=VALUE, e.g. {next(iter(by_name), 'key')}=...")
            if key not in by_name:
                cls.from_mapping({key: text}, owner=owner)  # names the allowed keys and the closest
            value = _read_text(text, by_name[key], hints[key])
            if key in out:  # a later item would silently replace the first
                raise ValueError(f"{key} is given twice ({key}={out[key]!r} and {key}={value!r}): give it once")
            out[key] = value
        cls.from_mapping(out, owner=owner)
        return out

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in field order."""
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """``{field: value}`` of every option (JSON-able when the values are)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def describe(cls) -> str:
        """The options in one line, e.g. ``"k (an int >= 1, default 3): ..."``; ``"none"``
        for a class without fields (the command line's help)."""
        rows = option_rows(cls)
        return "; ".join(f"{r['name']} ({r['allowed']}, default {r['default']}): {r['help']}" for r in rows) or "none"


def _read_text(text: str, f: dataclasses.Field, hint) -> Any:
    """One ``KEY=VALUE`` value read as its field's type (see :meth:`Options.parse_text`)."""
    kinds, optional = _kinds(hint)
    if optional and text.lower() == "none":
        return None
    readers: list[tuple[type, Callable[[str], Any]]] = [
        (bool, lambda t: {"true": True, "false": False}[t.lower()]), (int, int), (float, float), (str, str)]
    for kind, read in readers:
        if kind in kinds or (kind is str and Any in kinds):
            try:
                return read(text)
            except (KeyError, ValueError):
                break
    raise _refusal(text, f, hint)


@dataclass(frozen=True)
class NoOptions(Options):
    """The options of an entry that takes none."""


def option_rows(cls: type[Options]) -> list[dict[str, str]]:
    """One row per field of ``cls``: ``name``, ``allowed`` (its type and bounds in words),
    ``default`` (as written in Python) and ``help``.

    Raises:
        TypeError: a field made without :func:`option` (no help).
    """
    hints = _hints(cls)
    rows = []
    for f in fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: an option field needs help (make it with option(...))")
        rows.append({"name": f.name, "allowed": _allowed(f, hints[f.name]), "default": repr(f.default),
                     "help": f.metadata["help"]})
    return rows


def untyped_options(title: str, names: Iterable[str]) -> type[Options]:
    """An :class:`Options` class of ``names``, each taking any value (default ``None``): the
    options of an entry registered with option names only (no types, no bounds)."""
    spec = [(n, Any, option(None, help="an option declared by name only (any value)")) for n in names]
    return dataclasses.make_dataclass(title, spec, bases=(Options,), frozen=True)


def options_subset(source: type, names: Iterable[str], title: str) -> type[Options]:
    """An :class:`Options` class of the fields ``names`` of the dataclass ``source``, with their
    types, defaults and metadata (help and bounds): an entry's share of options held in one
    dataclass for every entry (e.g. :class:`~hf_layerswap.sparsity.SparsifyOptions`).

    Raises:
        ValueError: a name that is no field of ``source``.
    """
    by_name, hints = {f.name: f for f in fields(source)}, _hints(source)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"{title}: {missing} are no fields of {source.__name__}; its fields are {list(by_name)}")
    spec = [(n, hints[n], field(default=by_name[n].default, metadata=by_name[n].metadata)) for n in names]
    return dataclasses.make_dataclass(title, spec, bases=(Options,), frozen=True)


class RegistryEntry:
    """What every registered entry carries, whichever registry holds it.

    Attributes:
        name: the name it is registered under (the value a caller passes).
        help: what it does, in one line (the command line and the docs tables read it).
        option_class: the :class:`Options` dataclass of its typed options
            (:class:`NoOptions`: none).
        estimate: the hook :func:`~hf_layerswap.cost.estimate_cost` plans it with (its
            signature is the registry's; the entry class documents it), or ``None`` where it
            has none (``estimate_cost`` then refuses it, naming it).
        estimate_exact: the estimate is the exact count of its passes when the removed blocks
            are given (``False``: an upper bound; ``None``: each estimate says which, as a
            strategy's plan does); the contract test holds every entry to it.
    """

    name: str  # set by each entry (a dataclass entry's field has no default)
    help: str = ""
    option_class: type[Options] = NoOptions
    estimate: Callable | None = None
    estimate_exact: bool | None = True

    def parse_options(self, values: Mapping[str, Any] | Options | None = None, owner: str | None = None) -> Options:
        """``values`` as this entry's :attr:`option_class` (see :meth:`Options.from_mapping`).

        Raises:
            ValueError: an unknown option, or a value of the wrong type or out of bounds.
        """
        return self.option_class.from_mapping(values, owner=owner or f"{self.name!r}")


class Registry(dict[str, E]):
    """Name -> entry, in registration order: a dict (reads, ``in``, iteration, ``pop``) with
    one way to add, look up and list entries.

    Args:
        kind: what an entry is, in words (``"selection strategy"``), for the messages.
        argument: the argument a caller names an entry with (``"strategy"``), for the
            lookup's message ``strategy='x': allowed [...]``.
        sort_names: the lookup's message lists the names sorted (default: registration order).
    """

    #: Every registry made, by kind (the structural and contract tests read them).
    ALL: ClassVar[dict[str, Registry]] = {}

    def __init__(self, kind: str, argument: str, *, sort_names: bool = False):
        super().__init__()
        self.kind, self.argument, self.sort_names = kind, argument, sort_names
        Registry.ALL[kind] = self

    def check_new(self, name: Any) -> None:
        """Refuse ``name`` as a new entry's (a decorator checks it when it is made).

        Raises:
            ValueError: ``name`` is not a non-empty string, or is already registered.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name {name!r}: must be a non-empty string")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered (registered: {list(self)})")

    def add(self, name: str, entry: E) -> E:
        """Register ``entry`` as ``name``.

        Raises:
            ValueError: ``name`` is not a non-empty string, or is already registered.
        """
        self.check_new(name)
        self[name] = entry
        return entry

    @property
    def names(self) -> RegistryNames:
        """A live view of the registered names (see :class:`~hf_layerswap.utils.registry_names.RegistryNames`)."""
        return RegistryNames(lambda: list(self))

    def allowed(self) -> list[str]:
        """The registered names as the lookup's message lists them."""
        return sorted(self) if self.sort_names else list(self)

    def lookup(self, name: Any, argument: str | None = None) -> E:
        """The entry registered as ``name``.

        Raises:
            ValueError: an unknown name: ``<argument>=<name>: allowed [...]``, with the closest
                registered name when one is close.
        """
        if isinstance(name, str) and name in self:
            return self[name]
        raise self.unknown(name, argument=argument)

    def unknown(self, name: Any, names: Iterable[str] | None = None, argument: str | None = None) -> ValueError:
        """The error :meth:`lookup` raises for ``name``: ``<argument>=<name>: allowed [...]`` and
        the closest of ``names`` (default: the registered ones) when one is close."""
        allowed = self.allowed() if names is None else (sorted(names) if self.sort_names else list(names))
        close = difflib.get_close_matches(name, allowed, n=1) if isinstance(name, str) else []
        return ValueError(f"{argument or self.argument}={name!r}: allowed {allowed}"
                          + (f" (did you mean {close[0]!r}?)" if close else ""))


def import_package_modules(package: str, path: Iterable[str]) -> tuple[str, ...]:
    """Import every module of a package (not its subpackages' modules), sorted by name, so
    that the entries their decorators register exist once the package is imported: the last
    line of a registry package's ``__init__``, ``import_package_modules(__name__, __path__)``.
    A module already imported (by the ``__init__``'s own imports) is not run again, so the
    registration order of those stays theirs; a new module's entries come after them.

    Args:
        package: the package's dotted name (its ``__name__``).
        path: its ``__path__`` (the folders :func:`pkgutil.iter_modules` lists).

    Returns:
        The dotted names of the modules imported (``package.module``), sorted.

    Raises:
        ImportError: and anything else a module raises while it is imported (a module that
            fails to import is an error, never skipped).
    """
    names = sorted(f"{package}.{info.name}" for info in pkgutil.iter_modules(list(path))
                   if not info.name.startswith("__"))
    for name in names:
        importlib.import_module(name)
    return tuple(names)


def options_table(registry: Mapping[str, Any]) -> str:
    """A markdown table of a registry's entries and their options: one row per option
    (``| name | what it does | option | allowed | default | what the option does |``, the
    entry's name and help on its first row only), one row with option ``none`` for an entry
    that takes none; what the docs hold and ``tests/test_docs.py`` compares with the registry."""
    lines = ["| name | what it does | option | allowed | default | what the option does |",
             "|---|---|---|---|---|---|"]
    for name, entry in registry.items():
        rows = option_rows(entry.option_class) or [{"name": "", "allowed": "", "default": "", "help": ""}]
        for k, row in enumerate(rows):
            cells = [f"`{name}`" if k == 0 else "", entry.help if k == 0 else "",
                     f"`{row['name']}`" if row["name"] else "none", row["allowed"],
                     f"`{row['default']}`" if row["default"] else "", row["help"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def options_tables() -> str:
    """Every registry's :func:`options_table` under a heading naming what an entry is and the
    argument that picks it, registries sorted by kind (the docs' "Method options" section)."""
    parts = []
    for kind in sorted(Registry.ALL):
        registry = Registry.ALL[kind]
        parts.append(f"### {kind[0].upper() + kind[1:]}: `{registry.argument}=`\n\n{options_table(registry)}\n")
    return "\n".join(parts)
