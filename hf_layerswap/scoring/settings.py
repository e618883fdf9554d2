"""How the scoring engine runs: :class:`EngineSettings`, the one frozen record of the
settings every scoring verb passes to the engine (batch size, memory budget, reduced
precision, prefix reuse, streamed KL, checkpoint, ranks, progress), validated once.

A setting changes how the work is done, not what is computed: the scored values depend
only on the model, the prompts and the plans, except through the batch size, the chunk
sizes the budget implies and ``dtype`` (see :mod:`hf_layerswap.scoring`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import psutil
import torch
from accelerate.utils import convert_file_size_to_int
from torch import nn

from ..utils.devices import held_bytes, model_devices, same_device
from .kl import KL_SUB_BYTES

__all__ = [
    "CPU_BATCH_SIZE", "DEFAULT_MAX_MEMORY", "MEMORY_CAP", "MEMORY_SHARE", "PREFIX_REUSE_MODES", "EngineSettings",
    "MemoryBudget", "MemoryBudgetWarning", "REFERENCE_SHARE", "SLICE_SLACK", "batch_activation_bytes",
    "block_activation_bytes",
    "device_batch_size", "device_memory_budget", "dtype_name",
    "kl_block_bytes", "load_limit", "model_memory_budget", "parse_memory", "resolve_memory", "slice_budget",
]

#: Working memory (bytes, beyond the weights) that scoring plans for on a CPU with enough
#: available memory, and anywhere the free memory cannot be read: the CPU's cap.
DEFAULT_MAX_MEMORY = 1 << 30

#: Share of the device's free memory (CUDA: ``torch.cuda.mem_get_info``; CPU: the
#: available memory, ``psutil``) that the working-memory budget takes when ``max_memory``
#: is ``None``/``"auto"``, per device kind ("cpu" or "accelerator").
MEMORY_SHARE = {"cpu": 0.25, "accelerator": 0.5}

#: Cap of that budget per device kind: on a CPU larger blocks gain nothing (the KL's row
#: blocks stay cache-sized), so the cap is :data:`DEFAULT_MAX_MEMORY` and results equal
#: those of a fixed 1 GiB budget whenever 4 GiB are available; an accelerator takes large
#: head/KL blocks and batches up to the cap.
MEMORY_CAP = {"cpu": DEFAULT_MAX_MEMORY, "accelerator": 8 << 30}

#: Smallest derived budget (a nearly full device still gets workable chunks).
_MIN_BUDGET = 64 << 20

#: Prompts per forward pass on a CPU when ``batch_size`` is ``None``; an accelerator then
#: takes ``"auto"`` (the largest batch, up to 64, whose activations fit half the budget).
CPU_BATCH_SIZE = 8

#: ``prefix_reuse`` modes, most sharing first (``True`` is ``"shared"``, ``False`` ``"none"``).
PREFIX_REUSE_MODES = ("shared", "start", "none")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

#: Compute dtypes ``dtype=`` may name (autocast lowers precision only).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def parse_memory(value) -> int:
    """Bytes from an int or a string like ``"1.5GB"``/``"800MiB"`` (decimal and binary units).

    Raises:
        ValueError: anything else, or a value below 1 MiB.
    """
    if isinstance(value, bool):
        raise ValueError(f"max_memory={value!r}: give bytes (int), a string such as '2GB', or 'auto'")
    if isinstance(value, int):
        out = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_memory={value!r}: give bytes (int), a string such as '1.5GB' or '800MiB', or 'auto'")
        out = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise ValueError(f"max_memory={value!r}: give bytes (int), a string such as '2GB', or 'auto'")
    if out < 1 << 20:
        raise ValueError(f"max_memory={value!r} is {out} bytes: at least 1 MiB is needed")
    return out


def _device_kind(device: torch.device) -> str:
    return "cpu" if device.type in ("cpu", "meta") else "accelerator"


def _free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes, or None where it cannot be read."""
    try:
        if device.type == "cpu":
            return int(psutil.virtual_memory().available)
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "mem_get_info"):
            return int(module.mem_get_info(device)[0])
    except (RuntimeError, OSError, ValueError):
        pass
    return None


