"""SparsityReport: what :func:`~hf_layerswap.sparsity.sparsify` did, with an exact JSON round trip."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..utils.jsonio import JsonResult, decode_float, encode_float
from ..plots import write_sparsity_plot
from ..utils.provenance import __version__
from .registry import ALLOCATORS

__all__ = ["BlockSparsity", "LinearSparsity", "SparsityReport", "config_record"]


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
class SparsityReport(JsonResult):
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
        return write_sparsity_plot(config_record(self), path)


#: Allocator entries kept in the config record (the report has every one).
_ALLOCATOR_SUMMARY = ("statistic", "percentile", "source", "pool", "delta", "mapping", "owl_m", "owl_lambda", "budget")


def _record_keys(allocation: str) -> tuple[str, ...]:
    entry = ALLOCATORS.get(allocation)
    extra = tuple(k for k in entry.record_keys if k not in _ALLOCATOR_SUMMARY) if entry is not None else ()
    return _ALLOCATOR_SUMMARY + extra


def config_record(report: SparsityReport) -> dict:
    """The compact summary :func:`sparsify` stores in ``model.config.layerswap_sparsity``.

    Keys: ``method``, ``allocation``, ``pattern`` (``None`` = unstructured),
    ``target_sparsity``, ``achieved_sparsity`` (zeros / prunable block weights),
    ``num_params``, ``num_zeros``, ``original_blocks`` (0-based indices of the sparsified
    blocks before any layer removal), ``block_params`` (prunable weights), ``block_zeros``,
    ``block_targets`` and ``block_achieved`` (fractions), ``block_dense_params`` (block
    parameters that are not ``nn.Linear`` weight matrices, left dense: biases, norms, fused
    MoE expert tensors), one per block in the same order, ``allocator`` (its statistic, main options and budget
    rule), ``calibration`` (description and content hash) and
    ``hf_layerswap`` (the version that pruned). Every value is JSON (config.json) safe.
    """
    blocks = report.metadata.get("original_blocks") or [b.index for b in report.blocks]
    return {
        "method": report.method,
        "allocation": report.allocation,
        "pattern": report.pattern,
        "target_sparsity": report.target_sparsity,
        "achieved_sparsity": report.achieved_sparsity,
        "num_params": report.num_params,
        "num_zeros": report.num_zeros,
        "original_blocks": [int(i) for i in blocks],
        "block_params": [int(b.num_params) for b in report.blocks],
        "block_zeros": [int(b.num_zeros) for b in report.blocks],
        "block_dense_params": report.metadata.get("block_dense_params"),
        "block_targets": [float(b.target) for b in report.blocks],
        "block_achieved": [float(b.achieved) for b in report.blocks],
        "allocator": {k: report.allocator[k] for k in _record_keys(report.allocation) if k in report.allocator},
        "calibration": {k: report.calibration.get(k) for k in ("description", "content_hash") if k in report.calibration},
        "hf_layerswap": __version__,
    }
