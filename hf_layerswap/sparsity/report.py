"""SparsityReport: what :func:`~hf_layerswap.sparsity.sparsify` did, with an exact JSON round trip."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..report import decode_float, encode_float, write_json_atomic

__all__ = ["BlockSparsity", "LinearSparsity", "SparsityReport"]


@dataclass
class BlockSparsity:
    """One decoder block (0-based ``index``).

    Attributes:
        target: the sparsity the allocator gave the block (fraction).
        achieved: ``num_zeros / num_params`` after pruning.
        num_params: prunable weights (all ``nn.Linear`` weights inside the block).
        num_zeros: weights equal to 0 after pruning.
        statistic: the allocator's per-block statistic (PALS percentile, OWL LOD in %,
            mean ``|dL/dW|``, random offset), ``None`` for uniform.
    """

    index: int
    target: float
    achieved: float
    num_params: int
    num_zeros: int
    statistic: float | None = None


@dataclass
class LinearSparsity:
    """One pruned linear: its module name in the model, block, weight shape ``[out, in]``."""

    name: str
    block: int
    shape: list[int]
    target: float
    num_zeros: int

    @property
    def num_params(self) -> int:
        return int(self.shape[0] * self.shape[1])

    @property
    def achieved(self) -> float:
        return self.num_zeros / self.num_params


@dataclass
class SparsityReport:
    """Result of one-shot pruning.

    Attributes:
        target_sparsity: the requested overall sparsity ``s``.
        allocation: ``"uniform" | "pals" | "owl" | "random" | "gradient"``.
        method: ``"wanda" | "sparsegpt" | "magnitude"``.
        pattern: ``None`` (unstructured) or ``"N:M"``.
        blocks: per-block targets and achieved sparsity, 0-based, in order.
        linears: per-linear achieved sparsity.
        allocator: allocator name, statistic name and definition, every allocator option
            (percentile, delta, mapping, scale, activation source, pooling, estimator and
            its error bound, OWL M and lambda, seeds), and the mean/min/max of the targets.
        options: every option ``sparsify`` ran with, defaults included.
        calibration: the calibration set's spec (description, content hash, prompts, tokens).
        metadata: timing (seconds), library versions, model class.
    """

    target_sparsity: float
    allocation: str
    method: str
    pattern: str | None
    blocks: list[BlockSparsity]
    linears: list[LinearSparsity]
    allocator: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def num_zeros(self) -> int:
        return sum(b.num_zeros for b in self.blocks)

    @property
    def achieved_sparsity(self) -> float:
        """Zeros / prunable weights over all blocks (parameter-weighted)."""
        return self.num_zeros / self.num_params

    @property
    def block_targets(self) -> list[float]:
        return [b.target for b in self.blocks]

    @property
    def block_sparsities(self) -> list[float]:
        """Achieved sparsity per block, 0-based."""
        return [b.achieved for b in self.blocks]

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        out = asdict(self)
        for b in out["blocks"]:
            for key in ("target", "achieved", "statistic"):
                b[key] = encode_float(b[key])
        out["achieved_sparsity"] = self.achieved_sparsity
        return out

    @classmethod
    def from_dict(cls, data: dict) -> SparsityReport:
        blocks = [
            BlockSparsity(
                index=int(b["index"]),
                target=decode_float(b["target"]),
                achieved=decode_float(b["achieved"]),
                num_params=int(b["num_params"]),
                num_zeros=int(b["num_zeros"]),
                statistic=decode_float(b["statistic"]),
            )
            for b in data["blocks"]
        ]
        linears = [
            LinearSparsity(
                name=r["name"],
                block=int(r["block"]),
                shape=[int(v) for v in r["shape"]],
                target=float(r["target"]),
                num_zeros=int(r["num_zeros"]),
            )
            for r in data["linears"]
        ]
        return cls(
            target_sparsity=float(data["target_sparsity"]),
            allocation=data["allocation"],
            method=data["method"],
            pattern=data.get("pattern"),
            blocks=blocks,
            linears=linears,
            allocator=data.get("allocator", {}),
            options=data.get("options", {}),
            calibration=data.get("calibration", {}),
            metadata=data.get("metadata", {}),
        )

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """JSON text; also written atomically to ``path`` when given."""
        data = self.to_dict()
        if path is not None:
            write_json_atomic(data, path)
        return json.dumps(data, indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> SparsityReport:
        """From JSON text or a path to a JSON file."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text(encoding="utf-8")
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ presentation
    def to_markdown(self) -> str:
        """A model-card section: settings, overall sparsity and a per-block table."""
        a = self.allocator
        lines = [
            "## Sparsity",
            "",
            f"One-shot {self.method} pruning, {self.pattern or 'unstructured'}, target {self.target_sparsity:.2%}, "
            f"{self.allocation} allocation; achieved {self.achieved_sparsity:.4%} of {self.num_params:,} "
            "prunable decoder-block weights (embeddings and LM head kept dense).",
            "",
        ]
        if a.get("statistic"):
            lines += [f"Allocator statistic: {a['statistic']}.", ""]
        lines += ["| block | target | achieved | statistic |", "|---:|---:|---:|---:|"]
        for b in self.blocks:
            stat = "" if b.statistic is None else f"{b.statistic:.4g}"
            lines.append(f"| {b.index} | {b.target:.4f} | {b.achieved:.4f} | {stat} |")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike) -> Path:
        """Per-block target and achieved sparsity as a PNG (needs matplotlib; the model
        card's plot, see :func:`hf_layerswap.card.write_sparsity_plot`)."""
        from ..card import write_sparsity_plot
        from . import config_record

        return write_sparsity_plot(config_record(self), path)
