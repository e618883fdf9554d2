"""Probes: the deduplicated non-identity plans of a scoring run, their execution order
with shared prefixes and the deterministic, cost-balanced share of each rank."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import torch
from torch import nn

from ..layerplan import first_difference

__all__ = ["make_probes", "Probe", "position_hooks", "schedule", "schedule_blocks", "shard", "walk_schedule"]


# ----------------------------------------------------------------------------- probes
@dataclass
class Probe:
    """One deduplicated probe: its plan (``key``), the slot it starts at and the blocks it runs from there."""
    key: tuple[int, ...]  # the plan
    start: int  # slot the run starts at (its stream is the identity's)
    run: tuple[int, ...]  # blocks run from ``start`` on

    @property
    def cost(self) -> int:
        return len(self.run)


def make_probes(plans: Mapping[Any, Sequence[int]], total_blocks: int):
    """Deduplicate plans: returns (name -> key, {key: Probe} for non-identity plans, identity keys)."""
    key_of: dict = {}
    probes: dict = {}
    zero: set = set()
    for name, plan in plans.items():
        key = tuple(int(p) for p in plan)
        if not key:
            raise ValueError(f"plan {name!r} is empty: a plan must run at least one block")
        for p in key:
            if not 0 <= p < total_blocks:
                raise ValueError(f"plan {name!r} has block {p}: allowed 0..{total_blocks - 1}")
        key_of[name] = key
        start = first_difference(key, total_blocks)
        if start >= len(key) and len(key) == total_blocks:
            zero.add(key)
            continue
        start = min(start, len(key) - 1)  # trailing blocks dropped: re-run the last kept one
        probes.setdefault(key, Probe(key, start, key[start:]))
    return key_of, probes, zero


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def schedule(probes: list[Probe], mode: str) -> list[tuple[Probe, int, list[int]]]:
    """Execution order with prefix sharing.

    Probes are sorted by (start slot, run); in this order the probes sharing a prefix of
    their runs are contiguous, so each node of the prefix tree is needed only by a run of
    consecutive probes. Returns ``(probe, depth0, capture_depths)``: the probe starts
    ``depth0`` blocks into its run, from the stream cached at that tree node (0: the
    identity stream entering its start slot), and captures the streams entering run
    positions ``capture_depths`` for the probes after it.
    """
    if mode == "none":
        return [(p, 0, []) for p in probes]
    order = sorted(probes, key=lambda p: (p.start, p.run))
    if mode == "start":
        return [(p, 0, []) for p in order]
    out = []
    available: set[tuple[int, tuple[int, ...]]] = set()
    for n, p in enumerate(order):
        prev = order[n - 1] if n > 0 and order[n - 1].start == p.start else None
        shared = min(_lcp(prev.run, p.run), len(p.run) - 1) if prev is not None else 0
        depth0 = max((d for d in range(1, shared + 1) if (p.start, p.run[:d]) in available), default=0)
        later = [q.run for q in order[n + 1 :] if q.start == p.start]
        depths = sorted({d for d in (_lcp(p.run, r) for r in later) if depth0 < d < len(p.run)})
        available.update((p.start, p.run[:d]) for d in depths)
        out.append((p, depth0, depths))
    return out


def schedule_blocks(probes: list[Probe], mode: str) -> int:
    """Block forward calls of one batch's probes run in :func:`schedule` order (a probe
    runs ``len(key) - start - depth0`` blocks; ``mode="none"`` runs every plan whole)."""
    return sum(len(p.key) - (0 if mode == "none" else p.start + d0) for p, d0, _ in schedule(probes, mode))


def position_hooks(blocks: nn.ModuleList, run: Sequence[int], depth0: int,
                   wanted: Collection[int]) -> tuple[dict[int, torch.Tensor], list]:
    """Forward pre-hooks on the blocks of ``run[depth0:]`` that capture the residual stream
    entering each run position in ``wanted`` (``(B, T, H)``) while the probe runs from
    position ``depth0``. Returns ``(captured, handles)``: ``captured`` fills during the
    forward; remove the handles after it."""
    captured: dict[int, torch.Tensor] = {}
    handles: list = []
    if not wanted:
        return captured, handles
    counter = {"pos": depth0}
    wanted = set(wanted)

    def hook(module, args, kwargs):
        pos = counter["pos"]
        if pos in wanted:
            captured[pos] = (args[0] if args else kwargs["hidden_states"]).detach()
        counter["pos"] = pos + 1

    for b in dict.fromkeys(run[depth0:]):
        handles.append(blocks[b].register_forward_pre_hook(hook, with_kwargs=True))
    return captured, handles


def walk_schedule(order: list[tuple[Probe, int, list[int]]], start_stream: Callable[[int], torch.Tensor | None],
                  run: Callable[[Probe, int, torch.Tensor | None, list[int]], tuple[Any, dict[int, torch.Tensor]]],
                  ) -> Iterator[tuple[Probe, Any]]:
    """Run a :func:`schedule` order with its prefix tree: each probe starts from the tree
    node it shares with the probes before it (else from ``start_stream(probe.start)``, the
    identity's stream entering that slot, ``None`` at slot 0). ``run(probe, depth0,
    start_hidden, captures)`` returns ``(output, {depth: stream})``; only the nodes a later
    probe can start from are held. Yields ``(probe, output)`` in order."""
    nodes: dict[tuple, torch.Tensor] = {}
    for n, (probe, depth0, captures) in enumerate(order):
        start_hidden = nodes[(probe.start, probe.run[:depth0])] if depth0 > 0 else start_stream(probe.start)
        out, captured = run(probe, depth0, start_hidden, captures)
        for d, stream in captured.items():
            nodes[(probe.start, probe.run[:d])] = stream
        # keep only the tree nodes the next probe can start from (sorted order: no later one needs others)
        nxt = order[n + 1][0] if n + 1 < len(order) else None
        nodes = {k: v for k, v in nodes.items()
                 if nxt is not None and k[0] == nxt.start and nxt.run[: len(k[1])] == k[1]}
        yield probe, out


def shard(probes: list[Probe], world: int, rank: int) -> list[Probe]:
    """Deterministic, cost-balanced share of the probes for one rank. Probes with the same
    start slot and first block stay together (they share computation)."""
    if world <= 1:
        return probes
    units: dict[tuple, list[Probe]] = {}
    for p in sorted(probes, key=lambda p: (p.start, p.run)):
        units.setdefault((p.start, p.run[0]), []).append(p)
    load = [0] * world
    mine = []
    for _, members in sorted(units.items(), key=lambda kv: (-sum(p.cost + 8 for p in kv[1]), kv[0])):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += sum(p.cost + 8 for p in members)
        if r == rank:
            mine.extend(members)
    return mine