def device_memory_budget(device, *, limit: int | None = None, weights: int = 0, pending: int = 0) -> tuple[int, str]:
    """The working-memory budget scoring derives for ``device`` when ``max_memory`` is
    ``None``/``"auto"``: :data:`MEMORY_SHARE` of what remains on it after the weights, at
    most :data:`MEMORY_CAP`, at least 64 MiB, rounded down to a power of two (so that small
    changes in free memory leave the chunk sizes, and a resumed run's settings, alone).

    What remains is the device's free memory (CUDA: ``torch.cuda.mem_get_info``, read with
    the weights loaded; CPU: the available memory), and where the model was loaded under a
    ``max_memory`` limit for the device (accelerate's per-device limits), at most what that
    limit leaves after the ``weights`` held there.

    Args:
        device: a ``torch.device`` or its name (``"cpu"``, ``"cuda:0"``).
        limit: the load's ``max_memory`` for ``device`` in bytes, or None.
        weights: bytes of the model's weights held on ``device`` (counted against ``limit``).
        pending: bytes of weights not loaded yet that the run will hold on ``device`` (an
            estimate made before the load, :func:`~hf_layerswap.cost.estimate_cost`): taken
            from the free memory read now, as the load will take them.

    Returns:
        ``(bytes, how)``: the budget and a sentence saying how it was derived (recorded
        in the report's metadata as ``max_memory_source``).
    """
    device = torch.device(device)
    kind = _device_kind(device)
    free = _free_bytes(device)
    where = f"free on {device}"
    if free is not None and pending:
        free, where = max(0, free - pending), f"free on {device} less {_gib(pending)} of weights still to load"
    if limit is not None:
        left = max(0, limit - weights)
        if free is None or left < free:
            free, where = left, f"left on {device} by max_memory ({_gib(limit)} less {_gib(weights)} of weights)"
    if free is None:
        return DEFAULT_MAX_MEMORY, f"auto: the free memory of {device} could not be read; {_gib(DEFAULT_MAX_MEMORY)}"
    share, cap = MEMORY_SHARE[kind], MEMORY_CAP[kind]
    raw = max(_MIN_BUDGET, min(cap, int(share * free)))
    budget = 1 << (raw.bit_length() - 1)
    return budget, (f"auto: {share:.0%} of {_gib(free)} {where}, cap {_gib(cap)}, "
                    f"rounded down to a power of two: {_gib(budget)}")


def load_limit(model: nn.Module, device) -> int | None:
    """The ``max_memory`` limit in bytes that ``model`` was loaded under for ``device``
    (:func:`~hf_layerswap.models.load_model` records it as ``model.layerswap_max_memory``;
    accelerate's format: a GPU index, ``"cpu"``, ``"cuda:1"``), or None."""
    limits = getattr(model, "layerswap_max_memory", None) or {}
    for key, size in limits.items():
        if key != "disk" and same_device(key, device):
            return int(convert_file_size_to_int(size))
    return None


def model_memory_budget(model: nn.Module) -> tuple[int, str]:
    """The ``"auto"`` working-memory budget of ``model``: :func:`device_memory_budget` on
    every device it computes on (:func:`~hf_layerswap.utils.devices.model_devices`: each GPU of a
    split model, not only the first), each with what its load limit leaves after the weights
    held there, and the least of them, since each device in turn holds the working memory
    of a pass. Returns ``(bytes, how)`` as :func:`device_memory_budget`."""
    budgets = []
    for device in model_devices(model):
        limit = load_limit(model, device)
        weights = held_bytes(model, device) if limit is not None else 0
        budgets.append((*device_memory_budget(device, limit=limit, weights=weights), device))
    budget, how, device = min(budgets, key=lambda b: b[0])
    if len(budgets) > 1:
        how += f" (the least of {', '.join(f'{_gib(b)} on {d}' for b, _, d in budgets)})"
    return budget, how


#: Share of one working-memory budget that the search's kept dense reference
#: (:class:`~hf_layerswap.scoring.reference.ReferenceCache`) may take; its engine calls
#: get the rest, so the two together stay within the budget.
REFERENCE_SHARE = 0.5

#: Row blocks of the KL's temporaries take at most this share of the slice budget
#: (:func:`slice_budget`) in fp32 bytes; their float64 temporaries (two of them, 8 bytes per
#: entry) take four times as much.
KL_TEMP_SHARE = 1 / 16

#: Share of the slice budget (:func:`slice_budget`) left over beside the head/KL block
#: (``HEAD_BUDGET_FRACTION``, 0.4), the KL's float64 temporaries (``4 * KL_TEMP_SHARE``, 0.25)
#: and the held final rows (``FLUSH_BUDGET_FRACTION``, 0.25): the KL's per-row float64 state
#: (8 bytes x (3 + 2 probes) per position) and the allocator's rounding.
SLICE_SLACK = 0.1

#: The slice budget is never less than this share of the engine's budget (a batch whose
#: activations alone fill the budget still gets workable head/KL blocks; its estimate then
#: shows the working memory above the budget).
_MIN_SLICE_SHARE = 1 / 8


