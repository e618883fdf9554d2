"""Result dataclasses: per-pair swap-KL values and the :class:`SwapReport`, with an exact
JSON round trip (non-finite values are kept as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``).

Definitions (No Free Swap, arXiv 2605.16234, Def. 1 and Remark 1), all in nats:

- ``replacement_ij`` = E_x KL(p_M || p_{M[i<-j]}) (slot i runs block j)
- ``replacement_ji`` = E_x KL(p_M || p_{M[j<-i]})
- ``replacement`` = max(replacement_ij, replacement_ji)
- ``interchange`` = E_x KL(p_M || p_{M[i<->j]})

E_x is the mean over real tokens of each prompt, then the mean over prompts. A protocol
registered with :func:`~hf_layerswap.scoring.protocols.register_protocol` keeps its probes'
values in :attr:`PairResult.extra` (the same flat keys in JSON).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field, fields

from ..utils.jsonio import (
    JsonResult,
    decode_float,
    decode_tree,
    encode_float,
    encode_tree,
)
from .protocols import PROTOCOLS, probe_kinds, protocol_of, SWAP_PROTOCOLS

__all__ = [
    "MACHINE_MEASUREMENTS",
    "PairResult",
    "PruneProvenance",
    "SwapReport",
    "set_key",
    "score_key",
]

_PAIR_VALUE_FIELDS = ("replacement_ij", "replacement_ji", "interchange")

#: Keys of ``SwapReport.metadata`` that measure the machine a run happened on, not the run:
#: two runs of the same scoring differ only in these (``SwapReport.to_dict(timings=False)``).
MACHINE_MEASUREMENTS = frozenset({"seconds", "peak_memory", "max_memory_source"})


def _max_kl(*values: float | None) -> float | None:
    """Max of a protocol's probe values (the two replacement directions); None if any is
    missing, NaN if any is NaN (never dropped)."""
    if any(v is None for v in values):
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


@dataclass
class PairResult:
    """Swap-KL of one block pair ``(i, j)``, ``i < j``, in nats.

    A value is ``None`` when its protocol was not scored; NaN/inf are real results
    (e.g. an overflow on a boundary pair) and are kept. ``*_se`` are standard errors of
    the prompt mean (sample std over prompts / sqrt(prompts)). ``extra`` holds the
    probes of registered protocols beyond the paper's two, ``{kind: mean, kind_se: se}``.
    """

    i: int
    j: int
    replacement_ij: float | None = None
    replacement_ji: float | None = None
    interchange: float | None = None
    replacement_ij_se: float | None = None
    replacement_ji_se: float | None = None
    interchange_se: float | None = None
    extra: dict[str, float | None] = field(default_factory=dict)

    def __post_init__(self):
        if not (isinstance(self.i, int) and isinstance(self.j, int) and 0 <= self.i < self.j):
            raise ValueError(f"pair ({self.i!r}, {self.j!r}) must satisfy 0 <= i < j")

    @property
    def gap(self) -> int:
        return self.j - self.i

    @property
    def replacement(self) -> float | None:
        """max(replacement_ij, replacement_ji): the paper's bidirectional d_repl."""
        return _max_kl(self.replacement_ij, self.replacement_ji)

    @property
    def ratio(self) -> float | None:
        """I/R = interchange / max(replacement, 1e-10); None if either is missing or non-finite."""
        r, x = self.replacement, self.interchange
        if r is None or x is None or not (math.isfinite(r) and math.isfinite(x)):
            return None
        return x / max(r, 1e-10)

    def probe_value(self, kind: str) -> float | None:
        """The mean of probe ``kind`` (None if not scored)."""
        return getattr(self, kind) if kind in _PAIR_VALUE_FIELDS else self.extra.get(kind)

    def value(self, protocol: str) -> float | None:
        """A protocol's value for the pair (the max of its probes) or one probe's value."""
        if protocol in SWAP_PROTOCOLS:
            return _max_kl(*(self.probe_value(k) for k in SWAP_PROTOCOLS[protocol].probes))
        if protocol_of(protocol) is not None:
            return self.probe_value(protocol)
        probes = [k for k in probe_kinds() if k not in SWAP_PROTOCOLS]
        raise ValueError(f"protocol={protocol!r}: allowed {list(SWAP_PROTOCOLS) + probes}")

    @classmethod
    def from_probes(cls, i: int, j: int, values: Mapping[str, tuple[float, float | None]]) -> PairResult:
        """The pair from ``{kind: (mean, se)}`` of its scored probes."""
        own: dict = {}
        extra: dict = {}
        for kind, (mean, se) in values.items():
            target = own if kind in _PAIR_VALUE_FIELDS else extra
            target[kind], target[f"{kind}_se"] = mean, se
        return cls(i, j, **own, extra=extra)

    def to_dict(self) -> dict:
        out = {"i": self.i, "j": self.j, "replacement": encode_float(self.replacement)}
        for f in fields(self):
            if f.name not in ("i", "j", "extra"):
                out[f.name] = encode_float(getattr(self, f.name))
        out.update({k: encode_float(v) for k, v in self.extra.items()})
        return out

    @classmethod
    def from_dict(cls, d: dict) -> PairResult:
        names = {f.name for f in fields(cls)} - {"extra"}
        kinds = {k for kind in probe_kinds() if kind not in _PAIR_VALUE_FIELDS for k in (kind, f"{kind}_se")}
        extra = {k: decode_float(v) for k, v in d.items() if k in kinds}
        return cls(**{k: (decode_float(v) if k not in ("i", "j") else int(v)) for k, v in d.items() if k in names},
                   extra=extra)


