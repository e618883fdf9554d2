"""Per-layer optimisation diagnostics: "peeling" reference bounds.

Eamaz, Yeganegi and Soltanalian ("Trust, but Verify: Peeling Low-Bit Transformer Networks
for Training Monitoring", arXiv 2605.02853) peel a trained network layer by layer: each
layer is fitted locally against the trained model's own intermediate representations,
either onto its own output or onto a later layer's output; where such a cheap reference
matches or beats the trained layers, those layers are under-optimised or redundant.

This module applies that lens to one checkpoint, site by site (the per-site form of the
paper's construction; the paper's full sequential stack is not rebuilt here). With
``h_s`` the raw residual stream entering block s (``h_L`` = the stream leaving the last
block, before the final norm) and L blocks:

- a **probe** ``(k, m)`` replaces blocks ``k..k+m-1`` by a reference R fitted to map
  ``h_k`` onto ``h_{k+m}``: the model runs blocks ``0..k-1``, then ``ĥ = R(h_k)`` is
  handed to block ``k+m`` (or to the final norm when ``k+m = L``). Its "own" probes are
  the spans in ``spans``; its "later" probe maps ``h_k`` straight onto ``h_L`` (the
  paper's map that sends every layer to the final representation);
- references: ``"linear"``, the closed-form ridge regression of the update toward the
  identity, ``ĥ = [h_k, 1] W`` with ``(XᵀX + λI)(W − I) = Xᵀ(Y − X)``, X = ``[h_k, 1]``,
  Y = ``[h_{k+m}, 1]``, float64, ``λ = ridge · trace(XᵀX) / (H + 1)`` (λ → ∞ is deletion);
  ``"gradient"``, a fresh re-initialised copy of block k's own architecture trained by
  AdamW on the normalised MSE ``Σ‖R(h_k) − h_{k+m}‖² / Σ‖h_{k+m} − h_k‖²`` (the paper's
  per-layer MSE fit; for larger hardware); ``"deletion"``, ``ĥ = h_k`` (plain removal,
  the baseline every reference should beat);
- the **gap** of a probe is ``ΔCE = CE(hybrid) − CE(model)`` in nats per predicted token
  on held-out evaluation text (total NLL / total predicted tokens), with a paired
  percentile bootstrap CI over evaluation sequences. ``ΔCE < 0`` with the CI's upper end
  below 0 means the trained blocks are **beaten** by their reference; an upper end at or
  below ``tau`` means the reference **matches** them (the blocks are redundant up to tau).
  ``ΔCE ≥ 0`` certifies nothing beyond "this reference does not do the job";
- the fit's held-out **explained variance** of the blocks' update ``U = h_{k+m} − h_k``:
  ``EV = 1 − Σ‖ĥ − h_{k+m}‖² / Σ‖U − Ū‖²`` and ``nmse = Σ‖ĥ − h_{k+m}‖² / Σ‖U‖²``
  (1 = no better than deletion), over the real evaluation tokens.

The references are fitted on the calibration text and scored on separate evaluation
text; :func:`check_disjoint` refuses sets that share a paragraph or a prompt.

The substitution uses the layer-plan mechanism: the removal plan that drops blocks
``k..k+m-1`` runs through :func:`~hf_layerswap.plan.apply_plan`, starting at the cut from
the injected ``ĥ`` (the unchanged prefix is not re-run). :func:`peel_trajectory` repeats
the probes over training checkpoints together with both swap-KL protocols.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..calibration import CalibrationSet, build_calibration, embedded_text, split_paragraphs
from ..jsonio import (
    JsonResult,
    atomic_path,
    decode_float,
    decode_tree,
    encode_float,
    encode_tree,
    write_text_atomic,
)
from ..models import load_model
from ..plan import apply_plan, capture_residual_stream, decoder_blocks, removal_plan, resolve_layer_indices
from ..plots import figure, save_png
from ..provenance import library_versions, report_identity
from ..recovery import _Moments, ridge_toward_identity
from ..report import SwapReport
from ..scoring import score_layers

__all__ = [
    "DEFAULT_RIDGE",
    "DEFAULT_TAU",
    "REFERENCES",
    "TARGETS",
    "PeelProbe",
    "TrajectoryPoint",
    "PeelReport",
    "PeelTrajectory",
    "add_peel_arguments",
    "build_evaluation",
    "check_disjoint",
    "peel",
    "peel_plot",
    "peel_table_markdown",
    "peel_trajectory",
    "run_peel",
    "sequence_nll",
    "trajectory_plot",
    "trajectory_table_markdown",
]

#: Reference kinds: closed-form linear map, gradient-fitted block, plain deletion.
REFERENCES = ("linear", "gradient", "deletion")
#: Target sets: the spans' own outputs, the final stream, or both.
TARGETS = ("own", "later", "own+later")
#: Default relative ridge toward the identity (``λ = ridge · trace(XᵀX) / (H + 1)``).
DEFAULT_RIDGE = 1e-3
#: A reference "matches" the blocks when the upper end of the ΔCE CI is at most this (nats).
DEFAULT_TAU = 0.01
_REPORT_FORMAT = "hf_layerswap.PeelReport/1"
_TRAJECTORY_FORMAT = "hf_layerswap.PeelTrajectory/1"
_PROBE_FLOATS = ("dce", "ci_low", "ci_high", "ce", "explained_variance", "nmse", "seconds")


# ----------------------------------------------------------------------------- results


@dataclass
class PeelProbe:
    """One reference substituted for blocks ``site..site+span-1``.

    Attributes:
        site: first replaced block k (0-based).
        span: number of replaced blocks m; the reference maps ``h_k`` onto ``h_{k+m}``.
        reference: ``"linear"``, ``"gradient"`` or ``"deletion"``.
        kind: ``"own"`` (m is one of the requested spans) or ``"later"`` (target = h_L).
        dce: CE(hybrid) − CE(model) on the evaluation tokens, nats per predicted token.
        ci_low, ci_high: 95% paired bootstrap CI of ``dce`` (resampling sequences).
        ce: CE(hybrid), nats per predicted token.
        explained_variance: held-out EV of the update ``h_{k+m} − h_k`` (NaN if the
            update is exactly constant).
        nmse: held-out ``Σ‖ĥ − h_{k+m}‖² / Σ‖h_{k+m} − h_k‖²`` (1 = deletion).
        flag: ``"beaten"`` (ci_high < 0), ``"matched"`` (ci_high ≤ tau) or ``""``.
        fit: how the reference was fitted (``lambda`` and ``condition`` for linear;
            ``steps``, ``lr``, ``initial_loss``, ``final_loss`` for gradient).
        seconds: wall time of the probe's substituted forward passes over the evaluation
            set (plus the training time for gradient references).
    """

    site: int
    span: int
    reference: str
    kind: str
    dce: float
    ci_low: float
    ci_high: float
    ce: float
    explained_variance: float
    nmse: float
    flag: str = ""
    fit: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def target(self) -> int:
        """Residual-stream slot the reference maps onto (``site + span``)."""
        return self.site + self.span

    def to_dict(self, *, timings: bool = True) -> dict:
        out = {
            "site": self.site,
            "span": self.span,
            "target": self.target,
            "reference": self.reference,
            "kind": self.kind,
            "flag": self.flag,
            "fit": {k: encode_float(v) if isinstance(v, float) else v for k, v in self.fit.items()},
        }
        for key in _PROBE_FLOATS:
            if key != "seconds" or timings:
                out[key] = encode_float(getattr(self, key))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> PeelProbe:
        kw = {k: d[k] for k in ("site", "span", "reference", "kind", "flag")}
        for key in _PROBE_FLOATS:
            kw[key] = decode_float(d.get(key, 0.0))
        kw["fit"] = {k: decode_float(v) if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity") else v
                     for k, v in d.get("fit", {}).items()}
        return cls(**kw)


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    return f"{x:+.{digits}f}"


@dataclass
class PeelReport(JsonResult):
    """Result of :func:`peel` (all CE values in nats per predicted token).

    Attributes:
        num_layers: L.
        base_ce: CE of the unmodified model on the evaluation tokens.
        base_ce_ci: 95% bootstrap CI of ``base_ce``.
        probes: every probe, ordered by reference, span (later probes last), site.
        settings: ``spans``, ``targets``, ``references``, ``ridge``, ``bias``, ``tau``,
            ``bootstrap``, ``seed``, ``sites`` (and gradient settings).
        metadata: model identity, calibration and evaluation specs, library versions,
            token counts and timings.
    """

    num_layers: int
    base_ce: float
    base_ce_ci: tuple[float, float]
    probes: list[PeelProbe]
    settings: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def probe(self, site: int, span: int, reference: str = "linear") -> PeelProbe | None:
        """The probe replacing blocks ``site..site+span-1`` by ``reference`` (or None)."""
        for p in self.probes:
            if p.site == site and p.span == span and p.reference == reference:
                return p
        return None

    def layer_gaps(self, span: int = 1, reference: str = "linear") -> list[float | None]:
        """Per site k (length L): ΔCE of the probe (k, ``span``), None where absent."""
        out: list[float | None] = [None] * self.num_layers
        for p in self.probes:
            if p.span == span and p.reference == reference:
                out[p.site] = p.dce
        return out

    def later_gaps(self, reference: str = "linear") -> list[float | None]:
        """Per site k: ΔCE of the probe mapping ``h_k`` onto ``h_L`` (None where absent)."""
        out: list[float | None] = [None] * self.num_layers
        for p in self.probes:
            if p.target == self.num_layers and p.reference == reference:
                out[p.site] = p.dce
        return out

    def flagged(self, flag: str = "beaten") -> list[PeelProbe]:
        """Probes with the given flag (``"beaten"`` or ``"matched"``)."""
        if flag not in ("beaten", "matched"):
            raise ValueError(f"flag={flag!r}: allowed 'beaten' or 'matched'")
        return [p for p in self.probes if p.flag == flag]

    @property
    def peel_bound(self) -> PeelProbe | None:
        """The probe with the lowest finite ΔCE (negative: some cheap hybrid beats the model)."""
        finite = [p for p in self.probes if p.reference != "deletion" and math.isfinite(p.dce)]
        return min(finite, key=lambda p: (p.dce, p.reference, p.span, p.site)) if finite else None

    def summary_dict(self) -> dict:
        """Short JSON-able summary (for cards and trajectories)."""
        bound = self.peel_bound
        out = {
            "num_layers": self.num_layers,
            "base_ce": encode_float(self.base_ce),
            "peel_bound": None if bound is None else {
                "site": bound.site, "span": bound.span, "reference": bound.reference, "dce": encode_float(bound.dce)
            },
            "beaten": [[p.site, p.span, p.reference] for p in self.flagged("beaten")],
            "matched": [[p.site, p.span, p.reference] for p in self.flagged("matched")],
        }
        for ref in self.settings.get("references", ["linear"]):
            for span in self.settings.get("spans", [1]):
                out[f"{ref}_span{span}_gaps"] = [encode_float(v) for v in self.layer_gaps(span, ref)]
        return out

    # ------------------------------------------------------------------ JSON
    def to_dict(self, *, timings: bool = True) -> dict:
        """JSON-able dict; ``timings=False`` drops wall-clock fields (for comparisons)."""
        meta = {k: v for k, v in self.metadata.items() if timings or k != "timings"}
        return {
            "format": _REPORT_FORMAT,
            "num_layers": self.num_layers,
            "base_ce": encode_float(self.base_ce),
            "base_ce_ci": [encode_float(x) for x in self.base_ce_ci],
            "probes": [p.to_dict(timings=timings) for p in self.probes],
            "settings": encode_tree(self.settings),
            "metadata": encode_tree(meta),
        }

    @classmethod
    def from_dict(cls, d: dict) -> PeelReport:
        if d.get("format") != _REPORT_FORMAT:
            raise ValueError(f"not a PeelReport dict (format={d.get('format')!r}, expected {_REPORT_FORMAT!r})")
        return cls(
            num_layers=int(d["num_layers"]),
            base_ce=decode_float(d["base_ce"]),
            base_ce_ci=tuple(decode_float(x) for x in d["base_ce_ci"]),
            probes=[PeelProbe.from_dict(p) for p in d["probes"]],
            settings=decode_tree(d.get("settings", {})),
            metadata=decode_tree(d.get("metadata", {})),
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, PeelReport):
            return NotImplemented
        return json.dumps(self.to_dict(), sort_keys=True) == json.dumps(other.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------- data


def _normalise_paragraph(text: str) -> str:
    return " ".join(text.split())


def check_disjoint(calibration: CalibrationSet, evaluation: CalibrationSet) -> None:
    """Refuse calibration and evaluation sets that share text.

    Two checks: no evaluation prompt's real token ids equal a calibration prompt's; and,
    when both sets keep their texts, no paragraph (whitespace-normalised) of one occurs
    inside a paragraph of the other.

    Raises:
        ValueError: naming the first shared prompt.
    """
    def rows(cs: CalibrationSet) -> list[tuple[int, ...]]:
        return [tuple(ids[m.bool()].tolist()) for ids, m in zip(cs.input_ids, cs.attention_mask)]

    cal_rows = set(rows(calibration))
    for n, row in enumerate(rows(evaluation)):
        if row in cal_rows:
            raise ValueError(
                f"evaluation prompt {n} ({len(row)} tokens) is also a calibration prompt: the references are fitted "
                "on the calibration text and must be scored on different text (pass disjoint eval_text)"
            )
    if calibration.texts and evaluation.texts:
        cal = [_normalise_paragraph(t) for t in calibration.texts]
        for n, text in enumerate(evaluation.texts):
            t = _normalise_paragraph(text)
            for c in cal:
                if t and c and (t in c or c in t):
                    raise ValueError(
                        f"evaluation paragraph {n} ({t[:60]!r}...) overlaps calibration paragraph ({c[:60]!r}...): "
                        "calibration and evaluation text must be kept apart"
                    )


def _looks_like_path(value) -> bool:
    if isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and "\n" not in value and len(value) < 4096 and os.path.isfile(value)


def build_evaluation(eval_text, tokenizer, *, num_prompts: int = 32, seq_len: int = 128, seed: int = 0) -> CalibrationSet:
    """Held-out evaluation prompts for :func:`peel`.

    Args:
        eval_text: ``None``/``"embedded"`` (the first ``num_prompts`` paragraphs of
            ``embedded_text("evaluation")``, in order), raw text (split into
            paragraphs, first ``num_prompts`` in order), or any source
            :func:`~hf_layerswap.calibration.build_calibration` accepts (a text file is
            sampled with ``seed``).
        tokenizer, num_prompts, seq_len, seed: as in ``build_calibration``.

    Returns:
        A :class:`CalibrationSet` (``.texts`` kept for text sources).

    Raises:
        ValueError: raw text without a paragraph of at least 50 characters, and every
            error of ``build_calibration``.
    """
    if eval_text is None or (isinstance(eval_text, str) and eval_text == "embedded"):
        paras = split_paragraphs(embedded_text("evaluation"))
        cs = build_calibration(paras, tokenizer, num_prompts=num_prompts, seq_len=seq_len)
        cs.description = (
            f"embedded:pydoc_data.topics (evaluation split: topics k % 4 == 3), first {cs.num_prompts} paragraphs "
            f">= 50 chars; truncated to {seq_len} tokens"
        )
        return cs
    if isinstance(eval_text, str) and not _looks_like_path(eval_text):
        paras = split_paragraphs(eval_text)
        if not paras:
            raise ValueError("eval_text has no paragraph of at least 50 characters")
        cs = build_calibration(paras, tokenizer, num_prompts=num_prompts, seq_len=seq_len)
        cs.description = f"given text, first {cs.num_prompts} of {len(paras)} paragraphs; truncated to {seq_len} tokens"
        return cs
    return build_calibration(eval_text, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)


@torch.no_grad()
def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood per sequence.

    Position t predicts token t+1 when both are real (right padding).

    Args:
        logits: ``(B, T, V)``; input_ids, attention_mask: ``(B, T)``.

    Returns:
        ``(nll, count)``: ``(B,)`` float64 summed NLL in nats (fp32 log-softmax) and
        ``(B,)`` int64 number of predicted tokens.
    """
    nll = torch.zeros(logits.shape[0], dtype=torch.float64)
    count = torch.zeros(logits.shape[0], dtype=torch.int64)
    valid = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    for b in range(logits.shape[0]):
        keep = valid[b]
        if not bool(keep.any()):
            continue
        lp = F.cross_entropy(logits[b, :-1][keep].float(), input_ids[b, 1:][keep], reduction="sum")
        nll[b] = float(lp)
        count[b] = int(keep.sum())
    return nll, count


