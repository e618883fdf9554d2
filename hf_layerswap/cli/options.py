"""What several ``hf-layerswap`` verbs share: argument types (a bad value exits 2 with an
``error:`` line), the model and calibration options, and the checks and loading that run
before a model is touched."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin, get_type_hints

from accelerate.utils import convert_file_size_to_int

from ..calibration import read_text_file
from ..config import FLAT_KEYWORDS, LayerSwapConfig, RecoveryConfig, SparsityConfig
from ..hub import save_for_hub
from ..utils.jsonio import regular_target
from ..models import BUNDLED, DTYPES, check_device_placement, check_gguf_file, is_hub_id, load_model, missing_offline
from ..scoring.settings import parse_memory

__all__ = [
    "HELP_FORMATTER",
    "INPUT_OPTIONS",
    "add_calibration_args",
    "add_config_options",
    "add_device_args",
    "add_model_args",
    "add_overwrite_arg",
    "add_resume_arg",
    "calibration_source",
    "check_before_loading",
    "check_devices",
    "check_output",
    "check_paths",
    "check_text_files",
    "cli_settings",
    "config_help",
    "count",
    "count_or_auto",
    "device_options",
    "fraction",
    "input_paths",
    "load",
    "max_memory_map",
    "needs_tokenizer",
    "positive_seconds",
    "prompt_count",
    "save_pruned",
]

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the appended ``(default: ...)`` where the help
    text already states its default or the default is ``None`` (nothing to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


#: The verbs' help formatter: every option's default shown once.
HELP_FORMATTER = HelpFormatter


def _config_field(kind, name: str):
    """``(owner dataclass, its field, the type hint)`` of ``name``: a field of ``kind``, or
    for :class:`~hf_layerswap.LayerSwapConfig` a flat keyword (its sub-config's field)."""
    if kind is LayerSwapConfig and name in FLAT_KEYWORDS:
        parent, name = FLAT_KEYWORDS[name]
        kind = {"recovery": RecoveryConfig, "sparsity": SparsityConfig}[parent]
    try:
        spec = kind.__dataclass_fields__[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a field of {kind.__name__}: allowed {list(kind.__dataclass_fields__)}") from None
    return kind, spec, get_type_hints(kind)[name]


def config_help(name: str) -> str:
    """The help text of the :class:`~hf_layerswap.LayerSwapConfig` field (or flat keyword,
    e.g. ``allocation``: its sub-config field's) that an option mirrors: the field's
    ``metadata["help"]`` is the one source of the text (followed by each registry entry's
    line, ``metadata["entries"]``, where the field has one).

    Raises:
        KeyError: ``name`` is neither a field nor a flat keyword.
    """
    return _field_help(_config_field(LayerSwapConfig, name)[1].metadata)


def _field_help(metadata: Mapping) -> str:
    """A field's help, then ``; name: line`` per registry entry of ``metadata["entries"]``
    (their ``%`` escaped: argparse formats help with ``%``)."""
    entries = metadata["entries"]() if "entries" in metadata else {}
    return metadata["help"] + "".join(f"; {name}: {line}".replace("%", "%%") for name, line in entries.items())


def cli_settings(kind=LayerSwapConfig) -> list[str]:
    """The fields of the config dataclass ``kind`` marked as command-line settings
    (``metadata["cli"]``), in field order; for :class:`~hf_layerswap.LayerSwapConfig`
    the flat keywords of sub-config fields so marked follow (e.g. ``allocation``)."""
    names = [f.name for f in dataclass_fields(kind) if f.metadata.get("cli")]
    if kind is LayerSwapConfig:
        names += [key for key in FLAT_KEYWORDS if _config_field(kind, key)[1].metadata.get("cli")]
    return names


def _option_kwargs(name: str, spec, hint, given_type=None) -> dict:
    """argparse keywords of one config field: ``type`` (an int with ``metadata["minimum"]``
    becomes :func:`count`), ``nargs="+"`` for a list, ``choices`` from ``metadata["choices"]``
    (a callable: the registry's names now) or a ``Literal`` type, ``default`` and ``help``
    (:func:`config_help`'s text); ``given_type`` replaces the built ``type``."""
    args = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) in (Union, UnionType) else [hint]
    base = args[0] if len(args) == 1 else hint
    out = {"help": _field_help(spec.metadata), "default": None if spec.default is MISSING else spec.default}
    if given_type is not None:
        out["type"] = given_type
    elif "choices" in spec.metadata:
        out["choices"] = list(spec.metadata["choices"]())
    elif get_origin(base) is Literal:
        out["choices"] = list(get_args(base))
    elif get_origin(base) is list and get_args(base) == (int,):
        out.update(type=int, nargs="+")
    elif base is int:
        out["type"] = count(spec.metadata["minimum"]) if "minimum" in spec.metadata else int
    elif base in (float, str):
        out["type"] = base
    else:
        raise TypeError(f"config field {name!r} of type {hint}: no command-line form; pass types={{{name!r}: ...}}")
    return out


def add_config_options(parser, names: Sequence[str], kind=LayerSwapConfig, *, types: Mapping | None = None,
                       options: Mapping | None = None) -> None:
    """Add one option per config field in ``names`` to ``parser`` (a parser or an argument
    group), built from the field: ``num_to_remove`` -> ``--num-to-remove``, its type (an int
    with a ``minimum`` is checked, a list takes ``nargs="+"``), its default, its choices (a
    ``Literal`` type, or the registry's names now for a field with ``metadata["choices"]``)
    and its ``metadata["help"]``. For :class:`~hf_layerswap.LayerSwapConfig` a name may be a
    flat keyword (``allocation``, ``sparsity_pattern``): the option is its sub-config field's.

    Args:
        parser: an ``argparse.ArgumentParser`` or group (e.g. a mutually exclusive one).
        names: field names (or flat keywords) of ``kind``.
        kind: the config dataclass (:class:`~hf_layerswap.LayerSwapConfig`,
            :class:`~hf_layerswap.config.RecoveryConfig`, :class:`~hf_layerswap.config.SparsityConfig`).
        types: ``{name: argparse type}`` where the field's type has no command-line form
            (e.g. ``sparsity``: :func:`fraction`).
        options: ``{name: {add_argument keyword: value}}`` that replace the built ones
            (e.g. ``{"protect": {"nargs": "*"}}``).

    Raises:
        KeyError: a name that is not a field (the message lists the fields).
        TypeError: a field whose type has no command-line form and no ``types`` entry.
    """
    types, options = dict(types or {}), dict(options or {})
    for name in names:
        _, spec, hint = _config_field(kind, name)
        kwargs = _option_kwargs(name, spec, hint, types.get(name))
        kwargs.update(options.get(name, {}))
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def count(minimum: int):
    """argparse ``type=``: an int >= ``minimum`` (a bad value exits 2 with an ``error:`` line)."""

    def parse(text):
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an int; expected an int >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an int >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def count_or_auto(text):
    """argparse ``type=`` of the demo's --num-prompts: ``auto`` or an int >= 1."""
    return text if text == "auto" else count(1)(text)


def fraction(text):
    """argparse ``type=``: a float in [0, 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected a float in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a float in [0, 1)")
    return value


def positive_seconds(text):
    """argparse ``type=``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected finite seconds > 0") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite seconds > 0")
    return value


