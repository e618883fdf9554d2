"""Layer plans: the one mechanism behind every swap protocol.

A *plan* is the list of block indices the decoder runs, in order. For a model with L
decoder blocks (0-based):

- identity: ``[0, 1, ..., L-1]``
- replacement ``i <- j`` (slot i runs block j): ``plan[i] = j``
- interchange ``i <-> j`` (slots i and j exchange blocks): ``plan[i], plan[j] = plan[j], plan[i]``
- removal of a set S: the entries in S are deleted.

:func:`apply_plan` runs the model's own forward under a plan by temporarily replacing the
decoder's block list (no weight copies) and the per-layer config lists that the decoder
reads while it iterates (``layer_types``), so a block keeps its own attention type when it
moves. Everything is restored exactly on exit, also when the forward raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import numbers
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .utils.devices import OffloadedTensor

__all__ = [
    "BLOCK_LIST_NAMES",
    "PER_LAYER_LIST_FIELDS",
    "apply_plan",
    "capture_residual_stream",
    "decoder_blocks",
    "decoder_config",
    "identity_plan",
    "interchange_plan",
    "model_fingerprint",
    "num_blocks",
    "removal_plan",
    "replacement_plan",
    "resolve_layer_indices",
    "uncompiled",
    "StopForward",
    "BlockCall",
    "model_hidden_size",
    "run_block",
    "split_hidden",
]

#: Attribute names under which decoders keep their block ``nn.ModuleList``.
BLOCK_LIST_NAMES = ("layers", "h", "blocks")

#: Per-layer config lists that the decoder forward reads by slot position and that must
#: therefore move with their block under a plan (and be filtered by kept index on removal).
PER_LAYER_LIST_FIELDS = ("layer_types", "no_rope_layers")


def uncompiled(model: nn.Module) -> nn.Module:
    """The module to probe: for a ``torch.compile``'d model (``OptimizedModule``), the eager
    module it wraps (``model._orig_mod``, the same parameters), with a ``UserWarning`` that
    says so; any other model as it is.

    Every probe runs the model under another layer plan with its own hooks, and the compiled
    graph guards on both, so a compiled model recompiles at every probe until dynamo's
    recompile limit and then runs about 100 times slower than eager; scoring the original
    module gives the same numbers at eager speed and leaves the compiled wrapper as it was.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded wherever a model was compiled
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return model
    warnings.warn(
        "the model is torch.compile'd: hf_layerswap probes its original eager module (model._orig_mod, the same "
        "weights), since every probe changes the block plan and hooks and would recompile the graph each time",
        UserWarning,
        stacklevel=3,
    )
    return model._orig_mod


