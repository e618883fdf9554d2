"""Peeling results: :class:`PeelProbe` (one reference substituted for a span of blocks) and
:class:`PeelReport` (every probe of one checkpoint), with an exact JSON round trip, and the
constants that name references and targets."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


from ..utils.jsonio import JsonResult, decode_float, decode_tree, encode_float, encode_tree


#: Reference kinds: closed-form linear map, gradient-fitted block, plain deletion.
REFERENCES = ("linear", "gradient", "deletion")
#: Target sets: the spans' own outputs, the final stream, or both.
TARGETS = ("own", "later", "own+later")
#: Default relative ridge toward the identity (``λ = ridge · trace(XᵀX) / (H + 1)``).
DEFAULT_RIDGE = 1e-3
#: A reference "matches" the blocks when the upper end of the ΔCE CI is at most this (nats).
DEFAULT_TAU = 0.01
_REPORT_FORMAT = "hf_layerswap.PeelReport/1"
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


@dataclass
class PeelReport(JsonResult):
    """Result of :func:`peel` (all CE values in nats per predicted token).

    Attributes:
        num_blocks: L.
        base_ce: CE of the unmodified model on the evaluation tokens.
        base_ce_ci: 95% bootstrap CI of ``base_ce``.
        probes: every probe, ordered by reference, span (later probes last), site.
        settings: ``spans``, ``targets``, ``references``, ``ridge``, ``bias``, ``tau``,
            ``bootstrap``, ``seed``, ``sites`` (and gradient settings).
        metadata: model identity, calibration and evaluation specs, library versions,
            token counts and timings.
    """

    num_blocks: int
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
        out: list[float | None] = [None] * self.num_blocks
        for p in self.probes:
            if p.span == span and p.reference == reference:
                out[p.site] = p.dce
        return out

    def later_gaps(self, reference: str = "linear") -> list[float | None]:
        """Per site k: ΔCE of the probe mapping ``h_k`` onto ``h_L`` (None where absent)."""
        out: list[float | None] = [None] * self.num_blocks
        for p in self.probes:
            if p.target == self.num_blocks and p.reference == reference:
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
            "num_blocks": self.num_blocks,
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
            "num_blocks": self.num_blocks,
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
            num_blocks=int(d["num_blocks"]),
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