def add_model_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """MODEL (unless ``positional=False``), --gguf-file, --revision, --tokenizer and
    :func:`add_device_args`."""
    if positional:
        p.add_argument("model", help="local checkpoint dir, GGUF file, Hub id, or a bundled name (smollm2-135m, gemma3-270m)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (dequantized on load)")
    p.add_argument("--revision", default=None, help="Hub revision")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id, for a checkpoint that has none (default: the model's own)")
    add_device_args(p)


def max_memory_map(text) -> dict:
    """argparse ``type=`` of --max-memory: accelerate's per-device limits, ``0=20GiB,cpu=60GiB``
    -> ``{0: "20GiB", "cpu": "60GiB"}`` (a GPU index becomes an int; each size is checked
    with accelerate's own parser)."""
    limits: dict = {}
    for item in str(text).split(","):
        device, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not device or not size:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected DEVICE=SIZE pairs separated by commas, e.g. 0=20GiB,cpu=60GiB")
        try:
            if not size.isdigit():  # bytes as a plain int, else a size with its unit
                convert_file_size_to_int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: size {size!r} of {device!r} is not a size; expected e.g. 20GiB, 500MB or bytes") from None
        key = int(device) if device.isdigit() else device
        if key in limits:
            raise argparse.ArgumentTypeError(f"{text!r}: device {device!r} is given twice; give each device once")
        limits[key] = int(size) if size.isdigit() else size
    return limits


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --device-map and --max-memory (what :func:`~hf_layerswap.models.load_model` takes)."""
    p.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="parameter dtype; 'auto' = the checkpoint's own (GGUF input: fp32, its dequantized values)")
    p.add_argument("--device-map", default="auto",
                   help="accelerate device map ('auto', 'cpu', 'cuda:0', 'balanced', 'sequential'); 'auto' "
                        "spreads the model over the accelerators when one is present (and over --max-memory), "
                        "else keeps it in CPU memory")
    p.add_argument("--max-memory", type=max_memory_map, default=None,
                   help="per-device memory for the device map, accelerate's format: 0=20GiB,cpu=60GiB")
    p.add_argument("--offload-folder", default=None, metavar="DIR",
                   help="folder for the blocks the device map puts on disk (when --max-memory leaves no room)")


def device_options(args) -> dict:
    """``dtype``, ``device_map``, ``max_memory`` and ``offload_folder`` of :func:`add_device_args`
    for ``load_model``."""
    options = {"dtype": getattr(args, "dtype", "auto"), "device_map": getattr(args, "device_map", "auto"),
               "max_memory": getattr(args, "max_memory", None)}
    if getattr(args, "offload_folder", None) is not None:
        options["offload_folder"] = args.offload_folder
    return options


def add_calibration_args(p: argparse.ArgumentParser, *, num_prompts_default="64") -> None:
    """--calibration, --num-prompts (``"auto"`` as default: also 'auto'), --seq-len, --batch-size, --seed."""
    p.add_argument(
        "--calibration", default="embedded",
        help="calibration text: a text file (e.g. WikiText-2 valid.txt) or 'embedded' (prose shipped with Python)",
    )
    auto = num_prompts_default == "auto"
    num_prompts = {"default": num_prompts_default}
    if auto:
        num_prompts.update(type=count_or_auto, help=config_help("num_prompts") + ", or 'auto' to fit --time-budget")
    add_config_options(p, ["num_prompts", "seq_len", "batch_size", "seed"], options={"num_prompts": num_prompts})


def scoring_memory(text):
    """argparse ``type=`` of --scoring-memory: ``auto`` or a size such as ``2GiB``."""
    if text == "auto":
        return text
    try:
        parse_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or a size of at least 1MiB such as 800MiB or 2GB") from None
    return text


def add_scoring_memory_arg(p: argparse.ArgumentParser) -> None:
    """--scoring-memory: the scoring engine's working-memory budget (``max_memory``)."""
    p.add_argument("--scoring-memory", type=scoring_memory, default="auto",
                   help="working memory of scoring beyond the weights, e.g. 2GiB; auto = a share of the device's "
                        "free memory (at most 1 GiB on a CPU, 8 GiB on an accelerator)")


def prompt_count(value) -> int:
    """--num-prompts as an int (argparse has checked it; a direct caller gets ValueError)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1") from None
    if n < 1:
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1")
    return n


def add_resume_arg(p: argparse.ArgumentParser) -> None:
    """--resume DIR: the scoring checkpoint folder (``score_layers(checkpoint_path=...)``)."""
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="scoring checkpoint folder (created if missing): completed probes are kept there as they "
                        "finish, and the same command with the same DIR after an interruption continues where it "
                        "stopped")


def check_paths(*, model=None, revision=None, gguf_file=None, tokenizer=None, inputs=(), outputs=(), reads=(),
                overwrite: bool = False) -> None:
    """Every path a verb reads or writes, checked before any model loads (the CLI prints
    each refusal as one ``error:`` line and exits 2). The one output policy of every verb:

    - an output is never an input, nor inside a folder the run reads (MODEL's checkpoint
      folder, ``--tokenizer``, an input folder), not even with ``--overwrite``; outputs
      are compared after following symbolic links, so a link to an input is refused too;
    - two outputs are never the same path, and none is inside another's folder;
    - a ``"file"`` output that exists is refused unless ``overwrite``; one that is not a
      regular file (a device node, a FIFO, a folder) is always refused; a symbolic link
      is written through (:func:`~hf_layerswap.utils.jsonio.regular_target`);
    - every output must be creatable and writable.

    Args:
        model: MODEL: a bundled name, a local folder or ``.gguf`` file (read as GGUF
            here, :func:`~hf_layerswap.models.check_gguf_file`), or a Hub id (refused
            while ``HF_HUB_OFFLINE=1`` unless it is in the local cache).
        revision, gguf_file: MODEL's ``--revision`` and ``--gguf-file``.
        tokenizer: ``--tokenizer``: an existing folder or a Hub id (``None``: none given).
        inputs: ``(option, path)`` pairs of files or folders that must exist; ``None``
            paths are skipped.
        outputs: ``(option, path, kind)`` triples of what will be written, ``kind`` one of
            ``"file"`` (its folder may be created), ``"new folder"`` (must not exist or be
            empty) and ``"folder"`` (may hold files, e.g. a checkpoint to resume);
            ``None`` paths are skipped. Each must be creatable and writable, tested by
            creating (and removing) a temporary file in the nearest existing folder.
        reads: ``(option, path)`` pairs of other paths the run reads (checked elsewhere,
            e.g. the text files): outputs may not be them or lie inside them. Missing or
            ``None`` ones are skipped.
        overwrite: ``--overwrite``: a ``"file"`` output may replace an existing file.

    Raises:
        FileNotFoundError: a missing input, a local MODEL or ``--tokenizer`` that does not exist.
        FileExistsError: a ``"new folder"`` output that exists and is not empty, a
            ``"file"`` output that exists (without ``overwrite``) or is a folder.
        ValueError: an output that cannot be written (a read-only folder, a file on its
            path, a folder where a file goes, a device node), an output that is an input,
            inside a folder the run reads or inside another output, a corrupt GGUF file, a
            Hub id while offline.
    """
    if model is not None:
        _check_model(model, revision, gguf_file)
    if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
        if not is_hub_id(tokenizer):
            raise FileNotFoundError(f"--tokenizer {tokenizer!r} is not a folder, and not a Hub id of the form 'owner/name'")
        _check_reachable("--tokenizer", tokenizer, None, "tokenizer_config.json")
    for option, path in inputs:
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{option} {os.fspath(path)!r} does not exist")
    read = _read_paths(model, gguf_file, tokenizer, [*inputs, *reads])
    written: list[tuple[str, Path, str]] = []
    for option, path, kind in outputs:
        if path is None:
            continue
        path = Path(path)
        where = _output_target(option, path, kind)
        even = " (not even with --overwrite)" if kind == "file" else ""
        for other, source in read:
            if where == source:
                raise ValueError(f"{option} {os.fspath(path)} is {other} {source}, which this run reads: an output "
                                 f"never replaces an input{even}; choose another path")
            if source in where.parents and source.is_dir():
                raise ValueError(f"{option} {os.fspath(path)} is inside {other} {source}, a folder this run reads: "
                                 f"nothing is written into an input{even}; choose a path outside it")
        for other, earlier, earlier_kind in written:
            if where == earlier or (earlier_kind != "file" and earlier in where.parents):
                raise ValueError(f"{option} {os.fspath(path)} is {other} {earlier} or inside it: each output needs "
                                 "a path of its own; choose another")
            if kind != "file" and where in earlier.parents:
                raise ValueError(f"{other} {earlier} is inside {option} {os.fspath(path)}: each output needs a path "
                                 "of its own; choose another")
        _check_writable(option, path, kind, where, overwrite)
        written.append((option, where, kind))


def _output_target(option, path: Path, kind: str) -> Path:
    """Where ``path`` writes, symbolic links followed; a ``"file"`` output that is a folder,
    a device node, a FIFO or a socket is refused (:func:`~hf_layerswap.utils.jsonio.regular_target`)."""
    if kind != "file":
        return Path(os.path.realpath(path))
    try:
        return regular_target(path)
    except FileExistsError:
        raise FileExistsError(f"{option} {path} is a folder; give the file's path, e.g. {path / 'result.json'}") \
            from None
    except ValueError as err:
        raise ValueError(f"{option} {err}") from None


def _read_paths(model, gguf_file, tokenizer, inputs) -> list[tuple[str, Path]]:
    """``(option, resolved path)`` of every local path the run reads: MODEL (its folder or
    GGUF file), ``--gguf-file`` inside it, a ``--tokenizer`` folder and the given inputs."""
    paths = [("MODEL", model), ("--tokenizer", tokenizer), *inputs]
    if model is not None and gguf_file is not None:
        paths.append(("--gguf-file", Path(model).expanduser() / gguf_file))
    found = []
    for option, path in paths:
        if path is None or (option == "MODEL" and path in BUNDLED):
            continue
        path = Path(path).expanduser()
        if path.exists():
            found.append((option, Path(os.path.realpath(path))))
    return found


def _check_model(model, revision, gguf_file) -> None:
    path = Path(model).expanduser()
    if model in BUNDLED:
        return
    if path.is_file() and path.suffix == ".gguf":
        check_gguf_file(path)
    elif path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise FileNotFoundError(f"--gguf-file {gguf_file!r} is not a file in {model}")
            check_gguf_file(path / gguf_file)
    elif is_hub_id(model):
        _check_reachable("MODEL", model, revision, gguf_file or "config.json")
    else:
        raise FileNotFoundError(
            f"MODEL {model!r} is not a bundled name (allowed: {sorted(BUNDLED)}), an existing folder or .gguf file, "
            "or a Hub id of the form 'owner/name'"
        )


def _check_reachable(option, repo_id, revision, filename) -> None:
    if missing_offline(repo_id, revision, filename):
        raise ValueError(
            f"{option} {repo_id!r} is a Hub id, but the Hub is switched off (HF_HUB_OFFLINE=1) and {filename} of it is "
            "not in the local cache: unset HF_HUB_OFFLINE to download it, or give a local folder"
        )


def _check_writable(option, path: Path, kind: str, target: Path, overwrite: bool) -> None:
    """``path`` (written at ``target``, :func:`_output_target`) exists only where allowed,
    and its folder takes new files."""
    if kind == "file" and target.exists() and not overwrite:
        raise FileExistsError(f"{option} {path} exists; pass --overwrite to replace it, or choose another path")
    if kind == "new folder":
        check_output(path, option)
    elif kind == "folder" and path.exists() and not path.is_dir():
        raise FileExistsError(f"{option} {path} is a file; give a folder")
    where = target if target.is_dir() else target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ValueError(f"{option} {path} cannot be created: {where} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(prefix=".hf_layerswap-probe-", dir=where):
            pass
    except OSError as err:
        raise ValueError(f"{option} {path} cannot be written: {where} refuses new files ({err.strerror}); "
                         "choose a writable folder") from None


def check_text_files(args) -> None:
    """Refuse a --calibration, --eval-text or healing --perplexity text that is missing or not
    UTF-8 text, and a healing task folder that is not a folder, before the model loads."""
    for flag, option in (("calibration", "--calibration"), ("eval_text", "--eval-text"),
                         ("perplexity_text", "--perplexity"), ("heal_perplexity_text", "--heal-perplexity")):
        value = getattr(args, flag, None) or "embedded"
        if value != "embedded":
            if not Path(value).is_file():
                raise FileNotFoundError(f"{option} {value!r} is not a file; give a text file or 'embedded'")
            read_text_file(value, option)
    for flag, option in (("eval_tasks_path", "--eval-tasks-path"), ("heal_eval_tasks_path", "--heal-eval-tasks-path")):
        value = getattr(args, flag, None)
        if value is not None and not Path(value).is_dir():
            raise FileNotFoundError(f"{option} {value!r} is not a folder; give a folder of lm-eval task YAML files")


#: ``(attribute, option)`` of the input files and folders the verbs read besides MODEL and
#: ``--tokenizer``: no output may be one of them or lie inside one (:func:`check_paths`).
INPUT_OPTIONS = (("calibration", "--calibration"), ("eval_text", "--eval-text"), ("text", "--text"),
                 ("perplexity_text", "--perplexity"), ("heal_perplexity_text", "--heal-perplexity"),
                 ("report", "--report"), ("eval_tasks_path", "--eval-tasks-path"),
                 ("heal_eval_tasks_path", "--heal-eval-tasks-path"), ("include_path", "--include-path"))


def input_paths(args) -> list[tuple[str, str | os.PathLike]]:
    """``(option, path)`` of every input file or folder among ``args``'
    :data:`INPUT_OPTIONS` (``embedded`` and unset ones left out; a list option gives one
    pair per path)."""
    found: list[tuple[str, str | os.PathLike]] = []
    for attribute, option in INPUT_OPTIONS:
        value = getattr(args, attribute, None)
        for path in value if isinstance(value, list) else [value]:
            if isinstance(path, (str, os.PathLike)) and path != "embedded":
                found.append((option, path))
    return found


def add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    """--overwrite: a verb's output file may replace an existing file (never an input)."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (an input, or a file inside MODEL's folder, is never "
                        "replaced)")