def _bootstrap(num: torch.Tensor, den: torch.Tensor, index: torch.Tensor) -> tuple[float, float]:
    """95% percentile CI of ``Σ num / Σ den`` over resampled sequences ``index`` (R, N)."""
    ratios = num[index].sum(dim=1) / den[index].sum(dim=1)
    q = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(q[0]), float(q[1])


# ----------------------------------------------------------------------------- references


class _LinearMap:
    """``ĥ = h W + b`` applied in float64, result in the stream's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        out = hidden.double() @ self.weight.to(hidden.device)
        if self.bias is not None:
            out = out + self.bias.to(hidden.device)
        return out.to(hidden.dtype)


def _deletion(hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return hidden


class _BlockReference:
    """A trained copy of a block's architecture, called like the block (cached kwargs)."""

    def __init__(self, block: nn.Module):
        self.block = block

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


def _fresh_copy(model: nn.Module, block: nn.Module, seed: int) -> nn.Module:
    """``copy.deepcopy(block)`` re-initialised with the model's own ``_init_weights`` rule."""
    ref = copy.deepcopy(block)
    for p in ref.parameters():
        p.requires_grad_(True)
        if hasattr(p, "_is_hf_initialized"):
            del p._is_hf_initialized
    init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for module in ref.modules():
            if hasattr(module, "_is_hf_initialized"):
                del module._is_hf_initialized
            if init is not None:
                init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return ref