def score_key(value: float | None) -> tuple[int, float]:
    """Sort key: finite ascending, then +inf, then NaN/None."""
    if value is None or math.isnan(value):
        return (2, 0.0)
    if math.isinf(value):
        return (1 if value > 0 else 0, value)
    return (0, value)


@dataclass
class SwapReport(JsonResult):
    """Swap-KL results for every scored pair of a model, plus provenance.

    Attributes:
        num_blocks: L, the number of decoder blocks scored.
        pairs: one :class:`PairResult` per scored pair, sorted by ``(i, j)``.
        protocols: the protocols that were scored.
        max_gap: pairs have ``1 <= j - i <= max_gap``.
        metadata: model name/revision, calibration (description, content hash, prompts,
            tokens, seq_len), dtype, forward passes, seconds, library versions.
        removal_kl: joint removal KL d_skip(S) in nats keyed by ``"i,j,..."`` (0-based,
            ascending), for sets evaluated on this model and the report's own calibration
            prompts (a selection on other prompts records none here; a search on these
            prompts takes them rather than scoring the sets again).
        selections: records of :func:`~hf_layerswap.select_layers` calls that evaluated
            candidates (``protocol="auto"``).
    """

    num_blocks: int
    pairs: list[PairResult]
    protocols: tuple[str, ...] = PROTOCOLS
    max_gap: int = 1
    metadata: dict = field(default_factory=dict)
    removal_kl: dict[str, float] = field(default_factory=dict)
    selections: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.protocols = tuple(self.protocols)
        for p in self.protocols:
            if p not in SWAP_PROTOCOLS:
                raise ValueError(f"protocol {p!r} is not one of {list(SWAP_PROTOCOLS)}")
        self.pairs = sorted(self.pairs, key=lambda r: (r.i, r.j))
        for r in self.pairs:
            if r.j >= self.num_blocks:
                raise ValueError(f"pair ({r.i}, {r.j}) is out of range for num_blocks={self.num_blocks}")
        dupes = sorted({(r.i, r.j) for r, q in zip(self.pairs, self.pairs[1:]) if (r.i, r.j) == (q.i, q.j)})
        if dupes:
            raise ValueError(f"pairs {dupes} occur more than once: each pair (i, j) has one result")

    # ------------------------------------------------------------------ queries
    def pair(self, i: int, j: int) -> PairResult:
        """The result for pair ``{i, j}`` (order-free). Raises KeyError if not scored."""
        a, b = min(i, j), max(i, j)
        for r in self.pairs:
            if (r.i, r.j) == (a, b):
                return r
        raise KeyError(f"pair ({a}, {b}) was not scored (max_gap={self.max_gap})")

    def _require(self, protocol: str) -> None:
        base = protocol_of(protocol)
        if base is None:
            raise ValueError(f"protocol={protocol!r}: allowed {list(SWAP_PROTOCOLS)}")
        if base not in self.protocols:
            raise ValueError(f"protocol {protocol!r} was not scored in this report (scored: {list(self.protocols)})")

    def layer_scores(self, protocol: str = "interchange") -> list[float]:
        """s(i) = min over scored partners j of d(i, j), length L (nats). Low = removable.

        NaN partner values are skipped; a layer whose every partner value is NaN gets NaN
        (it sorts last and is never selected).
        """
        self._require(protocol)
        scores: list[float] = []
        for layer in range(self.num_blocks):
            values = [r.value(protocol) for r in self.pairs if layer in (r.i, r.j)]
            values = [v for v in values if v is not None]
            known = [v for v in values if not math.isnan(v)]
            scores.append(min(known) if known else math.nan)
        return scores

    def protocol_gap(self) -> dict:
        """Per-pair I/R = interchange / replacement and a summary.

        Returns:
            ``{"pairs": [{"i","j","gap","replacement","interchange","ratio"}...],
            "summary": {"pairs", "finite_pairs", "mean_ratio", "median_ratio",
            "fraction_interchange_le_replacement", "mean_ratio_by_gap": {gap: mean}}}``.
        """
        self._require("replacement")
        self._require("interchange")
        rows = []
        for r in self.pairs:
            rows.append(
                {
                    "i": r.i,
                    "j": r.j,
                    "gap": r.gap,
                    "replacement": r.replacement,
                    "interchange": r.interchange,
                    "ratio": r.ratio,
                }
            )
        ratios = [row["ratio"] for row in rows if row["ratio"] is not None]
        finite = [r for r in self.pairs if r.ratio is not None]
        by_gap: dict[int, list[float]] = {}
        for r in finite:
            by_gap.setdefault(r.gap, []).append(r.ratio)
        summary = {
            "pairs": len(rows),
            "finite_pairs": len(ratios),
            "mean_ratio": statistics.fmean(ratios) if ratios else None,
            "median_ratio": statistics.median(ratios) if ratios else None,
            "fraction_interchange_le_replacement": (
                sum(r.interchange <= r.replacement for r in finite) / len(finite) if finite else None
            ),
            "mean_ratio_by_gap": {g: statistics.fmean(v) for g, v in sorted(by_gap.items())},
        }
        return {"pairs": rows, "summary": summary}

    def ranking(self, protocol: str = "interchange") -> list[int]:
        """Layer indices sorted by score ascending (non-finite last, ties by index)."""
        scores = self.layer_scores(protocol)
        return sorted(range(self.num_blocks), key=lambda i: (score_key(scores[i]), i))

    # ------------------------------------------------------------------ JSON
    def to_dict(self, *, timings: bool = True) -> dict:
        """JSON-able dict. ``timings=False`` leaves out the metadata that measures the machine
        rather than the run (:data:`MACHINE_MEASUREMENTS`: wall seconds, peak memory, the free
        memory an automatic ``max_memory`` was derived from), so that two runs compare equal."""
        metadata = self._metadata_with_nonfinite()
        if not timings:
            metadata = {k: v for k, v in metadata.items() if k not in MACHINE_MEASUREMENTS}
        return {
            "format": "hf_layerswap.SwapReport/1",
            "num_blocks": self.num_blocks,
            "protocols": list(self.protocols),
            "max_gap": self.max_gap,
            "pairs": [r.to_dict() for r in self.pairs],
            "removal_kl": {k: encode_float(v) for k, v in self.removal_kl.items()},
            "selections": encode_tree(self.selections),
            "metadata": encode_tree(metadata),
        }

    def _metadata_with_nonfinite(self) -> dict:
        """The metadata with ``nonfinite`` listing the non-finite values (``values``: ``[i, j,
        kind]``; ``removal_kl``: set keys), which :meth:`from_dict` requires of any NaN/inf."""
        given = self.metadata.get("nonfinite")
        record = {k: v for k, v in given.items() if k not in ("values", "removal_kl")} if isinstance(given, Mapping) else {}
        values = [[r.i, r.j, kind] for r in self.pairs for kind in (*_PAIR_VALUE_FIELDS, *r.extra)
                  if r.probe_value(kind) is not None and not math.isfinite(r.probe_value(kind))]
        sets = [k for k, v in self.removal_kl.items() if v is not None and not math.isfinite(v)]
        metadata = {k: v for k, v in self.metadata.items() if k != "nonfinite"}
        if values or sets:
            record.update({"values": values, "removal_kl": sets})
        if record:
            metadata["nonfinite"] = record
        return metadata

    @classmethod
    def from_dict(cls, d: dict, *, trust: bool = False) -> SwapReport:
        """The report from :meth:`to_dict`'s dict, checked unless ``trust=True``.

        Checked (see :func:`check_report_dict`): ``num_blocks`` and ``max_gap`` are ints
        with ``2 <= num_blocks`` and ``1 <= max_gap <= num_blocks - 1``; the pairs are
        exactly those with ``1 <= j - i <= max_gap`` (none missing, none extra); each
        scored protocol's probes have a value and no other probe has one; every value and
        standard error is ``>= 0`` (the engine clamps each token's KL at 0, so even float
        noise is never negative); ``replacement`` is the max of its two directions; a
        ``removal_kl`` key names a valid set; and a non-finite value (NaN, inf) loads only
        where ``metadata["nonfinite"]`` lists it (:meth:`to_dict` writes that list from
        the values, so a report the library wrote loads as it was, and a value edited to
        NaN by hand does not).

        Raises:
            ValueError: a check fails; the message names the field and the value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"not a SwapReport dict: got {type(d).__name__}")
        if d.get("format") != "hf_layerswap.SwapReport/1":
            raise ValueError(f"not a SwapReport dict (format={d.get('format')!r})")
        missing = [k for k in ("num_blocks", "pairs", "protocols", "max_gap") if k not in d]
        if missing:
            raise ValueError(f"SwapReport dict is missing {missing}")
        if not trust:
            for key in ("num_blocks", "max_gap"):
                if isinstance(d[key], bool) or not isinstance(d[key], int):
                    raise ValueError(f"{key} = {d[key]!r}: must be an int")
            if not isinstance(d["pairs"], list) or not all(isinstance(p, dict) for p in d["pairs"]):
                raise ValueError("pairs: must be a list of pair objects")
            for n, pair in enumerate(d["pairs"]):
                for key in ("i", "j"):
                    if key in pair and (isinstance(pair[key], bool) or not isinstance(pair[key], int)):
                        raise ValueError(f"pairs[{n}] {key} = {pair[key]!r}: must be an int block index")
        metadata = decode_tree(d.get("metadata", {}))
        listed = metadata.get("nonfinite") if isinstance(metadata, dict) else None
        if isinstance(listed, dict):  # written by to_dict from the values: not kept in memory
            listed = dict(listed)
            metadata["nonfinite"] = {k: v for k, v in listed.items() if k not in ("values", "removal_kl")}
            if not metadata["nonfinite"]:
                metadata.pop("nonfinite")
        report = cls(
            num_blocks=int(d["num_blocks"]),
            pairs=[PairResult.from_dict(p) for p in d["pairs"]],
            protocols=tuple(d["protocols"]),
            max_gap=int(d["max_gap"]),
            metadata=metadata,
            removal_kl={k: decode_float(v) for k, v in d.get("removal_kl", {}).items()},
            selections=decode_tree(d.get("selections", [])),
        )
        if not trust:
            check_report_dict(report, d, listed if isinstance(listed, dict) else {})
        return report

    @classmethod
    def from_json(cls, source: str | os.PathLike, *, trust: bool = False) -> SwapReport:  # type: ignore[override]  # its one option
        """The report from a file written by :meth:`to_json` (a path), or that JSON text.

        Args:
            trust: ``True`` skips the checks of :meth:`from_dict` (for a file you edited
                on purpose); by default a hand-edited file is refused.

        Raises:
            FileNotFoundError: ``source`` names no file.
            ValueError: invalid JSON or a failed check; the message names the file (or
                "JSON text"), the field and the value.
        """
        return super().from_json(source, trust=trust)

    def nonfinite_values(self) -> dict[str, float]:
        """``{label: value}`` of every non-finite probe value (``"pair (i, j) kind"``) and
        joint removal KL (``"set i,j,..."``) in the report."""
        out = {}
        for r in self.pairs:
            for kind in (*_PAIR_VALUE_FIELDS, *r.extra):
                v = r.probe_value(kind)
                if v is not None and not math.isfinite(v):
                    out[f"pair ({r.i}, {r.j}) {kind}"] = v
        out.update({f"set {k}": v for k, v in self.removal_kl.items() if v is not None and not math.isfinite(v)})
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, SwapReport):
            return NotImplemented
        return json.dumps(self.to_dict(), sort_keys=True) == json.dumps(other.to_dict(), sort_keys=True)

    def summary_dict(self) -> dict:
        """Short JSON-able summary for provenance (config.json, cards)."""
        out: dict[str, Any] = {"num_blocks": self.num_blocks, "protocols": list(self.protocols), "max_gap": self.max_gap}
        for p in self.protocols:
            out[f"{p}_layer_scores"] = [encode_float(v) for v in self.layer_scores(p)]
        cal = self.metadata.get("calibration", {})
        out["calibration"] = {k: cal.get(k) for k in ("description", "content_hash", "num_prompts", "num_tokens")}
        if cal.get("shortfall"):
            out["calibration"]["shortfall"] = dict(cal["shortfall"])
        return out


def check_report_dict(report: SwapReport, data: Mapping, listed: Mapping) -> None:
    """The checks of :meth:`SwapReport.from_dict` on a report built from ``data`` (its JSON
    dict); ``listed`` is the dict's ``metadata["nonfinite"]`` record.

    Raises:
        ValueError: naming the field and the value (see :meth:`SwapReport.from_dict`).
    """
    num_blocks, max_gap = report.num_blocks, report.max_gap
    if num_blocks < 2:
        raise ValueError(f"num_blocks = {num_blocks}: a report scores at least 2 blocks")
    if not 1 <= max_gap <= num_blocks - 1:
        raise ValueError(f"max_gap = {max_gap}: allowed 1..{num_blocks - 1} for num_blocks = {num_blocks}")
    if len(set(report.protocols)) != len(report.protocols) or not report.protocols:
        raise ValueError(f"protocols = {list(report.protocols)}: a non-empty list without repeats")
    want = {(i, j) for i in range(num_blocks) for j in range(i + 1, min(num_blocks, i + max_gap + 1))}
    have = {(r.i, r.j) for r in report.pairs}
    if want != have:
        parts = []
        if want - have:
            parts.append(f"missing {sorted(want - have)}")
        if have - want:
            parts.append(f"extra {sorted(have - want)}")
        raise ValueError(f"pairs do not match num_blocks = {num_blocks} and max_gap = {max_gap} (every pair with "
                         f"1 <= j - i <= {max_gap}, {len(want)} in all): {'; '.join(parts)}")
    scored = set(probe_kinds(report.protocols))
    nonfinite_listed = {(int(v[0]), int(v[1]), str(v[2])) for v in listed.get("values", []) if len(v) == 3}
    for n, (r, raw) in enumerate(zip(report.pairs, sorted(data["pairs"], key=lambda p: (int(p["i"]), int(p["j"]))))):
        where = f"pairs[{n}] ({r.i}, {r.j})"
        for kind in (*_PAIR_VALUE_FIELDS, *r.extra):
            if kind.endswith("_se"):
                continue
            v = r.probe_value(kind)
            se = getattr(r, f"{kind}_se") if kind in _PAIR_VALUE_FIELDS else r.extra.get(f"{kind}_se")
            if kind not in scored:
                if v is not None:
                    raise ValueError(f"{where} {kind} = {encode_float(v)}: the report did not score this probe "
                                     f"(protocols {list(report.protocols)}), so it has no value")
                continue
            if v is None:
                raise ValueError(f"{where} {kind} is missing: every scored probe has a value")
            if not math.isfinite(v):
                if v < 0 or (r.i, r.j, kind) not in nonfinite_listed:
                    raise ValueError(f"{where} {kind} = {encode_float(v)}: a non-finite value loads only where "
                                     "metadata['nonfinite'] lists it (as the library writes it)")
            elif v < 0:
                raise ValueError(f"{where} {kind} = {v!r}: a KL is >= 0 (the engine clamps each token's KL at 0)")
            if se is not None and not (math.isfinite(se) and se >= 0):
                raise ValueError(f"{where} {kind}_se = {encode_float(se)}: a standard error is a finite number >= 0")
        stored = raw.get("replacement")
        if stored is not None and encode_float(decode_float(stored)) != encode_float(r.replacement):
            raise ValueError(f"{where} replacement = {stored!r}: it is max(replacement_ij, replacement_ji) = "
                             f"{encode_float(r.replacement)}")
    stale = nonfinite_listed - {(r.i, r.j, k) for r in report.pairs for k in (*_PAIR_VALUE_FIELDS, *r.extra)
                                if r.probe_value(k) is not None and not math.isfinite(r.probe_value(k))}
    if stale:
        raise ValueError(f"metadata['nonfinite']['values'] lists {sorted(stale)} but those values are finite")
    listed_sets = set(listed.get("removal_kl", []))
    for key, v in report.removal_kl.items():
        blocks = key.split(",") if isinstance(key, str) and key else []
        ok = all(b.isdigit() for b in blocks) and [int(b) for b in blocks] == sorted({int(b) for b in blocks})
        if not ok or not blocks or len(blocks) >= num_blocks or int(blocks[-1]) >= num_blocks:
            raise ValueError(f"removal_kl key {key!r}: a set of 1..{num_blocks - 1} distinct blocks 0..{num_blocks - 1}, "
                             "ascending, as 'i,j,...'")
        if v is None or (math.isfinite(v) and v < 0):
            raise ValueError(f"removal_kl[{key!r}] = {v!r}: a KL is >= 0")
        if not math.isfinite(v) and (v < 0 or key not in listed_sets):
            raise ValueError(f"removal_kl[{key!r}] = {encode_float(v)}: a non-finite value loads only where "
                             "metadata['nonfinite'] lists it")


@dataclass
class PruneProvenance:
    """How one removal step's blocks were chosen: the record :func:`hf_layerswap.pipeline.prune`
    writes into the step of ``config.layerswap["steps"]`` (next to the fields
    :func:`~hf_layerswap.surgery.remove_layers` computes) and the model card reads.

    Attributes:
        selection: ``"explicit layers"`` or the rule in words (strategy, spacing, protect).
        protocol: the ``protocol`` asked for (``"interchange"``, ``"replacement"``,
            ``"auto"``), ``None`` when the caller named none.
        strategy: the selection strategy (a name in :data:`hf_layerswap.selection.STRATEGIES`)
            for a scored selection.
        config: :meth:`hf_layerswap.LayerSwapConfig.to_dict` of the run (spacing and
            protect among them: the card recomputes each protocol's set with these).
        scores: :meth:`SwapReport.summary_dict` of the report the set was chosen from.
        calibration: :meth:`~hf_layerswap.calibration.CalibrationSet.spec` of the prompts.
        decision: the strategy's decision record as it appended it to
            ``SwapReport.selections`` (e.g. the chosen set, its value, each protocol's set,
            trace, cost), kept as the strategy's entry says
            (:attr:`hf_layerswap.selection.registry.Strategy.provenance`); the card reads it
            through the same entry.
    """

    selection: str
    protocol: str | None = None
    strategy: str | None = None
    config: dict | None = None
    scores: dict | None = None
    calibration: dict | None = None
    decision: dict | None = None

    def to_dict(self) -> dict:
        """The set fields in declaration order (``None`` fields are left out); JSON-able."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data) -> PruneProvenance:
        """Read the record from a removal step (other keys, e.g. the computed
        ``removed_layers``, are ignored); a step without one reads as
        ``selection="not recorded"``. Raises TypeError when ``data`` is not a mapping."""
        if not hasattr(data, "keys"):
            raise TypeError(f"PruneProvenance.from_dict needs a mapping, got {type(data).__name__}")
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        known.setdefault("selection", "not recorded")
        for name in ("config", "scores", "calibration", "decision"):
            if name in known and not hasattr(known[name], "keys"):
                known[name] = None  # a hand-edited record: read what is readable
        return cls(**known)


def set_key(layers) -> str:
    """Canonical key of a removal set: ``"i,j,..."`` ascending."""
    return ",".join(str(i) for i in sorted(layers))