class MemoryBudgetWarning(UserWarning):
    """A step needs more working memory than the one budget (``max_memory``) allows for
    what it cannot slice; the message names the step, its need and the budget. Issued
    before the step's work (:func:`~hf_layerswap.prune`, :func:`~hf_layerswap.recover`)."""


def block_activation_bytes(positions: int, seq_len: int, hidden: int, intermediate: int, heads: int,
                           element_bytes: int) -> int:
    """Working memory of one decoder block's forward over ``positions`` positions of
    prompts of ``seq_len`` tokens (bytes): its hidden-size and intermediate-size
    temporaries (``8 H + 3 I`` per position in the compute dtype) and the attention scores
    (``heads x seq_len^2`` fp32 per prompt)."""
    prompts = positions // max(1, seq_len)
    return positions * (8 * hidden + 3 * intermediate) * element_bytes + prompts * heads * seq_len**2 * 4


def batch_activation_bytes(cfg, num_blocks: int, batch_size: int, seq_len: int, element_bytes: int) -> int:
    """Working memory of one batch of ``batch_size`` prompts of ``seq_len`` tokens through a
    model of ``num_blocks`` blocks (text config ``cfg``) in a ``element_bytes``-byte compute
    dtype, in bytes: the streams entering every block and leaving the last (``(L + 1) x B x
    T x H``) and one block's forward (:func:`block_activation_bytes`). What the scoring
    engine and the selection's NLL (:func:`~hf_layerswap.selection.nll.plan_nll`)
    hold of a batch beside their sliced head work (:func:`slice_budget`)."""
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    streams = (num_blocks + 1) * batch_size * seq_len * hidden * element_bytes
    return streams + block_activation_bytes(batch_size * seq_len, seq_len, hidden, inter, heads, element_bytes)


def slice_budget(budget: int, activation_bytes: int, fixed_bytes: int = 0) -> int:
    """Bytes of an engine call's working-memory ``budget`` that its sliced parts share: what
    remains after the activations of one batch (``activation_bytes``: the streams entering
    every block and one block's forward) and the head's fixed working piece
    (``fixed_bytes``: one upcast piece of a half-precision head on a CPU, one vocabulary
    slice of an offloaded head). The head/KL block takes 0.4 of it, the KL's float64
    temporaries 0.25, the final rows held before a head/KL flush 0.25, and
    :data:`SLICE_SLACK` is left for the KL's per-row state, so activations + fixed piece +
    sliced parts stay within ``budget``. At least ``budget / 8``.

    Returns:
        bytes (>= 1).
    """
    return max(1, int(_MIN_SLICE_SHARE * budget), int(budget) - int(activation_bytes) - int(fixed_bytes))


@dataclass(frozen=True)
class MemoryBudget:
    """One working-memory budget (bytes beyond the weights), resolved once and handed to
    every step that takes working memory: the scoring engine, the selection's engine calls
    and kept reference (:data:`REFERENCE_SHARE` of it, :meth:`split`).

    Attributes:
        bytes: the budget in bytes (>= 1 MiB).
        source: how it was chosen (``"given"``, or the sentence of
            :func:`device_memory_budget`); recorded as ``max_memory_source``.
    """

    bytes: int
    source: str = "given"

    def split(self, share: float = REFERENCE_SHARE) -> tuple["MemoryBudget", "MemoryBudget"]:
        """``(kept, working)``: ``share`` of the budget for what is kept between calls (the
        search's reference) and the rest, at least 1 MiB, for each call's working memory."""
        kept = int(share * self.bytes)
        note = f"{self.source}; {share:.0%} kept for the reference" if share else self.source
        return (MemoryBudget(kept, self.source),
                MemoryBudget(max(1 << 20, self.bytes - kept), note))


def resolve_memory(max_memory, device) -> MemoryBudget:
    """The one :class:`MemoryBudget` of ``max_memory`` on ``device`` (a device, its name, or
    the model: all the devices it computes on): a :class:`MemoryBudget` as it is; bytes or
    a size such as ``"2GiB"`` (:func:`parse_memory`); ``None``/``"auto"``:
    :func:`model_memory_budget` for a model, :func:`device_memory_budget` for a device.

    Raises:
        ValueError: a value that is no size (the message names it and what is allowed).
    """
    if isinstance(max_memory, MemoryBudget):
        return max_memory
    if max_memory in (None, "auto"):
        return MemoryBudget(*(model_memory_budget(device) if isinstance(device, nn.Module)
                              else device_memory_budget(device)))
    return MemoryBudget(parse_memory(max_memory), "given")


