"""Swap protocols behind one registry: what ``score_layers(protocols=...)`` scores for a
block pair ``i < j``. Adding a protocol is one function and one decorator::

    @register_protocol("skip_both")
    def skip_both(num_blocks, i, j):
        return {"skip_both": removal_plan(num_blocks, [i, j])}

A protocol's function returns one layer plan (:mod:`hf_layerswap.layerplan`) per *probe* it
declares (``probes=``, default: one probe named after the protocol). The scoring engine
runs every probe of every pair; the protocol's value for the pair is the largest of its
probes' values (NaN if any is NaN), the paper's bidirectional d_repl for replacement and
the probe itself for a one-probe protocol. The report keeps each probe's mean and
standard error (:class:`~hf_layerswap.scoring.report.PairResult`).

The built-ins are the paper's two (No Free Swap, arXiv 2605.16234, Def. 1):

- ``"replacement"``: probes ``replacement_ij`` (slot i runs block j) and
  ``replacement_ji`` (slot j runs block i);
- ``"interchange"``: probe ``interchange`` (slots i and j exchange blocks).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..layerplan import interchange_plan, replacement_plan
from ..utils.registry import Registry, RegistryEntry

__all__ = [
    "PALETTE",
    "PROTOCOLS",
    "SWAP_PROTOCOLS",
    "SwapProtocol",
    "check_protocols",
    "get_protocol",
    "probe_kinds",
    "protocol_color",
    "protocol_label",
    "protocol_of",
    "register_protocol",
    "unregister_protocol",
]

#: The paper's protocols, always registered: the default of ``score_layers(protocols=)``.
PROTOCOLS = ("replacement", "interchange")

#: Plot colours given to protocols registered without one, in registration order.
PALETTE = ("#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")

#: Names a probe may not take: the pair's own fields and derived values in
#: :class:`~hf_layerswap.scoring.report.PairResult`.
_RESERVED = frozenset({"i", "j", "gap", "ratio", "extra", "value"})
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class SwapProtocol(RegistryEntry):
    """One registered protocol (a :class:`~hf_layerswap.utils.registry.RegistryEntry` without
    options; its :meth:`estimate` is the probes' plans of a pair, which the scoring engine's
    plan, and so :func:`~hf_layerswap.cost.estimate_cost`, prices exactly).

    Attributes:
        name: the ``protocols=`` value.
        probes: the probe kinds it runs per pair, in order (report fields ``<kind>`` and
            ``<kind>_se``).
        plans: ``fn(num_blocks, i, j) -> {kind: plan}`` with one plan per probe kind.
        label: how the model card and the plots name it (default: :attr:`name`).
        color: its matplotlib colour in the plots (default: one of a fixed palette, by
            registration order).
        help: what a probe does to the pair, in one line (default: the first line of the
            function's docstring, else the label).
    """

    name: str
    probes: tuple[str, ...]
    plans: Callable[[int, int, int], dict]
    label: str = ""
    color: str = ""
    help: str = ""

    def estimate(self, num_blocks: int, i: int, j: int) -> dict[str, list[int]]:
        """The entry's estimate: the plans of pair ``(i, j)`` (:meth:`pair_plans`), each one
        forward of its blocks per batch in the engine's plan."""
        return self.pair_plans(num_blocks, i, j)

    def pair_plans(self, num_blocks: int, i: int, j: int) -> dict[str, list[int]]:
        """The probes' plans for pair ``(i, j)``, in :attr:`probes` order.

        Raises:
            ValueError: the function's kinds are not the declared :attr:`probes`.
        """
        out = self.plans(num_blocks, i, j)
        if not isinstance(out, dict) or set(out) != set(self.probes):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise ValueError(f"protocol {self.name!r} returned plans for {got}; it declares probes {list(self.probes)}")
        return {kind: list(out[kind]) for kind in self.probes}


#: Protocol name -> :class:`SwapProtocol`, in registration order (the order probes are
#: listed in a sweep and protocols in messages).
SWAP_PROTOCOLS: Registry[SwapProtocol] = Registry("swap protocol", "protocol")


def probe_kinds(protocols: Sequence[str] | None = None) -> tuple[str, ...]:
    """The probe kinds of ``protocols`` (default: all registered), in registration order."""
    chosen = SWAP_PROTOCOLS if protocols is None else [p for p in SWAP_PROTOCOLS if p in protocols]
    return tuple(kind for p in chosen for kind in SWAP_PROTOCOLS[p].probes)


def protocol_of(name: str) -> str | None:
    """The registered protocol ``name`` is, or whose probe kind it is; None if neither."""
    if name in SWAP_PROTOCOLS:
        return name
    return next((p.name for p in SWAP_PROTOCOLS.values() if name in p.probes), None)


def register_protocol(name: str, *, probes: Sequence[str] | None = None, label: str | None = None,
                      color: str | None = None, help: str | None = None):
    """Decorator registering ``fn(num_blocks, i, j) -> {kind: plan}`` as the swap protocol
    ``name`` (see :class:`SwapProtocol`); ``probes`` defaults to ``(name,)``, ``label`` (the
    card's and plots' name) to ``name``, ``color`` (the plots') to the next of :data:`PALETTE`,
    ``help`` (one line) to the first line of ``fn``'s docstring, else the label.

    Raises:
        ValueError: a name or probe kind that is not lower-case ``[a-z][a-z0-9_]*``, ends
            in ``_se``, is reserved, or is already taken by a registered protocol or probe.
    """
    kinds = (name,) if probes is None else tuple(probes)
    taken = set(SWAP_PROTOCOLS) | set(probe_kinds())
    for word in dict.fromkeys((name, *kinds)):
        if not isinstance(word, str) or not _NAME.fullmatch(word) or word.endswith("_se") or word in _RESERVED:
            raise ValueError(
                f"protocol name or probe {word!r}: must match [a-z][a-z0-9_]*, not end in '_se' and not be one of "
                f"{sorted(_RESERVED)}"
            )
        if word in taken:
            raise ValueError(f"protocol name or probe {word!r} is already registered (protocols: {list(SWAP_PROTOCOLS)})")
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"protocol {name!r}: probes={list(kinds)} must be distinct and at least one")

    def decorate(fn):
        shade = color or PALETTE[len(SWAP_PROTOCOLS) % len(PALETTE)]
        text = help or ((fn.__doc__ or "").strip().split("\n")[0]) or label or name
        SWAP_PROTOCOLS.add(name, SwapProtocol(name, kinds, fn, label=label or name, color=shade, help=text))
        return fn

    return decorate