def decoder_blocks(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """Locate the decoder block list of a causal LM.

    Returns:
        ``(owner, name, blocks)`` such that ``getattr(owner, name) is blocks``.

    Raises:
        ValueError: the model has no ``nn.ModuleList`` of decoder blocks under any of
            :data:`BLOCK_LIST_NAMES` (e.g. an encoder-decoder or a non-transformers model).
    """
    candidates = []
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except Exception:  # exotic wrappers raise from get_decoder; fall back below
            pass
    candidates.append(model)
    for owner in candidates:
        for name in BLOCK_LIST_NAMES:
            blocks = getattr(owner, name, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
                return owner, name, blocks
    raise ValueError(
        f"{type(model).__name__} has no decoder block list: expected an nn.ModuleList named one of "
        f"{list(BLOCK_LIST_NAMES)} on model.get_decoder() (decoder-only causal LMs are supported)."
    )


def decoder_config(model: nn.Module):
    """The config object the decoder reads ``num_hidden_layers``/``layer_types`` from.

    For multimodal models this is the text sub-config.
    """
    owner, _, _ = decoder_blocks(model)
    cfg = getattr(owner, "config", None)
    if cfg is None:
        cfg = model.config.get_text_config(decoder=True)
    return cfg


#: Why a one-block model cannot lose a block (selection, removal and the config say the same).
ONE_BLOCK = "a model with one block has nothing removable (at least one block must stay)"


def num_blocks(model: nn.Module) -> int:
    """Number of decoder blocks L currently in the model."""
    return len(decoder_blocks(model)[2])


def identity_plan(num_blocks: int) -> list[int]:
    """``[0, 1, ..., num_blocks-1]``."""
    return list(range(num_blocks))


def _check_index(i: int, num_blocks: int, what: str) -> int:
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"{what} must be an int, got {i!r} ({type(i).__name__})")
    if not 0 <= i < num_blocks:
        raise ValueError(f"{what}={i} is out of range: allowed 0..{num_blocks - 1} for {num_blocks} blocks")
    return i


def replacement_plan(num_blocks: int, i: int, j: int) -> list[int]:
    """Plan for replacement ``i <- j``: slot i runs block j (block j then runs twice)."""
    _check_index(i, num_blocks, "slot i")
    _check_index(j, num_blocks, "block j")
    plan = identity_plan(num_blocks)
    plan[i] = j
    return plan


def interchange_plan(num_blocks: int, i: int, j: int) -> list[int]:
    """Plan for interchange ``i <-> j``: slots i and j exchange blocks."""
    _check_index(i, num_blocks, "slot i")
    _check_index(j, num_blocks, "slot j")
    plan = identity_plan(num_blocks)
    plan[i], plan[j] = plan[j], plan[i]
    return plan


def as_index(value) -> int | None:
    """``value`` as a Python int if it is an integer (``int`` or a NumPy integer), else
    ``None``. Booleans are not indices."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def resolve_layer_indices(layers: Sequence[int], num_blocks: int, *, allow_empty: bool = False) -> list[int]:
    """Validate a set of block indices and return it sorted, 0-based.

    Negative indices count from the end (``-1`` is the last block), as in Python.

    Raises:
        TypeError: a non-integer entry.
        ValueError: an index outside ``-L..L-1``, a duplicate (after resolving negatives),
            or an empty set when ``allow_empty`` is False.
    """
    if isinstance(layers, (numbers.Integral, str)) or layers is None:
        raise TypeError(f"layers must be a sequence of ints, got {layers!r}")
    layers = list(layers)  # a generator is read once; messages show what was given
    resolved = []
    for raw in layers:
        if as_index(raw) is None:
            raise TypeError(f"layer index {raw!r} is not an int; layer indices are 0-based ints")
        raw = as_index(raw)
        if not -num_blocks <= raw < num_blocks:
            raise ValueError(
                f"layer index {raw} is out of range for a model with {num_blocks} blocks: "
                f"allowed 0..{num_blocks - 1} (or -{num_blocks}..-1 from the end)"
            )
        resolved.append(raw % num_blocks)
    dupes = sorted({i for i in resolved if resolved.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate layer indices {dupes} in {list(layers)} (after resolving negative indices)")
    if not resolved and not allow_empty:
        raise ValueError("no layer indices given: pass at least one 0-based block index")
    return sorted(resolved)


def removal_plan(num_blocks: int, removed: Sequence[int]) -> list[int]:
    """Plan that skips the blocks in ``removed``.

    Raises:
        ValueError: bad indices (see :func:`resolve_layer_indices`) or no block left.
    """
    drop = set(resolve_layer_indices(removed, num_blocks, allow_empty=True))
    plan = [i for i in range(num_blocks) if i not in drop]
    if not plan:
        raise ValueError(f"removing {sorted(drop)} leaves no block: at most {num_blocks - 1} of {num_blocks} can go")
    return plan


def first_difference(plan: Sequence[int], num_blocks: int) -> int:
    """The first slot at which ``plan`` differs from identity (``len(plan)`` if none)."""
    for s, p in enumerate(plan):
        if s >= num_blocks or p != s:
            return s
    return len(plan)


def _one_shot_input_hook(hidden: torch.Tensor):
    """A forward pre-hook that replaces the block's hidden-state input once, then disarms."""
    state = {"armed": True}

    def hook(module, args, kwargs):
        if not state["armed"]:
            return None
        state["armed"] = False
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = hidden
        return args, kwargs

    return hook


@contextlib.contextmanager
def apply_plan(
    model: nn.Module,
    plan: Sequence[int],
    *,
    start: int = 0,
    start_hidden: torch.Tensor | None = None,
) -> Iterator[None]:
    """Temporarily make the decoder run ``plan`` (block indices, in order).

    Args:
        model: a transformers causal LM (or any module :func:`decoder_blocks` accepts).
        plan: block indices to run, each in ``0..L-1``; repeats allowed (replacement).
        start: run only ``plan[start:]``. With ``start > 0``, ``start_hidden`` must be the
            residual stream entering slot ``start`` (shape ``(B, T, H)``), which is injected
            in place of the embeddings' output: the computation before ``start`` is reused
            rather than re-run (prefix reuse).
        start_hidden: see ``start``.

    The decoder's ``nn.ModuleList``, ``num_hidden_layers`` and the per-layer config lists
    (:data:`PER_LAYER_LIST_FIELDS`) are restored exactly on exit, also on error. Probes
    must run with ``use_cache=False`` (a repeated block shares its ``layer_idx``).

    Raises:
        ValueError: an index out of range, an empty plan, or ``start`` without
            ``start_hidden``.
    """
    owner, name, blocks = decoder_blocks(model)
    num_blocks = len(blocks)
    plan = list(plan)
    if not plan:
        raise ValueError("a plan must run at least one block; got []")
    for p in plan:
        _check_index(p, num_blocks, "plan entry")
    if not 0 <= start < len(plan):
        raise ValueError(f"start={start} must be in 0..{len(plan) - 1} for a plan of length {len(plan)}")
    if start > 0 and start_hidden is None:
        raise ValueError("start > 0 needs start_hidden (the residual stream entering that slot)")
    cfg = decoder_config(model)
    run = plan[start:]
    saved_fields = {}
    for field in PER_LAYER_LIST_FIELDS:
        value = getattr(cfg, field, None)
        if isinstance(value, (list, tuple)) and len(value) == num_blocks:
            saved_fields[field] = value
    saved_count = cfg.num_hidden_layers
    handle = None
    try:
        setattr(owner, name, nn.ModuleList([blocks[p] for p in run]))
        for field, value in saved_fields.items():
            setattr(cfg, field, type(value)(value[p] for p in run))
        cfg.num_hidden_layers = len(run)
        if start_hidden is not None:
            handle = blocks[run[0]].register_forward_pre_hook(_one_shot_input_hook(start_hidden), with_kwargs=True)
        yield
    finally:
        if handle is not None:
            handle.remove()
        setattr(owner, name, blocks)
        for field, value in saved_fields.items():
            setattr(cfg, field, value)
        cfg.num_hidden_layers = saved_count


def model_fingerprint(model: nn.Module) -> str:
    """A cheap identity of a model's current weights and shape (sha256 hex).

    Hashes the decoder config's ``model_type``, hidden size, vocabulary size and block
    count, and the first 16 values of every parameter tensor. Two different checkpoints
    of the same architecture and depth get different fingerprints; the same weights get
    the same one on any device or dtype-preserving reload, also offloaded by accelerate (a
    parameter on "meta" between calls is read from the offload's storage, its first rows
    only: :meth:`~hf_layerswap.utils.devices.OffloadedTensor.named`). A parameter on
    "meta" that no offload holds (a model built on the meta device) is left out. Removing
    blocks changes it.
    """
    cfg = decoder_config(model)
    h = hashlib.sha256()
    shape = (getattr(cfg, "model_type", None), getattr(cfg, "hidden_size", None), getattr(cfg, "vocab_size", None))
    h.update(repr((shape, num_blocks(model))).encode())
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            stored = OffloadedTensor.named(model, name)
            if stored is None:
                continue
            values = stored.first(16)
        else:
            values = param.detach().reshape(-1)[:16]
        head = values.to("cpu", torch.float64)
        h.update(name.encode())
        h.update(repr(tuple(param.shape)).encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()


class StopForward(Exception):
    """Raised by a hook to end a forward pass once the wanted residual streams are captured."""
    pass


def _block_hidden_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _block_hidden_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@torch.no_grad()
def capture_residual_stream(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    slots: Sequence[int] | None = None,
    compute_logits: bool = False,
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """Run the identity plan and capture the raw residual stream (before any norm).

    Args:
        input_ids, attention_mask: ``(B, T)`` long tensors.
        slots: which streams to return, each in ``0..L``: slot ``s < L`` is the stream
            entering block s, slot ``L`` the stream leaving the last block (before the final
            norm). ``None`` means all ``0..L``.
        compute_logits: if False, the forward stops right after the last needed block.

    Returns:
        ``(streams, logits)``: ``streams[s]`` has shape ``(B, T, H)``; ``logits`` is
        ``(B, T, V)`` or ``None``.
    """
    _, _, blocks = decoder_blocks(model)
    num_blocks = len(blocks)
    wanted = sorted(set(range(num_blocks + 1) if slots is None else slots))
    for s in wanted:
        _check_index(s, num_blocks + 1, "slot")
    last_needed = max(wanted)
    streams: dict[int, torch.Tensor] = {}
    handles = []

    def pre_hook(slot):
        def hook(module, args, kwargs):
            if slot in wanted:
                streams[slot] = _block_hidden_input(args, kwargs).detach()
            if not compute_logits and slot == last_needed:
                raise StopForward

        return hook

    def post_hook(module, args, kwargs, output):
        streams[num_blocks] = _block_hidden_output(output).detach()
        if not compute_logits:
            raise StopForward

    for s, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre_hook(s), with_kwargs=True))
    if num_blocks in wanted:
        handles.append(blocks[-1].register_forward_hook(post_hook, with_kwargs=True))
    logits = None
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = out.logits
    except StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return streams, logits


@dataclass
class BlockCall:
    """Arguments of one block call, without ``hidden_states``."""

    args: tuple
    kwargs: dict


def split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, BlockCall]:
    """A block call's ``(args, kwargs)`` split into its hidden state ``(B, T, H)`` (the
    first positional argument, or ``hidden_states=``) and the rest as a :class:`BlockCall`."""
    if args:
        return args[0], BlockCall(tuple(args[1:]), dict(kwargs))
    rest = dict(kwargs)
    return rest.pop("hidden_states"), BlockCall((), rest)


def run_block(block: nn.Module, hidden: torch.Tensor, call: BlockCall) -> torch.Tensor:
    """Run one decoder block on ``hidden`` ``(B, T, H)`` with recorded arguments; returns
    the stream leaving it ``(B, T, H)``."""
    out = block(hidden, *call.args, **call.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def model_hidden_size(model) -> int:
    """The model's hidden size H (width of the input embedding)."""
    emb = model.get_input_embeddings()
    return int(emb.weight.shape[1])