def kl_block_bytes(device, budget: int) -> int:
    """Bytes of one row block of the KL's fp32 temporaries (:func:`~.kl.row_blocks`) on
    ``device`` under a ``budget``-byte slice budget (:func:`slice_budget`; the whole
    working memory where nothing else is held): cache-sized on a CPU (2 MiB, the
    default of ``row_blocks``); on an accelerator ``budget / 16`` (a block's float64
    temporaries take four times its size; at an 8 GiB budget a 1024-position x
    128k-vocabulary head block is one row block), so a probe runs a few large kernels
    instead of hundreds of small ones. Never more than ``budget / 16`` (a small budget gets
    smaller row blocks, down to one row: the KL is the same to float64 rounding)."""
    cap = max(1, int(KL_TEMP_SHARE * budget))
    if _device_kind(torch.device(device)) == "cpu":
        return min(KL_SUB_BYTES, cap)
    return cap


def device_batch_size(device) -> int | str:
    """``batch_size=None`` on ``device``: :data:`CPU_BATCH_SIZE` on a CPU, ``"auto"`` on an
    accelerator."""
    return CPU_BATCH_SIZE if _device_kind(torch.device(device)) == "cpu" else "auto"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _prefix_reuse_mode(value) -> str:
    if value is True:
        return "shared"
    if value is False or value is None:
        return "none"
    if value in PREFIX_REUSE_MODES:
        return value
    raise ValueError(
        f"prefix_reuse={value!r}: allowed True/'shared' (share the longest common prefix), 'start' (reuse only "
        "the identity prefix), False/'none' (every probe runs the whole model)"
    )


