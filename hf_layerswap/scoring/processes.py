"""Many processes on one scoring run: the launched processes through accelerate
(``accelerate launch`` / ``torchrun``, :class:`accelerate.PartialState`), each process's
share of the probes, the gathering of their values, and the refusal of a model that is
sharded over the processes (tensor parallel, FSDP, DeepSpeed ZeRO-3).

Probes are partitioned, not calibration batches: a probe's per-prompt values do not
depend on which other probes run next to it, so every process count gives the values of
one process, bit for bit (batches would not: the batch size could not follow the
process count without changing the last bits). Each process needs the whole model.
"""

from __future__ import annotations

from typing import Any

import os

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from torch import nn

from ..models import accelerator_available, launched_processes

try:  # a torch built without distributed support has neither (and no model can use them)
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    _FSDP_TYPES: tuple = (FullyShardedDataParallel, FSDPModule)
except ImportError:
    _FSDP_TYPES, DTensor = (), None

__all__ = ["Processes", "ShardedModelError", "check_model_replica", "is_main_process", "sharded_layout", "sum_movement"]


class ShardedModelError(ValueError):
    """The model is split over processes (tensor parallel, FSDP, ZeRO-3): each process
    must hold one whole replica for the processes to score different probes."""


def _launched() -> bool:
    """Started by a launcher with more than one process, or a process group exists."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    return launched_processes() > 1


def sharded_layout(model: nn.Module) -> str | None:
    """How ``model`` is split over processes, or None for one whole replica.

    Detects what transformers and torch set: a device mesh or tensor/FSDP/pipeline degree
    above 1 from ``from_pretrained(tp_plan=..., distributed_config=...)``
    (``_device_mesh``, ``_tp_size``, ``_fsdp_size``), DTensor parameters, an FSDP wrapper
    (``FullyShardedDataParallel`` or FSDP2's ``FSDPModule``) and DeepSpeed ZeRO-3
    partitioned parameters (``ds_id``). The class's own ``_tp_plan`` is not a sign: every
    transformers model carries one."""
    for name, what in (("_tp_size", "tensor parallel"), ("_fsdp_size", "FSDP")):
        size = getattr(model, name, None)
        if isinstance(size, int) and size > 1:
            return f"{what} of degree {size} ({name}={size})"
    if getattr(model, "_device_mesh", None) is not None:
        return "loaded with a device mesh (from_pretrained(tp_plan=...) or distributed_config=...)"
    for mod_name, module in model.named_modules():
        if _FSDP_TYPES and isinstance(module, _FSDP_TYPES):
            return f"FSDP-wrapped ({type(module).__name__} at {mod_name or 'the model'!r})"
    for name, param in model.named_parameters():
        if DTensor is not None and isinstance(param, DTensor):
            return f"tensor parallel (parameter {name!r} is a DTensor)"
        if hasattr(param, "ds_id"):
            return f"DeepSpeed ZeRO-3 partitioned (parameter {name!r})"
    return None


def check_model_replica(model: nn.Module) -> None:
    """Refuse a model split over processes, before any forward pass.

    Raises:
        ShardedModelError: ``model`` is tensor-parallel, FSDP-wrapped, ZeRO-3
            partitioned or loaded with a device mesh (the message names which and what
            to do instead).
    """
    layout = sharded_layout(model)
    if layout is not None:
        raise ShardedModelError(
            f"the model is sharded over processes: {layout}. Scoring runs different probes on different processes, "
            "which needs one whole model replica per process: load the model without tp_plan/distributed_config/"
            "FSDP/ZeRO-3 in each process (e.g. from_pretrained(..., device_map={'': PartialState().device}) under "
            "`accelerate launch --num_processes N`), or run one process with device_map='auto' to split a model too "
            "large for one device over its devices"
        )


class Processes:
    """This process's place among the launched processes (accelerate's
    :class:`~accelerate.PartialState`), or one process.

    Args:
        distributed: ``None``: partition when launched with more than one process (or a
            process group exists); ``False``: never; ``True``: require it.

    Attributes:
        rank, world: this process's index and the number of processes.

    Raises:
        ValueError: ``distributed=True`` in a run that was not launched with several
            processes.
    """

    def __init__(self, distributed: bool | None = None):
        self.state = None
        self.rank, self.world = 0, 1
        if distributed is False:
            return
        if not _launched():
            if distributed:
                raise ValueError(
                    "distributed=True but this process was not launched with several processes: run it under "
                    "`accelerate launch --num_processes N` (or torchrun), or pass distributed=None/False"
                )
            return
        cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not accelerator_available()
        self.state = PartialState(cpu=cpu)
        self.rank, self.world = self.state.process_index, self.state.num_processes

    def share(self, partition, items: list) -> list:
        """This process's share of ``items``: ``partition(items, world, rank)`` gives each
        process's (deterministic, cost-balanced: :func:`~.probes.shard`), and this process
        takes its own through :meth:`~accelerate.PartialState.split_between_processes`."""
        if self.world <= 1:
            return items
        shares = [partition(items, self.world, r) for r in range(self.world)]
        with self.state.split_between_processes(shares) as mine:
            return mine[0]

    def barrier(self) -> None:
        if self.world > 1:
            self.state.wait_for_everyone()

    def gather(self, item) -> list:
        """``item`` of every process, in process order (:func:`accelerate.utils.gather_object`)."""
        if self.world <= 1:
            return [item]
        return gather_object([item])


def is_main_process() -> bool:
    """True in the first (or only) launched process: the one that writes shared outputs."""
    return Processes().rank == 0


def sum_movement(parts: list[tuple[dict, list[int]]]) -> dict:
    """The weight movement of every process of one run, as the report records it.

    Args:
        parts: per process, in process order (:meth:`Processes.gather`), its counters
            ``({"block_onloads": int, "bytes_moved": int}, onloads per batch)``.

    Returns:
        ``block_onloads``, ``bytes_moved`` (bytes) and ``block_onloads_per_batch`` summed
        over the processes (each process streams the blocks for its own share of the
        probes), the same for ``head_bytes_moved`` and ``embedding_bytes_moved`` where the
        counters have them (a streamed head and embedding), and ``per_process``: each
        process's own block counters, in process order.
    """
    per_process: list[dict[str, Any]] = [{"block_onloads": int(moved["block_onloads"]), "bytes_moved": int(moved["bytes_moved"]),
                    "block_onloads_per_batch": list(batches)} for moved, batches in parts]
    width = max((len(p["block_onloads_per_batch"]) for p in per_process), default=0)
    return {
        "block_onloads": sum(p["block_onloads"] for p in per_process),
        "bytes_moved": sum(p["bytes_moved"] for p in per_process),
        "block_onloads_per_batch": [sum(p["block_onloads_per_batch"][b] for p in per_process
                                        if b < len(p["block_onloads_per_batch"])) for b in range(width)],
        **{key: sum(int(moved.get(key, 0)) for moved, _ in parts) for key in ("head_bytes_moved", "embedding_bytes_moved")
           if any(key in moved for moved, _ in parts)},
        "per_process": per_process,
    }