def unregister_protocol(name: str) -> None:
    """Remove a registered protocol (the built-ins stay).

    Raises:
        ValueError: ``name`` is a built-in or not registered.
    """
    if name in PROTOCOLS:
        raise ValueError(f"protocol {name!r} is built in and cannot be unregistered")
    get_protocol(name)
    del SWAP_PROTOCOLS[name]


def protocol_label(name: str) -> str:
    """How the card and the plots name protocol ``name`` (its :attr:`SwapProtocol.label`;
    the name itself for one this process has not registered, e.g. in a loaded report)."""
    entry = SWAP_PROTOCOLS.get(name)
    return entry.label if entry is not None else str(name)


def protocol_color(name: str) -> str:
    """The plots' colour of protocol ``name`` (:attr:`SwapProtocol.color`; grey if unregistered)."""
    entry = SWAP_PROTOCOLS.get(name)
    return entry.color if entry is not None else "#777777"


def get_protocol(name) -> SwapProtocol:
    """The registered protocol ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    return SWAP_PROTOCOLS.lookup(name)


def check_protocols(protocols) -> tuple[str, ...]:
    """``protocols=`` as a tuple of registered names, first occurrence kept.

    Raises:
        ValueError: a string instead of a list, an empty list or an unregistered name
            (the message lists the registered ones).
    """
    allowed = list(SWAP_PROTOCOLS)
    if isinstance(protocols, str):
        raise ValueError(f"protocols={protocols!r}: give a list, e.g. [{protocols!r}], a non-empty subset of {allowed}")
    protocols = tuple(dict.fromkeys(protocols))
    if not protocols or any(not isinstance(p, str) or p not in SWAP_PROTOCOLS for p in protocols):
        raise ValueError(f"protocols={protocols!r}: allowed a non-empty subset of {allowed}")
    return protocols


# ----------------------------------------------------------------------------- built-ins
@register_protocol("replacement", probes=("replacement_ij", "replacement_ji"), color="#d95f02",
                   help="slot i runs block j, and slot j runs block i (two probes; the pair's value is the larger)")
def _replacement(num_blocks: int, i: int, j: int) -> dict[str, list[int]]:
    return {"replacement_ij": replacement_plan(num_blocks, i, j), "replacement_ji": replacement_plan(num_blocks, j, i)}


@register_protocol("interchange", color="#1b9e77", help="slots i and j exchange their blocks (one probe)")
def _interchange(num_blocks: int, i: int, j: int) -> dict[str, list[int]]:
    return {"interchange": interchange_plan(num_blocks, i, j)}