def _train_block_reference(model, block, batches, *, steps: int, lr: float, seed: int) -> tuple[_BlockReference, dict]:
    """AdamW on ``Σ‖R(h_k) − h_t‖² / Σ‖h_t − h_k‖²`` over cached calibration batches.

    ``batches``: list of ``(x (B,T,H), y (B,T,H), keep (B,T) bool, kwargs)``.
    """
    ref = _fresh_copy(model, block, seed)
    ref.eval()  # no dropout: the fit is deterministic
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)

    def loss_of(x, y, keep, kwargs):
        out = ref(x, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        err = (out - y)[keep].double().pow(2).sum()
        return err / (y - x)[keep].double().pow(2).sum().clamp_min(1e-30)

    def full_loss() -> float:
        with torch.no_grad():
            num = sum(float(loss_of(*b) * (b[1] - b[0])[b[2]].double().pow(2).sum()) for b in batches)
            den = sum(float((b[1] - b[0])[b[2]].double().pow(2).sum()) for b in batches)
        return num / max(den, 1e-30)

    initial = full_loss()
    with torch.enable_grad():
        for step in range(steps):
            x, y, keep, kwargs = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y, keep, kwargs)
            loss.backward()
            opt.step()
    for p in ref.parameters():
        p.requires_grad_(False)
    return _BlockReference(ref), {"steps": steps, "lr": lr, "initial_loss": initial, "final_loss": full_loss()}


