"""Registries of the per-block sparsity allocators and the per-matrix pruners.

:func:`~hf_layerswap.sparsity.sparsify` looks ``allocation=`` up in :data:`ALLOCATORS`
and ``method=`` in :data:`PRUNERS`; everything that depends on the name (which options it
reads, the statistics it needs during the dense pass, how the model card describes it)
comes from the registered entry. Adding a method is one module with one decorator::

    from hf_layerswap.sparsity import register_allocator, uniform_allocation

    @register_allocator("flat", label="flat: every block at the target")
    def flat(inputs):
        return uniform_allocation(inputs.num_params, inputs.sparsity), None, {}

The built-in entries are registered in :mod:`hf_layerswap.sparsity.methods`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..utils.registry import Options, Registry, RegistryEntry, options_subset
from .options import SparsifyOptions

__all__ = [
    "ALLOCATORS",
    "PRUNERS",
    "AllocationInputs",
    "Allocator",
    "Pruner",
    "get_allocator",
    "get_pruner",
    "register_allocator",
    "register_pruner",
]


@dataclass
class AllocationInputs:
    """What an allocator gets after the dense pass.

    Attributes:
        sparsity: the overall target ``s`` in [0, 1).
        num_params: prunable weights per block (the budget weights), 0-based blocks.
        options: the :class:`~hf_layerswap.sparsity.SparsifyOptions` of the call.
        block_linears: per block, the ``(name, nn.Linear)`` pairs that will be pruned.
        collectors: what the allocator's ``observe`` hooks gathered (empty without one).
        gradients: per-block mean ``|dL/dW|`` when the allocator asked for them, else ``None``.
    """

    sparsity: float
    num_params: list[int]
    options: Any  # a SparsifyOptions (sparsity/__init__.py, which imports this module)
    block_linears: list
    collectors: dict = field(default_factory=dict)
    gradients: list[float] | None = None


class _SparsityEntry(RegistryEntry):
    """What an allocator and a pruner share as registry entries: ``help`` is the card's label,
    the typed options are their share of :class:`~hf_layerswap.sparsity.SparsifyOptions`."""

    name: str
    label: str
    options: tuple[str, ...]

    @property
    def help(self) -> str:  # type: ignore[override]
        """The entry's one line: its :attr:`label`."""
        return self.label

    @property
    def option_class(self) -> type[Options]:  # type: ignore[override]
        """Its typed options: the :class:`~hf_layerswap.sparsity.SparsifyOptions` fields it
        reads (:attr:`options`), with their help and bounds."""
        return options_subset(SparsifyOptions, self.options, "".join(w.title() for w in self.name.split("_")) + "Options")


@dataclass(frozen=True)
class Allocator(_SparsityEntry):
    """A per-block sparsity rule (a :class:`~hf_layerswap.utils.registry.RegistryEntry`; its
    :meth:`estimate` is the passes per calibration batch the cost model adds for it).

    Attributes:
        name: the ``allocation=`` value.
        label: how the model card names it.
        allocate: ``(AllocationInputs) -> (targets, statistic per block or None, info)``;
            ``targets`` are per-block sparsities whose parameter-weighted mean is the target
            (or the rule's own budget, stated in ``info["budget"]``); ``info`` is recorded
            in the report's ``allocator`` entry.
        observe: ``(options, block_linears) -> (on_block_input, linear_hooks, collectors)``
            for statistics of the dense model (see
            :func:`~hf_layerswap.sparsity.engine.capture_block_calls`), or ``None``.
        needs_gradients: run a gradient pass first (``AllocationInputs.gradients``).
        memory: ``(options, linears, hidden, rows) -> (kept, update)`` bytes of its
            ``observe`` statistics: ``kept`` the collectors, held until the pruning pass
            ends, ``update`` the largest temporaries of one update in the dense pass; for
            ``linears`` the ``(out_features, in_features)`` of each block's prunable
            linears, ``hidden`` the stream's width and ``rows`` the real positions of each
            batch (:meth:`memory_bytes`); ``None``: nothing counted. (A gradient pass,
            :attr:`needs_gradients`, is counted by the cost model itself.)
        options: the :class:`~hf_layerswap.sparsity.SparsifyOptions` fields it reads
            (others given with it are warned about); ``"delta"`` among them makes it a
            bounded allocation (``sparsity + delta < 1`` is checked up front).
        card_options: ``(allocator record) -> [phrases]`` shown next to the label; the
            record is the compact one in ``config.json`` (:func:`config_record`): the common
            entries (``statistic``, ``budget``, the built-ins' options) plus ``record_keys``.
        record_keys: further ``info`` entries kept in that compact record.
    """

    name: str
    label: str
    allocate: Callable
    observe: Callable | None = None
    needs_gradients: bool = False
    options: tuple[str, ...] = ()
    card_options: Callable[[Mapping], list[str]] | None = None
    record_keys: tuple[str, ...] = ()
    memory: Callable | None = None

    def memory_bytes(self, options, linears: list[list[tuple[int, int]]], hidden: int,
                     rows: list[int]) -> tuple[int, int]:
        """``(kept, update)`` bytes of :attr:`memory` (``(0, 0)`` without one), for
        :func:`~hf_layerswap.cost.estimate_cost`."""
        if self.memory is None:
            return 0, 0
        kept, update = self.memory(options, linears, hidden, rows)
        return int(kept), int(update)

    def estimate(self) -> dict[str, int]:
        """Its own passes per calibration batch on the pruned model (what
        :func:`~hf_layerswap.cost.estimate_cost` adds to the dense pass and the propagation):
        ``gradient_forwards``, 1 for an allocator that runs a gradient pass (a forward with
        the head and a backward) first, else 0."""
        return {"gradient_forwards": int(self.needs_gradients)}


