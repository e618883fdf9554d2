"""Slot-major streaming: every probe of a calibration batch advanced slot by slot, for
models whose decoder blocks are offloaded (accelerate CPU or disk offload).

A depth-first engine runs probe after probe; with offloaded blocks every block call reads
that block's weights again, about ``1.5 L^2`` block loads per batch for the swap probes of
an L-block model. Here the engine holds each probe's hidden state instead of each block:

1. **Block inputs.** One call of the model's own forward with the decoder's blocks
   replaced by recorders (:func:`capture_block_inputs`) gives the stream entering slot 0
   (embeddings, scaling) and the arguments each block gets besides its hidden state
   (attention mask by layer type, rotary position embeddings, position ids). A block
   takes its arguments with it when it moves, as :func:`~hf_layerswap.layerplan.apply_plan`
   moves ``layer_types``: block b gets under every plan the call it gets at slot b.
2. **One pass per probe group** (:func:`plan_pass`, :func:`run_pass`). The states are the
   nodes of the probes' prefix tree: at slot s each distinct plan prefix ``plan[:s]``
   (the identity's among them; probes sharing a prefix share its state, as prefix reuse
   shares it) is run through block ``plan[s]``. The blocks some plan puts at slot s are
   brought to the execution device (:func:`hf_layerswap.utils.devices.onloaded`, accelerate's
   own hook machinery) at the first slot that needs them and released after the last, so
   every block moves once per pass; for swap probes with ``max_gap = g`` at most ``2g + 1``
   blocks are resident at once. A finished plan's state goes through the decoder's final
   norm (:func:`final_norm`) and on to the engine's head/KL phase.
3. **Groups under the budget** (:func:`probe_groups`). A pass holds the states of its
   live prefixes (a finished plan's state is dropped as soon as its final rows are taken,
   unless a longer plan continues from it) and the final rows of its finished plans,
   counted as one ``(B, T, H)`` state each (:attr:`PassPlan.peak_states`, the exact count
   of what :func:`run_pass` holds). The probes, in (start slot, run) order, are cut into
   consecutive groups, each the longest run of probes whose pass holds at most
   ``floor(STATE_BUDGET_FRACTION * max_memory / (B T H e))`` states (``e`` bytes per
   element of the compute dtype; at least one probe a group). Each group streams the
   blocks its pass runs once, so the fewest groups the budget allows give the fewest
   block loads; with one group (the common case) every block moves once per batch.
4. **The kept reference** (:class:`~hf_layerswap.scoring.reference.ReferenceCache`, the
   search's evaluator calls). A pass that streams the reference also captures the streams
   entering every slot when the cache can keep them; later groups of the batch, and every
   later call on the same prompts, start each probe from the cached stream entering its
   start slot (``cached=True``): no identity trunk runs again, and only the blocks at or
   after each plan's start slot move.

Without a kept reference, the reference is the identity plan streamed in the first pass
(later passes run the identity only up to their last start slot). The values equal the depth-first engine's
(same block calls on the same inputs, same head/KL code). In-memory models keep the
depth-first prefix-reuse path by default: it holds only the states of one root-to-leaf
path of the prefix tree (at most ``L + 1`` of them) where this path holds one per probe
(about ``2 g L``), and it moves nothing, so streaming gains nothing there;
``slot_major=True`` forces this path on any model (for checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..utils.devices import offloaded_bytes, offloaded_modules, onloaded
from ..layerplan import BlockCall, decoder_blocks, first_difference, run_block, split_hidden
from .head import decoder_output, hooks_removed
from .probes import Probe

__all__ = [
    "FINAL_NORM_NAMES", "STATE_BUDGET_FRACTION", "BlockInputs", "PassPlan", "blocks_offloaded",
    "capture_block_inputs", "final_norm", "movable_blocks", "plan_pass", "probe_groups", "run_pass", "state_bytes",
    "state_capacity",
]

#: Share of ``max_memory`` the hidden states held by one slot-major pass may take.
STATE_BUDGET_FRACTION = 0.25

#: Attribute names of the decoder's final norm (applied after the last block).
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


def blocks_offloaded(model: nn.Module) -> bool:
    """Whether any decoder block of ``model`` is offloaded (an accelerate hook with offload
    on: a "cpu"/"disk" entry of a device map, weights on "meta" between calls)."""
    _, _, blocks = decoder_blocks(model)
    return any(offloaded_modules(b) for b in blocks)


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's final norm (one of :data:`FINAL_NORM_NAMES` on the block list's
    owner), or None when it has none under those names (then slot-major streaming is not
    used). The engine checks on the first batch that it and the head reproduce the
    model's own logits."""
    owner, _, _ = decoder_blocks(model)
    for name in FINAL_NORM_NAMES:
        m = getattr(owner, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


class _StopCapture(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for block ``slot`` during :func:`capture_block_inputs`: records the call
    and passes the hidden state through unchanged."""

    def __init__(self, slot: int, store: dict, stop: bool):
        super().__init__()
        self.slot, self.store, self.stop = slot, store, stop

    def forward(self, *args, **kwargs):
        hidden, call = split_hidden(args, kwargs)
        self.store[self.slot] = (hidden.detach(), call)
        if self.stop:
            raise _StopCapture
        return hidden


@dataclass
class BlockInputs:
    """What :func:`capture_block_inputs` records for one batch.

    Attributes:
        hidden: the stream entering slot 0, ``(B, T, H)``.
        calls: per block index, its :class:`~hf_layerswap.layerplan.BlockCall`.
        decoder_output: the decoder's output on ``hidden`` as the last block's output
            ``(B, T, H)`` (``verify`` only; else None).
        logits: the model's logits at the last position of that output ``(B, 1, V)``
            (``verify`` only; else None).
    """

    hidden: torch.Tensor
    calls: list[BlockCall]
    decoder_output: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@contextlib.contextmanager
def _blocks_replaced(model: nn.Module, modules: list[nn.Module]) -> Iterator[None]:
    owner, name, blocks = decoder_blocks(model)
    setattr(owner, name, nn.ModuleList(modules))
    try:
        yield
    finally:
        setattr(owner, name, blocks)


def capture_block_inputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, *,
                         verify: bool = False) -> BlockInputs:
    """One forward of ``model`` on ``(B, T)`` ``ids``/``mask`` with its decoder blocks
    replaced by recorders (no block runs, none is onloaded): the stream entering slot 0
    and every block's call arguments under the identity plan.

    With ``verify`` the forward goes on past the recorders (which pass the stream through),
    so the decoder's final norm and the model's head run on the embeddings
    (``logits_to_keep=1``): :attr:`BlockInputs.decoder_output` and ``.logits`` let the
    engine check that :func:`final_norm` and its head reproduce the model's own output.
    """
    owner, _, blocks = decoder_blocks(model)
    store: dict = {}
    last = len(blocks) - 1
    recorders = [_Recorder(s, store, stop=not verify and s == last) for s in range(len(blocks))]
    final: dict = {}
    handles = []
    if verify:
        handles.append(owner.register_forward_hook(
            lambda m, a, out: final.__setitem__("hidden", decoder_output(out).detach())))
    kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    logits = None
    with _blocks_replaced(model, recorders), hooks_removed(handles):
        try:
            if verify:
                try:
                    logits = model(**kwargs, logits_to_keep=1).logits
                except TypeError:
                    logits = model(**kwargs).logits[:, -1:]
            else:
                model(**kwargs)
        except _StopCapture:
            pass
    return BlockInputs(store[0][0], [store[s][1] for s in range(len(blocks))], final.get("hidden"), logits)


def state_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one state of ``shape`` (``(B, T, H)``) in ``dtype``."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * (torch.finfo(dtype).bits // 8)


def state_capacity(state_shape: Sequence[int], dtype: torch.dtype, budget: int) -> int:
    """States of ``state_shape`` a slot-major pass may hold under ``budget`` bytes:
    ``floor(STATE_BUDGET_FRACTION * budget / state_bytes)``, at least 1."""
    return max(1, int(STATE_BUDGET_FRACTION * budget) // state_bytes(state_shape, dtype))


def probe_groups(probes: Sequence[Probe], state_shape: Sequence[int], dtype: torch.dtype, budget: int,
                 total_blocks: int, *, reference: bool = True, cached: bool = False) -> list[list[Probe]]:
    """The probes in (start slot, run) order cut into consecutive groups, each the longest
    run of probes whose pass (:func:`plan_pass`) holds at most :func:`state_capacity`
    states (:attr:`PassPlan.peak_states`; at least one probe a group): the fewest groups,
    so the fewest block loads, that fit :data:`STATE_BUDGET_FRACTION` of ``budget`` bytes.

    Args:
        probes: the batch's probes; state_shape: ``(B, T, H)``; dtype: the compute dtype.
        budget: the engine's memory budget in bytes; total_blocks: L.
        reference: the first group's pass streams the reference (the identity) too.
        cached: the streams entering every slot are kept (a
            :class:`~hf_layerswap.scoring.reference.ReferenceCache` entry): every group
            after a reference pass (every group, without one) starts its probes from them.
    """
    order = sorted(probes, key=lambda p: (p.start, p.run))
    capacity = state_capacity(state_shape, dtype, budget)
    groups: list[list[Probe]] = []
    i = 0
    while i < len(order):
        first = not groups and reference

        def peak(m: int) -> int:
            return plan_pass([p.key for p in order[i:i + m]], total_blocks, reference=first,
                             cached=cached and not first).peak_states

        lo, hi = 1, len(order) - i  # the longest run that fits: peak_states grows with the group
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if peak(mid) <= capacity else (lo, mid - 1)
        groups.append(order[i:i + lo])
        i += lo
    return groups


@dataclass
class PassPlan:
    """One slot-major pass over a group of plans.

    Attributes:
        steps: per slot s, ``(parent prefix, child prefix, block)`` for every distinct
            prefix of length ``s + 1`` computed there (the parent is ``child[:-1]``).
        finals: plan (tuple) -> the prefix whose state is its decoder output (itself).
        first, last: block -> first and last slot it runs at in this pass (it is
            resident between them).
        offloaded: the blocks that are offloaded (the ones a pass moves).
        starts: identity prefixes the pass takes from kept streams (``cached=True``):
            prefix -> the slot whose entering stream it is (its length); empty otherwise.
        identity: the identity plan ``(0, ..., L - 1)``.
    """

    steps: list[list[tuple[tuple, tuple, int]]]
    finals: dict[tuple, tuple]
    first: dict[int, int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    offloaded: frozenset = frozenset()
    starts: dict[tuple, int] = field(default_factory=dict)
    identity: tuple = ()

    @property
    def block_evaluations(self) -> int:
        """Block calls of the pass (one per distinct prefix)."""
        return sum(len(s) for s in self.steps)

    @property
    def onloads(self) -> int:
        """Offloaded blocks the pass brings to the execution device: each once."""
        return sum(1 for b in self.first if b in self.offloaded)

    @property
    def reference(self) -> bool:
        """Whether the pass streams the reference (the identity plan to its end)."""
        return self.identity in self.finals

    @property
    def leaves(self) -> frozenset:
        """Finished plans no longer plan continues from: their state is dropped once
        their final rows are taken."""
        parents = {parent for here in self.steps for parent, _, _ in here}
        return frozenset(k for k in self.finals if k not in parents)

    @property
    def onload_order(self) -> list[int]:
        """The offloaded blocks in the order the pass brings them over (first slot, then
        block index): what a prefetch reads ahead."""
        return sorted((b for b in self.first if b in self.offloaded), key=lambda b: (self.first[b], b))

    @property
    def peak_states(self) -> int:
        """Most ``(B, T, H)`` tensors :func:`run_pass` holds at once: the states it
        computed and still needs, plus the final rows taken from finished plans (one state
        each, their upper bound). The stream entering slot 0 and kept streams are not
        counted: they are the block inputs' and the cache's."""
        leaves = self.leaves
        live = finals = peak = 0
        for s, here in enumerate(self.steps):
            children: dict[tuple, list[tuple]] = {}
            for parent, child, _ in here:
                children.setdefault(parent, []).append(child)
            for parent, kids in children.items():
                for child in kids:
                    live += 1
                    finals += child in self.finals
                    peak = max(peak, live + finals)
                    live -= child in leaves
                if len(parent) == s and parent and parent not in self.starts:
                    live -= 1
        return peak


def plan_pass(keys: Sequence[tuple[int, ...]], total_blocks: int, *, reference: bool,
              offloaded: frozenset = frozenset(), cached: bool = False) -> PassPlan:
    """The pass that runs the plans ``keys`` (tuples of block indices) slot by slot, every
    distinct prefix once (the identity's prefixes up to the slot each plan starts at among
    them); with ``reference`` the identity plan too, to its end (its final state is then
    in ``finals``). With ``cached`` each plan starts from the kept stream entering its
    start slot (:attr:`PassPlan.starts`; the first slot where it differs from the
    identity, at most its last): the identity prefixes before it are not run.

    ``offloaded`` names the blocks that move (for :attr:`PassPlan.onloads`).

    Raises:
        ValueError: ``reference`` and ``cached`` together (the reference is what the kept
            streams come from).
    """
    if reference and cached:
        raise ValueError("plan_pass: reference=True streams the reference; cached=True takes it as kept")
    identity = tuple(range(total_blocks))
    plans = list(dict.fromkeys(keys))
    if reference:
        plans.append(identity)
    seen: set[tuple] = set()
    starts: dict[tuple, int] = {}
    begin = {k: 0 for k in plans}
    if cached:
        for k in plans:
            begin[k] = min(first_difference(k, total_blocks), len(k) - 1)
            seen.update(k[:j] for j in range(begin[k] + 1))
            if begin[k] > 0:
                starts[k[: begin[k]]] = begin[k]
    depth = max((len(k) for k in plans), default=0)
    steps: list[list[tuple[tuple, tuple, int]]] = []
    for s in range(depth):  # a plan's prefixes before its start slot are the identity's: shared
        here = []
        for k in plans:
            child = k[: s + 1]
            if begin[k] <= s < len(k) and child not in seen:
                seen.add(child)
                here.append((k[:s], child, k[s]))
        here.sort()
        steps.append(here)
    out = PassPlan(steps, {k: k for k in plans}, offloaded=frozenset(offloaded), starts=starts, identity=identity)
    for s, here in enumerate(steps):
        for _, _, b in here:
            out.first.setdefault(b, s)
            out.last[b] = s
    return out


def run_pass(plan: PassPlan, blocks: nn.ModuleList, inputs: BlockInputs, finish: Callable[[tuple, torch.Tensor], None],
             moved: Callable[[int, int], None], *, streams: Mapping[int, torch.Tensor] | None = None,
             capture: Callable[[int, torch.Tensor], None] | None = None,
             loader: Callable[[int], contextlib.AbstractContextManager[int]] | None = None) -> None:
    """Run a :class:`PassPlan`: at each slot onload the blocks first needed there
    (``loader(block)``, default :func:`hf_layerswap.utils.devices.onloaded`), run every distinct
    prefix's state through its block, release the blocks last needed there. ``finish(plan,
    state)`` gets each plan's final state ``(B, T, H)`` (before the final norm) as soon as
    it is complete; ``moved(block, bytes)`` is told each onload of an offloaded block. Each
    parent state is dropped as soon as its children are computed, a finished plan's as
    soon as ``finish`` took it (unless a longer plan continues from it).

    ``streams``: slot -> the kept stream entering it ``(B, T, H)``, for the plan's
    :attr:`~PassPlan.starts`. ``capture(slot, state)`` is given every identity stream
    entering slots ``1..L-1`` the pass computes (what a kept reference holds)."""
    if loader is None:
        def loader(b):
            return onloaded(blocks[b])
    resident: dict[int, contextlib.ExitStack] = {}
    states: dict[tuple, torch.Tensor] = {(): inputs.hidden}
    states.update({prefix: streams[slot] for prefix, slot in plan.starts.items()})
    leaves = plan.leaves
    try:
        for s, here in enumerate(plan.steps):
            for _, _, b in here:
                if plan.first[b] == s and b not in resident:
                    resident[b] = contextlib.ExitStack()
                    nbytes = resident[b].enter_context(loader(b))
                    if b in plan.offloaded:
                        moved(b, nbytes)
            children: dict[tuple, list[tuple[tuple, int]]] = {}
            for parent, child, b in here:
                children.setdefault(parent, []).append((child, b))
            for parent, kids in children.items():
                for child, b in kids:
                    states[child] = run_block(blocks[b], states[parent], inputs.calls[b])
                    if capture is not None and len(child) < len(plan.identity) and child == plan.identity[: len(child)]:
                        capture(len(child), states[child])
                    if child in plan.finals:
                        finish(child, states[child])
                        if child in leaves:
                            del states[child]
                if len(parent) == s:  # every state of length s is a parent only here
                    states.pop(parent, None)
            for b in [b for b in resident if plan.last[b] == s]:
                resident.pop(b).close()
            states = {k: v for k, v in states.items() if len(k) > s}  # kept streams wait for their slot
    finally:
        for stack in resident.values():
            stack.close()


def movable_blocks(blocks: nn.ModuleList) -> frozenset:
    """Indices of the offloaded blocks of ``blocks`` (the ones a pass moves)."""
    return frozenset(b for b, blk in enumerate(blocks) if offloaded_bytes(blk) > 0)