# ----------------------------------------------------------------------------- substitution


def _replace_output_hook(hidden: torch.Tensor):
    def hook(module, args, output):
        if isinstance(output, (tuple, list)):
            return (hidden,) + tuple(output[1:])
        return hidden

    return hook


def _substituted_logits(model, blocks, site: int, span: int, hidden: torch.Tensor, streams: dict, ids, mask):
    """Logits with blocks ``site..site+span-1`` removed and ``hidden`` at the cut (plan mechanism)."""
    num_layers = len(blocks)
    plan = removal_plan(num_layers, list(range(site, site + span)))
    if site < len(plan):  # a kept block follows the cut: inject its input
        with apply_plan(model, plan, start=site, start_hidden=hidden):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    # the cut reaches the last block: re-run the last kept block from its cached input, replace its output
    last = len(plan) - 1
    handle = blocks[plan[last]].register_forward_hook(_replace_output_hook(hidden))
    try:
        with apply_plan(model, plan, start=last, start_hidden=streams[plan[last]]):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        handle.remove()


def _kwargs_grabber(store: dict, site: int):
    def hook(module, args, kwargs):
        store[site] = {k: v for k, v in kwargs.items()}

    return hook


# ----------------------------------------------------------------------------- peel


def _as_tuple(value, allowed, what) -> tuple:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not items or any(v not in allowed for v in items):
        raise ValueError(f"{what}={value!r}: allowed one or more of {list(allowed)}")
    return tuple(dict.fromkeys(items))


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}")
    return value


def _probe_list(num_layers, spans, targets, references, sites) -> list[tuple[int, int, str, str]]:
    """``(site, span, reference, kind)`` for every probe, in report order."""
    probes = []
    own = targets in ("own", "own+later")
    later = targets in ("later", "own+later")
    for ref in references:
        if own:
            for span in spans:
                probes += [(k, span, ref, "own") for k in sites if k + span <= num_layers]
        if later and ref != "gradient":
            probes += [(k, num_layers - k, ref, "later") for k in sites if k > 0 and not (own and num_layers - k in spans)]
    return probes