@dataclass(frozen=True)
class Pruner(_SparsityEntry):
    """A per-matrix pruning method (a :class:`~hf_layerswap.utils.registry.RegistryEntry`; its
    :meth:`estimate` is the passes per calibration batch the cost model adds for it).

    Attributes:
        name: the ``method=`` value.
        label: how the model card names it.
        prune: ``(weight, statistics or None, target, pattern, options) -> new weight``
            (same shape; ``pattern`` is ``None`` or ``"N:M"``).
        statistics: a class built as ``statistics(in_features, device)`` with an
            ``update(rows)`` method, fed the real input rows of each linear during the
            pruning pass (e.g. row norms, a Hessian), or ``None`` for data-free methods.
        options: the :class:`~hf_layerswap.sparsity.SparsifyOptions` fields it reads.
        memory: ``(options, linears, rows) -> bytes``: what it holds while one block is
            pruned, for ``linears`` the ``(out_features, in_features)`` of that block's
            prunable linears and ``rows`` the real positions of each batch: the statistics
            of every linear of the block and the temporaries of pruning its largest one
            (:meth:`memory_bytes`); ``None``: one fp32 value per input feature of each
            linear.
    """

    name: str
    label: str
    prune: Callable
    statistics: type | None = None
    options: tuple[str, ...] = ()
    memory: Callable | None = None

    def memory_bytes(self, options, linears: list[tuple[int, int]], rows: list[int]) -> int:
        """Bytes of :attr:`memory` for one block's ``linears`` (its default without one)."""
        if self.memory is None:
            return 4 * sum(i for _, i in linears) if self.statistics is not None else 0
        return int(self.memory(options, linears, rows))

    def estimate(self) -> dict[str, int]:
        """Its own passes per calibration batch on the pruned model: ``statistics_replays``,
        1 for a pruner that feeds statistics (:attr:`statistics`) in a replay of each block,
        else 0."""
        return {"statistics_replays": int(self.statistics is not None)}


#: ``allocation=`` name -> :class:`Allocator`, in registration order (a
#: :class:`~hf_layerswap.utils.registry.Registry`).
ALLOCATORS: Registry[Allocator] = Registry("allocator", "allocation")

#: ``method=`` name -> :class:`Pruner`, in registration order.
PRUNERS: Registry[Pruner] = Registry("pruning method", "pruner")


def register_allocator(
    name: str,
    *,
    label: str,
    observe: Callable | None = None,
    needs_gradients: bool = False,
    options: tuple[str, ...] = (),
    card_options: Callable[[Mapping], list[str]] | None = None,
    record_keys: tuple[str, ...] = (),
    memory: Callable | None = None,
):
    """Decorator registering ``allocate`` as the allocator ``name`` (see :class:`Allocator`).

    Raises:
        ValueError: ``name`` is empty or already registered.
    """
    ALLOCATORS.check_new(name)

    def decorate(allocate):
        ALLOCATORS.add(name, Allocator(
            name, label, allocate, observe, needs_gradients, tuple(options), card_options, tuple(record_keys),
            memory,
        ))
        return allocate

    return decorate


def register_pruner(name: str, *, label: str, statistics: type | None = None, options: tuple[str, ...] = (),
                    memory: Callable | None = None):
    """Decorator registering ``prune`` as the pruning method ``name`` (see :class:`Pruner`).

    Raises:
        ValueError: ``name`` is empty or already registered.
    """
    PRUNERS.check_new(name)

    def decorate(prune):
        PRUNERS.add(name, Pruner(name, label, prune, statistics, tuple(options), memory))
        return prune

    return decorate


def get_allocator(name) -> Allocator:
    """The registered allocator ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones and the closest.
    """
    return ALLOCATORS.lookup(name)


def get_pruner(name) -> Pruner:
    """The registered pruning method ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones and the closest.
    """
    return PRUNERS.lookup(name)
