"""Resumable scoring: the folder of completed (batch, probe) values, each part written
atomically (the processes of a launched run write their own parts; see :mod:`.processes`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..utils.jsonio import atomic_path, write_json_atomic

__all__ = ["CHECKPOINT_FORMAT", "CheckpointMismatchError", "plans_digest", "ScoringCheckpoint"]


CHECKPOINT_FORMAT = "hf_layerswap.ScoringCheckpoint/1"


class CheckpointMismatchError(ValueError):
    """A scoring checkpoint was written by a different run (model, calibration or settings)."""


# ----------------------------------------------------------------------------- checkpoint
def plans_digest(keys) -> str:
    """SHA-256 (hex) of the sorted plan keys: which probes a checkpoint folder belongs to."""
    h = hashlib.sha256()
    for key in sorted(keys):
        h.update((",".join(map(str, key)) + ";").encode())
    return h.hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class ScoringCheckpoint:
    """A folder of completed (batch, probe) values: ``manifest.json`` (what run it belongs
    to) and one ``part-*.pt`` file per completed probe group of a batch, each written to a
    temporary file and renamed (a killed process leaves whole parts only)."""

    def __init__(self, path, fingerprint: dict, *, is_main: bool, barrier=None):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"checkpoint_path={str(path)!r} exists and is not a folder")
        manifest = self.path / "manifest.json"
        if is_main:
            for stale in self.path.glob(".part-*.tmp") if self.path.is_dir() else ():
                stale.unlink()  # left by a process killed while writing
            if manifest.is_file():
                self._check(manifest, fingerprint)
            else:
                self.path.mkdir(parents=True, exist_ok=True)
                write_json_atomic({"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint}, manifest)
        if barrier is not None:
            barrier()
        if not is_main:
            self._check(manifest, fingerprint)

    def _check(self, manifest: Path, fingerprint: dict) -> None:
        with open(manifest, encoding="utf-8") as fh:
            stored = json.load(fh)
        if stored.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointMismatchError(
                f"{manifest} is not a scoring checkpoint (format={stored.get('format')!r}, expected {CHECKPOINT_FORMAT!r})"
            )
        want = _flatten({k: v for k, v in fingerprint.items() if k != "info"})
        have = _flatten({k: v for k, v in stored.get("fingerprint", {}).items() if k != "info"})
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if diff:
            details = "; ".join(f"{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}" for k in diff[:6])
            raise CheckpointMismatchError(
                f"checkpoint {str(self.path)!r} was written by a different scoring run ({details}). Resume only with "
                "the same model, calibration prompts, probes and settings; use a new checkpoint_path to start over."
            )

    def load(self) -> dict[tuple[int, tuple[int, ...]], torch.Tensor]:
        done = {}
        for part in sorted(self.path.glob("part-*.pt")):
            data = torch.load(part, map_location="cpu", weights_only=True)
            batch = int(data["batch"])
            for key, row in zip(data["plans"], data["values"]):
                done[(batch, tuple(int(x) for x in key))] = row.clone()
        return done

    def save(self, batch: int, rank: int, group: int, keys: list[tuple[int, ...]], values: torch.Tensor) -> None:
        name = f"part-b{batch:06d}-r{rank:04d}-g{group:05d}.pt"
        with atomic_path(self.path / name) as tmp, open(tmp, "wb") as fh:
            torch.save({"batch": batch, "plans": [list(k) for k in keys], "values": values.cpu()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