def check_devices(args) -> None:
    """``--device-map`` and ``--max-memory`` name devices this machine has
    (:func:`~hf_layerswap.models.check_device_placement`), checked before the model loads."""
    check_device_placement(getattr(args, "device_map", "auto"), getattr(args, "max_memory", None),
                           names=("--device-map", "--max-memory"))


def check_before_loading(args, outputs=()) -> None:
    """What a verb that loads ``args.model`` with :func:`load` checks first: its text files
    (:func:`check_text_files`), then MODEL, ``--tokenizer`` and ``outputs`` against them and
    the other inputs (:func:`check_paths`, :func:`input_paths`; ``args.overwrite`` where the
    verb has ``--overwrite``)."""
    check_text_files(args)
    check_devices(args)
    offload = getattr(args, "offload_folder", None)
    check_paths(model=args.model, revision=args.revision, gguf_file=args.gguf_file, tokenizer=args.tokenizer,
                outputs=[*outputs, ("--offload-folder", offload, "folder")], reads=input_paths(args),
                overwrite=getattr(args, "overwrite", False))


def load(args):
    """``(model, tokenizer)`` of ``args.model`` (call :func:`check_before_loading` first)."""

    name = getattr(args, "model", None)
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    return load_model(name, gguf_file=args.gguf_file, revision=args.revision, tokenizer=getattr(args, "tokenizer", None),
                      **device_options(args))


def calibration_source(value: str):
    """--calibration as a config value: ``embedded`` is the default source (``None``)."""
    return None if value == "embedded" else value


def needs_tokenizer(tokenizer, model_name, what: str) -> None:
    """Refuse a missing tokenizer, naming ``what`` needs it and the --tokenizer fix."""
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer and the checkpoint {model_name!r} has none: "
                         "pass --tokenizer with a tokenizer folder or Hub id")


def check_output(output, option: str = "output") -> None:
    """Refuse an output folder that exists and is not empty (before any model loads)."""
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"{option} {output} exists and is not an empty folder; choose another or remove it")


def save_pruned(model, tokenizer, report, output: Path, evaluation: dict | None = None) -> Path:
    """The checkpoint, tokenizer, card, report sidecar and plots, written atomically."""
    check_output(output)
    return save_for_hub(model, output, tokenizer=tokenizer, report=report, evaluation=evaluation)
