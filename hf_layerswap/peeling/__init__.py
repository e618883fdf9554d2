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
``k..k+m-1`` runs through :func:`~hf_layerswap.layerplan.apply_plan`, starting at the cut from
the injected ``ĥ`` (the unchanged prefix is not re-run). :func:`peel_trajectory` repeats
the probes over training checkpoints together with both swap-KL protocols.

Layout: :mod:`.report` (results and JSON), :mod:`.data` (evaluation set, NLL, bootstrap),
:mod:`.references` (references, substitution, :func:`peel`), :mod:`.trajectory` (training
checkpoints), :mod:`.render` (tables and plots). The ``hf-layerswap peel`` verb lives with
the other command-line code in :mod:`hf_layerswap.cli.peel`.
"""

from __future__ import annotations

from .references import peel
from .data import build_evaluation, check_disjoint, sequence_nll
from .render import peel_plot, peel_table_markdown, trajectory_plot, trajectory_table_markdown
from .report import DEFAULT_RIDGE, DEFAULT_TAU, REFERENCES, TARGETS, PeelProbe, PeelReport
from .trajectory import peel_trajectory, PeelTrajectory, TrajectoryPoint

__all__ = [
    "DEFAULT_RIDGE",
    "DEFAULT_TAU",
    "REFERENCES",
    "TARGETS",
    "PeelProbe",
    "TrajectoryPoint",
    "PeelReport",
    "PeelTrajectory",
    "build_evaluation",
    "check_disjoint",
    "peel",
    "peel_plot",
    "peel_table_markdown",
    "peel_trajectory",
    "sequence_nll",
    "trajectory_plot",
    "trajectory_table_markdown",
]