@torch.no_grad()
def peel(
    model: nn.Module,
    calibration=None,
    eval_text=None,
    *,
    spans: Sequence[int] = (1, 2),
    targets: str = "own+later",
    ridge: float = DEFAULT_RIDGE,
    tokenizer=None,
    reference: str | Sequence[str] = "linear",
    bias: bool = True,
    sites: Sequence[int] | None = None,
    num_prompts: int = 64,
    seq_len: int = 128,
    eval_prompts: int = 32,
    eval_seq_len: int = 128,
    batch_size: int = 8,
    bootstrap: int = 1000,
    tau: float = DEFAULT_TAU,
    seed: int = 0,
    gradient_steps: int = 100,
    gradient_lr: float = 1e-3,
    progress: bool = False,
) -> PeelReport:
    """Per-layer peeling reference bounds of one checkpoint (Eamaz et al., arXiv 2605.02853).

    For every site k and span m, fit a reference mapping the residual stream entering
    block k onto the stream leaving block k+m-1 (and, for the "later" targets, onto the
    stream leaving the last block), substitute it for those blocks and report the change
    in held-out cross-entropy. See the module docstring for the definitions.

    Args:
        model: a transformers causal LM (decoder-only; multimodal text towers included).
        calibration: text the references are fitted on: ``None``/``"embedded"`` (the
            embedded calibration prose), a text file, a list of strings, a
            ``datasets.Dataset``, an ``input_ids``/``attention_mask`` mapping or a
            :class:`CalibrationSet` (see :func:`~hf_layerswap.calibration.build_calibration`).
        eval_text: held-out text the hybrids are scored on (see :func:`build_evaluation`):
            ``None`` (default: ``embedded_text("evaluation")``), raw text, or any
            calibration source. Must not overlap the calibration text.
        spans: numbers of consecutive blocks replaced by one reference (each 1..L-1).
        targets: ``"own"`` (stream after the span), ``"later"`` (the final stream h_L from
            every site k >= 1) or ``"own+later"``.
        ridge: relative ridge of the linear fit, ``λ = ridge · trace(XᵀX) / n`` with n
            the number of regressors (H + 1 with ``bias``), toward the identity (>= 0;
            0 = ordinary least squares). Recorded per probe as ``fit["lambda"]``.
        tokenizer: needed for text sources (default: ``model.layerswap_tokenizer`` if set).
        reference: one or more of :data:`REFERENCES` (``"gradient"`` only for own
            targets; it trains a re-initialised copy of block k's architecture for
            ``gradient_steps`` AdamW steps at ``gradient_lr`` on the cached calibration
            streams, which are then all kept in memory).
        bias: fit an affine map (a constant input column) rather than a linear one.
        sites: 0-based sites to probe (default: all).
        num_prompts, seq_len: calibration budget; eval_prompts, eval_seq_len: evaluation budget.
        batch_size: prompts per forward pass.
        bootstrap: bootstrap resamples for the CIs (>= 100), seeded by ``seed``.
        tau: "matched" threshold on the CI's upper end, nats (>= 0).
        progress: show a progress bar.

    Returns:
        A :class:`PeelReport`.

    Raises:
        ValueError: a span outside ``1..L-1``, an unknown target or reference, a bad
            site, ``ridge < 0``, ``tau < 0``, ``bootstrap < 100``, overlapping calibration
            and evaluation text (:func:`check_disjoint`), or a singular normal system.
        TypeError: a text source without a tokenizer.
    """
    _, _, blocks = decoder_blocks(model)
    num_layers = len(blocks)
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} block(s); peeling needs at least 2")
    spans = tuple(dict.fromkeys(spans))
    for m in spans:
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= num_layers - 1:
            raise ValueError(f"span {m!r} in spans={list(spans)}: allowed ints 1..{num_layers - 1} for {num_layers} blocks")
    if not spans:
        raise ValueError("spans is empty: pass at least one span, e.g. (1, 2)")
    if targets not in TARGETS:
        raise ValueError(f"targets={targets!r}: allowed {list(TARGETS)}")
    references = _as_tuple(reference, REFERENCES, "reference")
    if references == ("gradient",) and targets == "later":
        raise ValueError("reference='gradient' fits own targets only; use targets='own' or 'own+later'")
    if not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge={ridge!r}: must be a finite float >= 0")
    if not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau={tau!r}: must be a finite float >= 0")
    _check_int(bootstrap, "bootstrap", 100)
    _check_int(batch_size, "batch_size", 1)
    _check_int(gradient_steps, "gradient_steps", 0)
    site_list = list(range(num_layers)) if sites is None else resolve_layer_indices(list(sites), num_layers)
    probes = _probe_list(num_layers, spans, targets, references, site_list)
    if not probes:
        raise ValueError(f"no probe to run for sites={site_list}, spans={list(spans)}, targets={targets!r}")

    if tokenizer is None:
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    calib = build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)
    evalset = build_evaluation(eval_text, tokenizer, num_prompts=eval_prompts, seq_len=eval_seq_len, seed=seed)
    check_disjoint(calib, evalset)

    fitted = [(k, m) for k, m, ref, _ in probes if ref == "linear"]
    trained = [(k, m) for k, m, ref, _ in probes if ref == "gradient"]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    timings: dict = {}
    maps: dict = {}
    fits: dict = {}
    try:
        t0 = time.perf_counter()
        cal_tokens, hidden_size, cache = _fit_pass(
            model, blocks, calib, fitted, trained, batch_size, bias, float(ridge), maps, fits, device
        )
        timings["linear_fit_seconds"] = time.perf_counter() - t0
        if fitted and hidden_size is not None and cal_tokens < 4 * (hidden_size + 1):
            warnings.warn(
                f"linear references fitted on {cal_tokens} calibration tokens for {hidden_size + int(bias)} regressors: "
                "the ridge decides much of the map; use more calibration tokens (num_prompts/seq_len)",
                stacklevel=2,
            )
        for k, m in trained:
            t1 = time.perf_counter()
            maps[(k, m, "gradient")], fits[(k, m, "gradient")] = _train_block_reference(
                model, blocks[k], cache[(k, m)], steps=gradient_steps, lr=gradient_lr, seed=seed + 1000 * k + m
            )
            fits[(k, m, "gradient")]["train_seconds"] = time.perf_counter() - t1
        cache.clear()
        for k, m, ref, _ in probes:
            if ref == "deletion":
                maps[(k, m, ref)], fits[(k, m, ref)] = _deletion, {}
        results, base, timings["evaluation_base_seconds"] = _eval_pass(
            model, blocks, evalset, probes, maps, batch_size, device, progress
        )
    finally:
        model.train(was_training)

    nll0, count = base
    n = count.numel()
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (bootstrap, n), generator=g)
    den = count.double()
    base_ce = float(nll0.sum() / den.sum())
    out_probes = []
    for k, m, ref, kind in probes:
        r = results[(k, m, ref)]
        delta = r["nll"] - nll0
        dce = float(delta.sum() / den.sum())
        lo, hi = _bootstrap(delta, den, index)
        sst = r["u_sq"] - float((r["u_sum"] ** 2).sum()) / max(r["tokens"], 1)
        ev = 1.0 - r["sse"] / sst if sst > 0 else math.nan
        nmse = r["sse"] / r["u_sq"] if r["u_sq"] > 0 else math.nan
        flag = "beaten" if hi < 0 else ("matched" if hi <= tau else "")
        fit = dict(fits.get((k, m, ref), {}))
        seconds = r["seconds"] + float(fit.get("train_seconds", 0.0))
        out_probes.append(
            PeelProbe(k, m, ref, kind, dce, lo, hi, float(r["nll"].sum() / den.sum()), ev, nmse, flag, fit, seconds)
        )
    settings = {
        "spans": list(spans),
        "targets": targets,
        "references": list(references),
        "ridge": float(ridge),
        "ridge_rule": "lambda = ridge * trace(X^T X) / (H + 1), X = [h_k, 1]; ridge toward the identity",
        "bias": bool(bias),
        "tau": float(tau),
        "bootstrap": bootstrap,
        "bootstrap_unit": "evaluation sequence (paired, percentile 95%)",
        "seed": seed,
        "sites": site_list,
    }
    if trained:
        settings.update({"gradient_steps": gradient_steps, "gradient_lr": gradient_lr, "gradient_init": "fresh"})
    metadata = {
        "model": report_identity(model),
        "calibration": calib.spec(),
        "calibration_tokens_used": cal_tokens,
        "evaluation": evalset.spec(),
        "evaluation_predicted_tokens": int(count.sum()),
        "evaluation_sequences": n,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "fit_dtype": "float64",
        "ce_definition": "total next-token NLL / total predicted tokens (nats), fp32 log-softmax",
        "hidden_size": hidden_size,
        "library_versions": library_versions(),
        "method": "peeling reference bounds, per-site form (Eamaz, Yeganegi, Soltanalian, arXiv 2605.02853)",
        "timings": timings,
    }
    lo, hi = _bootstrap(nll0, den, index)
    return PeelReport(num_layers, base_ce, (lo, hi), out_probes, settings, metadata)


def _fit_pass(model, blocks, calib, fitted, trained, batch_size, bias, ridge, maps, fits, device):
    """One calibration pass: float64 moments for the linear fits, cached tensors for gradient fits."""
    slots = {k for k, _ in fitted + trained} | {k + m for k, m in fitted + trained}
    moments = _Moments()
    cache: dict = {pair: [] for pair in trained}
    kw_store: dict = {}
    handles = [blocks[k].register_forward_pre_hook(_kwargs_grabber(kw_store, k), with_kwargs=True)
               for k in sorted({k for k, _ in trained})]
    tokens, hidden_size = 0, None
    try:
        if not slots:
            return 0, None, cache
        for ids, mask in calib.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, _ = capture_residual_stream(model, ids, mask, slots=sorted(slots))
            keep = mask.bool()
            tokens += int(keep.sum())
            rows = {}
            for s in {k for k, _ in fitted} | {k + m for k, m in fitted}:
                x = streams[s][keep].double()
                hidden_size = x.shape[1]
                rows[s] = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1) if bias else x
            for k in {k for k, _ in fitted}:
                moments.add_gram(k, rows[k])
            for k, m in fitted:
                moments.add_cross((k, m), rows[k], rows[k + m])
            for k, m in trained:
                hidden_size = streams[k].shape[-1]
                cache[(k, m)].append((streams[k], streams[k + m], keep, kw_store[k]))
    finally:
        for h in handles:
            h.remove()
    for k, m in fitted:
        w, lam, cond = ridge_toward_identity(moments.gram[k], moments.cross[(k, m)], ridge)
        h = w.shape[0] - int(bias)
        maps[(k, m, "linear")] = _LinearMap(w[:h, :h].clone(), w[h, :h].clone() if bias else None)
        fits[(k, m, "linear")] = {"lambda": lam, "condition": cond}
    return tokens, hidden_size, cache


