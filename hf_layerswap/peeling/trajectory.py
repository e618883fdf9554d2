"""Peeling over training: :class:`PeelTrajectory` repeats the probes and both swap-KL
protocols over a list of checkpoints (:func:`peel_trajectory`)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..utils.jsonio import JsonResult, decode_tree, encode_tree
from ..scoring.report import SwapReport
from ..scoring import score_layers
from .references import peel
from .report import PeelReport

#: Format tag of a saved trajectory (checked on load).
_TRAJECTORY_FORMAT = "hf_layerswap.PeelTrajectory/1"


# ----------------------------------------------------------------------------- trajectory


@dataclass
class TrajectoryPoint:
    """One checkpoint of a :class:`PeelTrajectory`.

    Attributes:
        checkpoint: directory or ``name@revision`` it was loaded from.
        step: training step (from ``trainer_state.json``'s ``global_step`` or a trailing
            integer in the directory name), None if unknown.
        peel: its :class:`PeelReport`.
        swap: its :class:`~hf_layerswap.scoring.report.SwapReport` (both protocols), or None.
    """

    checkpoint: str
    step: int | None
    peel: PeelReport
    swap: SwapReport | None = None

    def to_dict(self, *, timings: bool = True) -> dict:
        swap = None
        if self.swap is not None:
            swap = self.swap.to_dict(timings=timings)
        return {"checkpoint": self.checkpoint, "step": self.step, "peel": self.peel.to_dict(timings=timings), "swap": swap}

    @classmethod
    def from_dict(cls, d: dict) -> TrajectoryPoint:
        swap = SwapReport.from_dict(d["swap"]) if d.get("swap") else None
        return cls(d["checkpoint"], d.get("step"), PeelReport.from_dict(d["peel"]), swap)


@dataclass
class PeelTrajectory(JsonResult):
    """Peeling gaps and swap-KL summaries over training checkpoints, in the given order."""

    points: list[TrajectoryPoint]
    metadata: dict = field(default_factory=dict)

    @property
    def steps(self) -> list[int | None]:
        return [p.step for p in self.points]

    def gap_matrix(self, span: int = 1, reference: str = "linear") -> list[list[float | None]]:
        """``[checkpoint][site]`` ΔCE of the probe (site, span); ``span=0`` = the map onto h_L."""
        if span == 0:
            return [p.peel.later_gaps(reference) for p in self.points]
        return [p.peel.layer_gaps(span, reference) for p in self.points]

    def layer_score_series(self, protocol: str) -> list[list[float]]:
        """``[checkpoint][layer]`` swap-KL layer score s(i) of ``protocol`` (nats)."""
        return [p.swap.layer_scores(protocol) if p.swap is not None else [] for p in self.points]

    def protocol_gap_series(self) -> dict[str, list[float | None]]:
        """``"i-j"`` -> I/R = d_inter / d_repl per checkpoint (None where undefined)."""
        out: dict[str, list[float | None]] = {}
        for n, p in enumerate(self.points):
            if p.swap is None or not {"replacement", "interchange"} <= set(p.swap.protocols):
                continue
            for r in p.swap.pairs:
                out.setdefault(f"{r.i}-{r.j}", [None] * len(self.points))[n] = r.ratio
        return out

    def to_dict(self, *, timings: bool = True) -> dict:
        return {
            "format": _TRAJECTORY_FORMAT,
            "points": [p.to_dict(timings=timings) for p in self.points],
            "metadata": encode_tree({k: v for k, v in self.metadata.items() if timings or k != "timings"}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> PeelTrajectory:
        if d.get("format") != _TRAJECTORY_FORMAT:
            raise ValueError(f"not a PeelTrajectory dict (format={d.get('format')!r}, expected {_TRAJECTORY_FORMAT!r})")
        return cls([TrajectoryPoint.from_dict(p) for p in d["points"]], decode_tree(d.get("metadata", {})))


def _checkpoint_step(path: Path) -> int | None:
    state = path / "trainer_state.json"
    if state.is_file():
        try:
            return int(json.loads(state.read_text(encoding="utf-8"))["global_step"])
        except (KeyError, ValueError, TypeError):
            pass
    match = re.search(r"(\d+)$", path.name)
    return int(match.group(1)) if match else None


def _load_checkpoint(spec):
    """``spec`` -> ``(model, tokenizer or None, label, step)``."""
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"checkpoint {spec!r}: a tuple must be (name_or_path, revision)")
        name, revision = str(spec[0]), spec[1]
    elif isinstance(spec, (str, os.PathLike)):
        name, revision = os.fspath(spec), None
    else:
        raise TypeError(f"checkpoint {spec!r}: expected a directory path or a (name_or_path, revision) tuple")
    path = Path(name)
    local = path.is_dir()
    if not local and (revision is None or path.exists()):
        raise ValueError(f"checkpoint {name!r} is not a directory; pass a checkpoint directory or (hub_id, revision)")
    model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=torch.float32).eval()
    tokenizer = None
    if not local or any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    label = name if revision is None else f"{name}@{revision}"
    step = _checkpoint_step(path) if local else None
    return model, tokenizer, label, step


def peel_trajectory(
    checkpoints: Sequence,
    calibration=None,
    eval_text=None,
    *,
    tokenizer=None,
    swap_calibration=None,
    protocols: Sequence[str] = ("replacement", "interchange"),
    max_gap: int = 1,
    swap_prompts: int = 32,
    swap_seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
    **peel_kwargs,
) -> PeelTrajectory:
    """Peel every checkpoint of a training run and score it with both swap-KL protocols.

    The monitoring use of the peeling bounds (Eamaz et al., arXiv 2605.02853): per
    checkpoint, the per-layer reference gaps (:func:`peel`) and the No Free Swap
    (arXiv 2605.16234) layer scores of replacement and interchange with the protocol gap
    I/R per pair (:func:`~hf_layerswap.scoring.score_layers`), on the same calibration and
    evaluation text at every checkpoint.

    Args:
        checkpoints: checkpoint directories (``save_pretrained`` output), or
            ``(name_or_path, revision)`` tuples, in training order.
        calibration, eval_text: as in :func:`peel` (kept apart).
        tokenizer: used for text sources; default: each checkpoint's own tokenizer.
        swap_calibration: swap-KL calibration source (default: ``calibration``).
        protocols: swap-KL protocols (empty: no swap-KL scoring).
        max_gap, swap_prompts, swap_seq_len: swap-KL pair set and budget.
        batch_size, seed, progress: shared with :func:`peel`.
        **peel_kwargs: further :func:`peel` arguments (spans, targets, ridge, ...).

    Returns:
        A :class:`PeelTrajectory`, one point per checkpoint.

    Raises:
        ValueError: an empty list, a missing directory, or any error of :func:`peel` or
            :func:`score_layers`.
    """
    if not checkpoints:
        raise ValueError("checkpoints is empty: pass at least one checkpoint directory")
    if isinstance(checkpoints, (str, os.PathLike)):
        raise TypeError("checkpoints must be a list of checkpoint directories, not a single path")
    points = []
    t0 = time.perf_counter()
    for spec in checkpoints:
        model, own_tokenizer, label, step = _load_checkpoint(spec)
        tok = tokenizer if tokenizer is not None else own_tokenizer
        report = peel(model, calibration, eval_text, tokenizer=tok, batch_size=batch_size, seed=seed,
                      progress=progress, **peel_kwargs)
        swap = None
        if protocols:
            source = calibration if swap_calibration is None else swap_calibration
            swap = score_layers(model, source, tokenizer=tok, protocols=tuple(protocols), max_gap=max_gap,
                                num_prompts=swap_prompts, seq_len=swap_seq_len, batch_size=batch_size,
                                progress=progress, seed=seed)
        points.append(TrajectoryPoint(label, step, report, swap))
        del model
    metadata = {
        "num_checkpoints": len(points),
        "protocols": list(protocols),
        "max_gap": max_gap,
        "swap_prompts": swap_prompts,
        "swap_seq_len": swap_seq_len,
        "timings": {"seconds": time.perf_counter() - t0},
    }
    return PeelTrajectory(points, metadata)