def _compute_dtype(value) -> torch.dtype | None:
    """``dtype=`` as a torch dtype (``None``: the model's own)."""
    if value is None:
        return None
    dtype = value
    if isinstance(value, str):
        name = value.replace("torch.", "")
        dtype = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={value!r}: allowed None (the model's dtype), torch.bfloat16, torch.float16, torch.float32")
    return dtype


def _positive_int(name: str, value, *, allow=()) -> None:
    if value in allow and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = "".join(f" or {a!r}" for a in allow if a is not None)
        raise ValueError(f"{name}={value!r}: must be an int >= 1{extra}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how reports name a dtype."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings, checked when made; the scoring verbs build one from their
    keyword arguments and hand it to the engine.

    Attributes:
        batch_size: prompts per forward pass, ``"auto"`` (the largest, up to 64, whose
            estimated activations fit half of ``max_memory``) or ``None`` (by the device:
            :data:`CPU_BATCH_SIZE` on a CPU, ``"auto"`` on an accelerator).
        prefix_reuse: ``True``/``"shared"`` (default): start every probe at its first
            changed slot from the cached identity stream and share longer common prefixes
            between probes; ``"start"``: only the former; ``False``/``"none"``: every
            probe runs the whole model (for checks: the numbers are identical). Stored as
            the mode's name (:data:`PREFIX_REUSE_MODES`).
        stream_logits: ``True`` (default): stop at the decoder output and run the head
            and KL in blocks of real positions x vocabulary entries, with one KL
            arithmetic whatever the blocks (float64 online log-sum-exp,
            :class:`~hf_layerswap.scoring.kl.OnlineKL`; the report's ``kl_streaming``
            names the blocks); ``False``: take the model's own full ``(B, T, V)`` logits
            and :func:`~hf_layerswap.scoring.masked_kl` (fp32 log-softmax, more memory).
        kl_chunk: real positions per head/KL block. Default: ``min(1024, batch_size *
            seq_len)``; when that block of the whole vocabulary (12 bytes per position and
            entry: float64 reference weights and fp32 logits, ``KL_BLOCK_ENTRY_BYTES``)
            exceeds ``0.4 * max_memory``, the most positions that fit, if at least
            ``MIN_WHOLE_VOCAB_CHUNK`` (always, for a head that cannot be sliced).
        vocab_chunk: vocabulary entries per block (sliceable heads only). Default: the
            whole vocabulary, unless even ``MIN_WHOLE_VOCAB_CHUNK`` positions of it do
            not fit (or ``kl_chunk`` is given); then the vocabulary split into the fewest
            equal slices with ``12 * kl_chunk * vocab_chunk <= 0.4 * max_memory`` bytes
            (``HEAD_BUDGET_FRACTION``; the constants in :mod:`.engine`). The blocks set
            memory and the GEMMs' shapes, not the values (equal to float64 rounding).
        max_memory: working-memory budget in bytes (or ``"1.5GB"``) beyond the weights,
            stored in bytes; a :class:`MemoryBudget` (kept as it is, with its source); or ``None``/``"auto"`` (default, stored as ``"auto"``): derived
            from the free memory of the device the model's input embeddings run on
            (:func:`device_memory_budget`: a share of it, capped at 1 GiB on a CPU and
            8 GiB on an accelerator). The bytes used and how they were chosen are in the
            report's metadata (``max_memory``, ``max_memory_source``).
        dtype: ``None`` (the model's dtype) or ``torch.bfloat16``/``torch.float16`` (or
            their names) to run under ``torch.autocast``; the head is always fp32 and the
            KL float64 (fp32 log-softmax with ``stream_logits=False``).
            Stored as a torch dtype.
        checkpoint_path: folder for resumable runs (see
            :func:`~hf_layerswap.scoring.score_layers`).
        distributed: ``None``: partition the probes over the processes when launched
            with several (``accelerate launch``, ``torchrun``; one whole model replica
            per process, see :mod:`.processes`); ``False``: never; ``True``: require it.
        progress: show a progress bar (rank 0 only).
        desc: the progress bar's label.
        slot_major: ``None`` (default): advance every probe of a batch slot by slot when
            the model's decoder blocks are offloaded (accelerate CPU/disk offload), so each
            block is read once per batch (:mod:`.slotmajor`), else run probes depth-first
            with prefix reuse; ``True``/``False``: always/never stream (the values are the
            same either way).

    Raises:
        ValueError: a value outside what its field allows (the message names the value
            and what is allowed).
    """

    batch_size: int | str | None = None
    prefix_reuse: bool | str = True
    stream_logits: bool = True
    kl_chunk: int | None = None
    vocab_chunk: int | None = None
    max_memory: int | str | MemoryBudget | None = None
    dtype: torch.dtype | str | None = None
    checkpoint_path: str | os.PathLike | None = None
    distributed: bool | None = None
    progress: bool = False
    desc: str = "swap-KL"
    slot_major: bool | None = None

    def __post_init__(self):
        _positive_int("batch_size", self.batch_size, allow=("auto", None))
        for name in ("kl_chunk", "vocab_chunk"):
            _positive_int(name, getattr(self, name), allow=(None,))
        if self.distributed not in (None, True, False):
            raise ValueError(f"distributed={self.distributed!r}: allowed None (partition the probes when launched "
                             "with several processes), True (require it), False (never)")
        if self.slot_major not in (None, True, False):
            raise ValueError(f"slot_major={self.slot_major!r}: allowed None (stream slot by slot when the blocks are "
                             "offloaded), True (always), False (never)")
        if self.checkpoint_path is not None and not isinstance(self.checkpoint_path, (str, os.PathLike)):
            raise ValueError(f"checkpoint_path={self.checkpoint_path!r}: give a folder path (str or os.PathLike) or None")
        normal = {
            "prefix_reuse": _prefix_reuse_mode(self.prefix_reuse),
            "stream_logits": bool(self.stream_logits),
            "max_memory": ("auto" if self.max_memory in (None, "auto") else self.max_memory
                           if isinstance(self.max_memory, MemoryBudget) else parse_memory(self.max_memory)),
            "dtype": _compute_dtype(self.dtype),
            "progress": bool(self.progress),
            "desc": str(self.desc),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def memory_for(self, device) -> tuple[int, str]:
        """``(bytes, how they were chosen)`` of the working-memory budget on ``device`` (or
        the model, :func:`resolve_memory`): ``max_memory`` as given (a :class:`MemoryBudget`
        with its source), or what ``"auto"`` derives."""
        budget = resolve_memory(self.max_memory, device)
        return budget.bytes, budget.source

    def batch_size_for(self, device) -> int | str:
        """``batch_size`` as given, or :func:`device_batch_size` for ``None``."""
        return device_batch_size(device) if self.batch_size is None else self.batch_size

    def autocast_dtype(self, model_dtype: torch.dtype) -> torch.dtype | None:
        """The autocast dtype for a model whose parameters are ``model_dtype``, or None to
        run in the model's own dtype.

        Raises:
            ValueError: ``dtype=float32`` for a lower-precision model (autocast cannot
                raise precision).
        """
        if self.dtype is None or self.dtype == model_dtype:
            return None
        if self.dtype == torch.float32:
            raise ValueError(
                f"dtype=float32 asked for a {model_dtype} model: autocast cannot raise precision; load the model in float32"
            )
        return self.dtype