def _eval_pass(model, blocks, evalset, probes, maps, batch_size, device, progress):
    """Score every probe on the evaluation set; returns per-probe accumulators and base NLL."""
    results = {
        (k, m, ref): {"nll": [], "sse": 0.0, "u_sq": 0.0, "u_sum": None, "tokens": 0, "seconds": 0.0}
        for k, m, ref, _ in probes
    }
    gradient_sites = sorted({k for k, _, ref, _ in probes if ref == "gradient"})
    kw_store: dict = {}
    nll0, count0 = [], []
    base_seconds = 0.0
    num_batches = math.ceil(evalset.num_prompts / batch_size)
    bar = tqdm(total=num_batches * (1 + len(probes)), desc="peeling probes", unit="probe",
               disable=not progress, dynamic_ncols=True)
    try:
        for ids, mask in evalset.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            handles = [blocks[k].register_forward_pre_hook(_kwargs_grabber(kw_store, k), with_kwargs=True)
                       for k in gradient_sites]
            t0 = time.perf_counter()
            try:
                streams, logits = capture_residual_stream(model, ids, mask, compute_logits=True)
            finally:
                for h in handles:
                    h.remove()
            nll, count = sequence_nll(logits, ids, mask)
            base_seconds += time.perf_counter() - t0
            del logits
            nll0.append(nll)
            count0.append(count)
            keep = mask.bool()
            bar.update(1)
            for k, m, ref, _ in probes:
                acc = results[(k, m, ref)]
                t1 = time.perf_counter()
                x, y = streams[k], streams[k + m]
                hidden = maps[(k, m, ref)](x, kw_store.get(k, {}))
                logits = _substituted_logits(model, blocks, k, m, hidden, streams, ids, mask)
                nll, _ = sequence_nll(logits, ids, mask)
                acc["seconds"] += time.perf_counter() - t1
                del logits
                acc["nll"].append(nll)
                u = (y - x)[keep].double()
                acc["sse"] += float((hidden - y)[keep].double().pow(2).sum())
                acc["u_sq"] += float(u.pow(2).sum())
                acc["u_sum"] = u.sum(0) if acc["u_sum"] is None else acc["u_sum"] + u.sum(0)
                acc["tokens"] += u.shape[0]
                bar.update(1)
            del streams
    finally:
        bar.close()
    for acc in results.values():
        acc["nll"] = torch.cat(acc["nll"])
    return results, (torch.cat(nll0), torch.cat(count0)), base_seconds


# ----------------------------------------------------------------------------- rendering


def _gap_cell(p: PeelProbe | None) -> str:
    if p is None:
        return "—"
    return f"{_fmt(p.dce)} [{_fmt(p.ci_low)}, {_fmt(p.ci_high)}]"


def _ev_cell(p: PeelProbe | None) -> str:
    if p is None or math.isnan(p.explained_variance):
        return "—"
    return f"{p.explained_variance:.3f}"


def peel_table_markdown(report: PeelReport, *, reference: str = "linear") -> str:
    """Markdown table of the per-layer reference gaps (one row per site k, 0-based).

    Columns: the held-out explained variance and ΔCE [95% CI] of ``reference`` for every
    span in the report, the map onto the final stream (``k → end``), ΔCE of the other
    references at span 1 when present, and the flags (``beaten``: the reference beats
    the blocks, CI below 0; ``matched``: CI upper end ≤ tau). ΔCE in nats per token.
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r}: allowed {list(REFERENCES)}")
    spans = report.settings.get("spans", sorted({p.span for p in report.probes if p.kind == "own"}))
    others = [r for r in report.settings.get("references", []) if r != reference]
    L = report.num_layers
    head = ["layer"]
    for m in spans:
        label = "k" if m == 1 else f"k..k+{m - 1}"
        head += [f"EV {label}", f"ΔCE {label} [95% CI]"]
    has_later = any(p.target == L and p.reference == reference for p in report.probes)
    if has_later:
        head.append("ΔCE k→end [95% CI]")
    head += [f"ΔCE {r} k" for r in others]
    head.append("flags")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in range(L):
        row = [str(k)]
        for m in spans:
            p = report.probe(k, m, reference)
            row += [_ev_cell(p), _gap_cell(p)]
        if has_later:
            row.append(_gap_cell(report.probe(k, L - k, reference)) if k > 0 else "—")
        row += [_gap_cell(report.probe(k, 1, r)) for r in others]
        flags = []
        for p in report.probes:
            if p.site == k and p.flag:
                where = "end" if p.target == L and p.kind == "later" else f"span {p.span}"
                flags.append(f"{p.flag} ({p.reference}, {where})")
        row.append("; ".join(flags))
        lines.append("| " + " | ".join(row) + " |")
    s = report.settings
    meta = report.metadata
    lo, hi = report.base_ce_ci
    notes = [
        f"Base CE {report.base_ce:.4f} nats/token [{lo:.4f}, {hi:.4f}] on {meta.get('evaluation_predicted_tokens')} "
        f"held-out tokens ({meta.get('evaluation_sequences')} sequences). ΔCE = CE(hybrid) − CE(model); "
        f"negative with the CI below 0 = the reference beats the trained blocks ({s.get('bootstrap')} paired "
        f"bootstrap resamples of sequences). EV = held-out explained variance of the blocks' update. "
        f"Linear references: ridge {s.get('ridge')} (relative, toward the identity), affine={s.get('bias')}; "
        f"matched = CI upper end ≤ tau = {s.get('tau')} nats.",
    ]
    return "\n".join(lines) + "\n\n" + " ".join(notes) + "\n"


def _plot_canvas(width: float, height: float, rows: int = 1, cols: int = 1):
    fig = figure(width, height)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(rows * cols)]
    return fig, axes


def _write_png(fig, path: str | os.PathLike) -> Path:
    """Save through a temporary file in the same folder, then rename."""
    with atomic_path(path, suffix=".png") as tmp:
        save_png(fig, tmp)
    return Path(path)


def peel_plot(report: PeelReport, path: str | os.PathLike, *, reference: str = "linear") -> Path:
    """PNG (matplotlib, Agg canvas) of the per-layer reference gaps.

    Top: ΔCE [95% CI] per site for every span and the ``k → end`` map (symmetric-log
    axis, linear within ±tau), beaten probes filled red. Bottom: held-out explained
    variance of the fits. Returns the path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    L = report.num_layers
    fig, (ax, ax2) = _plot_canvas(max(6.0, 0.3 * L + 2.5), 5.6, rows=2)
    series = [(f"span {m}", [report.probe(k, m, reference) for k in range(L)]) for m in report.settings.get("spans", [1])]
    if any(p.kind == "later" and p.reference == reference for p in report.probes):
        series.append(("k → end", [report.probe(k, L - k, reference) if k > 0 else None for k in range(L)]))
    for r in report.settings.get("references", []):
        if r != reference:
            series.append((f"{r}, span 1", [report.probe(k, 1, r) for k in range(L)]))
    colors = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#a6761d"]
    width = 0.8 / max(1, len(series))
    for n, (label, probes) in enumerate(series):
        xs = np.array([k for k, p in enumerate(probes) if p is not None], dtype=float)
        if not xs.size:
            continue
        ps = [p for p in probes if p is not None]
        y = np.array([p.dce for p in ps])
        err = np.array([[p.dce - p.ci_low for p in ps], [p.ci_high - p.dce for p in ps]])
        off = (n - (len(series) - 1) / 2) * width
        color = colors[n % len(colors)]
        ax.errorbar(xs + off, y, yerr=np.clip(err, 0, None), fmt="o", ms=3.5, color=color, lw=0.8, label=label,
                    mfc="white")
        beaten = np.array([p.flag == "beaten" for p in ps])
        if beaten.any():
            ax.scatter(xs[beaten] + off, y[beaten], color="#b2182b", s=18, zorder=3)
        evs = np.array([p.explained_variance for p in ps])
        if label.startswith("span") or label == "k → end":
            ax2.plot(xs, evs, "o-", ms=3, lw=1, color=color, label=label)
    tau = float(report.settings.get("tau", DEFAULT_TAU)) or 1e-3
    ax.set_yscale("symlog", linthresh=tau)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axhline(tau, color="grey", lw=0.6, ls="--")
    ax.set_xlim(-0.6, L - 0.4)
    ax.set_xticks(range(L))
    ax.set_ylabel("ΔCE [nats/token]")
    ax.set_title("Peeling: CE(hybrid) − CE(model) with the reference in place of blocks k.. (red: beaten)", fontsize=9)
    ax.legend(fontsize=7, ncol=min(4, len(series)))
    ax2.set_xlim(-0.6, L - 0.4)
    ax2.set_xticks(range(L))
    ax2.set_ylim(min(0.0, ax2.get_ylim()[0]), 1.02)
    ax2.set_xlabel("site k (0-based first replaced block)")
    ax2.set_ylabel("held-out EV of update")
    return _write_png(fig, path)


