"""What a recovery fitted: :class:`BoundaryFit` per cut and the :class:`RecoveryReport`,
with an exact JSON round trip."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from ..utils.jsonio import JsonResult, decode_float, encode_float

@dataclass
class BoundaryFit:
    """The fit at one cut.

    Attributes:
        boundary: residual-stream slot of the *pruned* model the map acts on (0-based):
            ``b = 0`` is the input of pruned block 0, ``b > 0`` the output of pruned block
            ``b − 1`` (``b = L'`` the output of the last block, before the final norm).
        removed: 0-based indices (in the model given to :func:`recover`) of the removed run.
        host: index (same numbering) of the last kept block before the cut; ``None`` when
            the cut starts at block 0.
        residual_before: ``‖h_s − h_e‖_F / ‖h_e‖_F`` (plain removal), over the calibration tokens.
        residual_after: ``‖Ŷ − h_e‖_F / ‖h_e‖_F`` with the fitted map; equals
            ``residual_before`` for method ``"none"``.
        condition_number: largest condition number of ``XᵀX + λI`` among this boundary's
            solves (``None`` for ``"none"``).
        ridge: the absolute λ of each solve at this boundary.
        folded_into: for ``"fused"`` (and ``"linearpatch"`` at a cut of block 0), the weight
            the map was folded into.
        rotation: for ``"linearpatch"``, the orthonormal rotation its map is built on
            (:func:`~hf_layerswap.recovery.hadamard.hadamard_rotation`); left out of
            :meth:`to_dict` when ``None``.
        extra: the method's own values of this fit, ``{name: float}`` (a registered repair's
            ``solve`` fills it, e.g. a fitted scalar); serialised by :meth:`to_dict` (left out
            when empty; non-finite values as ``"NaN"``/``"Infinity"``) and recorded per cut in
            ``config.layerswap["recovery"]["extra"]``.
    """

    boundary: int
    removed: list[int]
    host: int | None
    residual_before: float
    residual_after: float
    condition_number: float | None = None
    ridge: list[float] = field(default_factory=list)
    folded_into: str | None = None
    rotation: str | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["rotation"] is None:
            out.pop("rotation")
        if self.extra:
            out["extra"] = encoded_extra(self.extra)
        else:
            out.pop("extra")
        for key in ("residual_before", "residual_after", "condition_number"):
            out[key] = encode_float(out[key])
        out["ridge"] = [encode_float(x) for x in self.ridge]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> BoundaryFit:
        d = dict(d)
        for key in ("residual_before", "residual_after", "condition_number"):
            d[key] = decode_float(d.get(key))
        d["ridge"] = [decode_float(x) for x in d.get("ridge", [])]
        d["extra"] = {str(k): decode_float(v) for k, v in d.get("extra", {}).items()}
        return cls(**d)


def encoded_extra(extra: dict[str, float]) -> dict:
    """``extra`` (a :attr:`BoundaryFit.extra`) with each value a float as JSON holds it
    (non-finite ones as ``"NaN"``/``"Infinity"``).

    Raises:
        TypeError: a value that is not a real number (a bool included), naming the key.
    """
    for key, value in extra.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"BoundaryFit.extra[{key!r}]={value!r}: must be a float (a method's own value of its fit)")
    return {str(k): encode_float(float(v)) for k, v in extra.items()}


@dataclass
class RecoveryReport(JsonResult):
    """What :func:`recover` fitted.

    Attributes:
        method: ``"none"``, ``"ghosted"``, ``"fused"``, ``"linearpatch"`` or a registered name.
        removed_layers: 0-based indices removed (numbering of the model given to :func:`recover`).
        epsilon: relative ridge (``λ = epsilon · trace(XᵀX) / H`` per solve).
        num_tokens: real calibration tokens used (every fit uses the same tokens).
        hidden_size: H.
        boundaries: one :class:`BoundaryFit` per cut, in order.
        calibration: the calibration set's :meth:`CalibrationSet.spec`.
    """

    method: str
    removed_layers: list[int]
    epsilon: float
    num_tokens: int
    hidden_size: int | None
    boundaries: list[BoundaryFit] = field(default_factory=list)
    calibration: dict | None = None

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "removed_layers": list(self.removed_layers),
            "epsilon": self.epsilon,
            "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size,
            "boundaries": [b.to_dict() for b in self.boundaries],
            "calibration": copy.deepcopy(self.calibration),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RecoveryReport:
        d = dict(d)
        d["boundaries"] = [BoundaryFit.from_dict(b) for b in d.get("boundaries", [])]
        return cls(**d)