# ----------------------------------------------------------------------------- trajectory


@dataclass
class TrajectoryPoint:
    """One checkpoint of a :class:`PeelTrajectory`.

    Attributes:
        checkpoint: directory or ``name@revision`` it was loaded from.
        step: training step (from ``trainer_state.json``'s ``global_step`` or a trailing
            integer in the directory name), None if unknown.
        peel: its :class:`PeelReport`.
        swap: its :class:`~hf_layerswap.report.SwapReport` (both protocols), or None.
    """

    checkpoint: str
    step: int | None
    peel: PeelReport
    swap: SwapReport | None = None

    def to_dict(self, *, timings: bool = True) -> dict:
        swap = None
        if self.swap is not None:
            swap = self.swap.to_dict()
            if not timings:
                swap["metadata"] = {k: v for k, v in swap["metadata"].items() if k != "seconds"}
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


def trajectory_table_markdown(trajectory: PeelTrajectory, *, span: int = 1, reference: str = "linear") -> str:
    """Markdown table: one row per checkpoint with base CE, ΔCE per site k (``span``;
    ``span=0``: the map onto the final stream), the peel bound, flag counts and the mean
    I/R over pairs."""
    if not trajectory.points:
        return ""
    L = trajectory.points[0].peel.num_layers
    def site(k: int) -> str:
        return f"{k}→end" if span == 0 else (str(k) if span == 1 else f"{k}..{k + span - 1}")

    head = ["step", "CE [nats]"] + [f"ΔCE {site(k)}" for k in range(L)] + ["peel bound", "beaten", "matched", "mean I/R"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = trajectory.protocol_gap_series()
    for n, (pt, gaps) in enumerate(zip(trajectory.points, trajectory.gap_matrix(span, reference))):
        bound = pt.peel.peel_bound
        finite = [v[n] for v in ratios.values() if v[n] is not None and math.isfinite(v[n])]
        row = [str(pt.step), f"{pt.peel.base_ce:.3f}"] + [_fmt(g, 3) for g in gaps]
        row.append("—" if bound is None else f"{_fmt(bound.dce, 3)} (k={bound.site}, m={bound.span}, {bound.reference})")
        row += [str(len(pt.peel.flagged("beaten"))), str(len(pt.peel.flagged("matched")))]
        row.append(f"{sum(finite) / len(finite):.3f}" if finite else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def trajectory_plot(trajectory: PeelTrajectory, path: str | os.PathLike, *, reference: str = "linear") -> Path:
    """PNG of a training trajectory (2 x 2 panels, x = training step):

    held-out CE with the numbers of beaten and matched probes; per-layer ΔCE of the span-1 references; per-layer ΔCE of
    the map onto the final stream; and I/R = d_inter / d_repl per adjacent pair.

    Raises:
        ImportError: matplotlib is not installed.
    """
    pts = trajectory.points
    x = np.array([p.step if p.step is not None else n for n, p in enumerate(pts)], dtype=float)
    L = pts[0].peel.num_layers
    fig, axes = _plot_canvas(10.0, 7.0, rows=2, cols=2)
    cmap = __import__("matplotlib").colormaps["viridis"]
    ax = axes[0]
    ax.plot(x, [p.peel.base_ce for p in pts], "o-", color="black", label="model CE (held-out)")
    ax.set_ylabel("CE [nats/token]")
    ax.set_title("Held-out CE; probes flagged beaten / matched", fontsize=9)
    twin = ax.twinx()
    twin.plot(x, [len(p.peel.flagged("beaten")) for p in pts], "v--", color="#b2182b", label="beaten (CI < 0)")
    twin.plot(x, [len(p.peel.flagged("matched")) for p in pts], "^--", color="#2166ac", label="matched (CI ≤ tau)")
    twin.set_ylabel("probes flagged")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=7)
    tau = float(pts[0].peel.settings.get("tau", DEFAULT_TAU)) or 1e-3
    for ax, span, title in ((axes[1], 1, "ΔCE, linear reference for block k"), (axes[2], 0, "ΔCE, linear map h_k → h_L")):
        grid = np.array([[np.nan if v is None else v for v in row] for row in trajectory.gap_matrix(span, reference)])
        for k in range(L):
            if np.isfinite(grid[:, k]).any():
                ax.plot(x, grid[:, k], "o-", ms=3, lw=1, color=cmap(k / max(1, L - 1)), label=f"k={k}")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_yscale("symlog", linthresh=tau)
        ax.set_ylabel("ΔCE [nats/token]")
        ax.set_title(title + " (< 0: reference beats the model)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    ax = axes[3]
    series = trajectory.protocol_gap_series()
    adjacent = [key for key in series if int(key.split("-")[1]) - int(key.split("-")[0]) == 1]
    for n, key in enumerate(adjacent):
        y = np.array([np.nan if v is None else v for v in series[key]], dtype=float)
        ax.plot(x, y, "o-", ms=3, lw=1, color=cmap(n / max(1, len(adjacent) - 1)), label=key)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    if adjacent:
        ax.set_yscale("log")
        ax.legend(fontsize=6, ncol=2)
    ax.set_ylabel("I/R = d_inter / d_repl")
    ax.set_title("Protocol gap per adjacent pair", fontsize=9)
    for ax in axes:
        ax.set_xlabel("training step")
    return _write_png(fig, path)


# ----------------------------------------------------------------------------- CLI


def add_peel_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``peel`` verb's arguments to ``parser`` (an ``add_subparsers`` child).

    One MODEL: peel that checkpoint. Several: a training trajectory (checkpoint
    directories in training order), peeled and scored with both swap-KL protocols.
    """
    parser.description = (
        "Per-layer peeling reference bounds (Eamaz et al., arXiv 2605.02853): replace blocks k..k+m-1 by a "
        "reference fitted on calibration text and report the held-out CE change with a bootstrap CI."
    )
    parser.add_argument("model", nargs="+", help="checkpoint dir, GGUF file, Hub id or bundled name; several "
                        "checkpoint dirs = a training trajectory")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (one model only)")
    parser.add_argument("--revision", default=None, help="Hub revision (one model only)")
    parser.add_argument("--calibration", default="embedded", help="text the references are fitted on: a file or 'embedded'")
    parser.add_argument("--eval-text", default="embedded", help="held-out text the hybrids are scored on: a file or "
                        "'embedded' (must not overlap the calibration text)")
    parser.add_argument("--num-prompts", type=int, default=64, help="calibration prompts")
    parser.add_argument("--seq-len", type=int, default=128, help="calibration tokens per prompt")
    parser.add_argument("--eval-prompts", type=int, default=32, help="evaluation prompts")
    parser.add_argument("--eval-seq-len", type=int, default=128, help="evaluation tokens per prompt")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="paragraph shuffle and bootstrap seed")
    parser.add_argument("--spans", type=int, nargs="+", default=[1, 2], help="blocks replaced per probe")
    parser.add_argument("--targets", default="own+later", choices=list(TARGETS))
    parser.add_argument("--reference", nargs="+", default=["linear"], choices=list(REFERENCES))
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, help="relative ridge toward the identity")
    parser.add_argument("--no-bias", action="store_true", help="fit linear (not affine) maps")
    parser.add_argument("--tau", type=float, default=DEFAULT_TAU, help="'matched' threshold in nats")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--sites", type=int, nargs="+", default=None, help="sites to probe (0-based; default all)")
    parser.add_argument("--gradient-steps", type=int, default=100, help="AdamW steps of a gradient reference")
    parser.add_argument("--gradient-lr", type=float, default=1e-3, help="learning rate of a gradient reference")
    parser.add_argument("--protocols", nargs="*", default=["replacement", "interchange"],
                        choices=["replacement", "interchange"], help="swap-KL protocols of a trajectory")
    parser.add_argument("--max-gap", type=int, default=1, help="swap-KL pair distance bound (trajectory)")
    parser.add_argument("--output", "-o", default="peel_report.json", help="report JSON path")
    parser.add_argument("--plot", default=None, help="also write the PNG plot here")
    parser.add_argument("--table", default=None, help="also write the markdown table here")
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    return parser


def _peel_kwargs(args) -> dict:
    return dict(
        spans=tuple(args.spans), targets=args.targets, reference=tuple(args.reference), ridge=args.ridge,
        bias=not args.no_bias, tau=args.tau, bootstrap=args.bootstrap, sites=args.sites,
        num_prompts=args.num_prompts, seq_len=args.seq_len, eval_prompts=args.eval_prompts,
        eval_seq_len=args.eval_seq_len, gradient_steps=args.gradient_steps, gradient_lr=args.gradient_lr,
    )


def run_peel(args) -> int:
    """Run the ``peel`` verb (see :func:`add_peel_arguments`); returns the exit code."""
    eval_text = None if args.eval_text == "embedded" else args.eval_text
    if len(args.model) == 1:
        model, tokenizer = load_model(args.model[0], gguf_file=args.gguf_file, revision=args.revision)
        report = peel(model, args.calibration, eval_text, tokenizer=tokenizer, batch_size=args.batch_size,
                      seed=args.seed, progress=args.progress, **_peel_kwargs(args))
        report.to_json(args.output)
        table = peel_table_markdown(report)
        if args.plot:
            peel_plot(report, args.plot)
    else:
        if args.gguf_file or args.revision:
            raise SystemExit("--gguf-file/--revision apply to one model; a trajectory takes checkpoint directories")
        traj = peel_trajectory(args.model, args.calibration, eval_text, protocols=tuple(args.protocols),
                               max_gap=args.max_gap, batch_size=args.batch_size, seed=args.seed,
                               progress=args.progress, **_peel_kwargs(args))
        traj.to_json(args.output)
        table = trajectory_table_markdown(traj)
        if args.plot:
            trajectory_plot(traj, args.plot)
    if args.table:
        write_text_atomic(table, args.table)
    print(table)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
