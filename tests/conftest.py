"""Shared fixtures: tiny random models (fast unit tests, built from the one table of tiny
models, ``arch_matrix.py``), the real WikiText-2 text, the real pretrained
SmolLM2-135M / Gemma-3-270M checkpoints (marked ``slow``), and the helpers several
component test modules share (short texts, a model snapshot, a forward-pass counter, a
recorder of progress bars, a model whose scores overflow)."""

from __future__ import annotations

import copy
import math
import os
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import hf_layerswap as hl
from hf_layerswap.calibration import CalibrationSet
from hf_layerswap.layerplan import decoder_blocks
from arch_matrix import FAMILY_BY_NAME, VOCAB, alternating_types, build, prompts, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
WIKITEXT_VALID = SHARED_DATA / "wikitext-2" / "valid.txt"
WIKITEXT_TEST_RAW = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"

# Tiny-model forwards are dominated by threading overhead (and on a busy CPU, spin-waits
# make them far slower), so unit tests run on one thread; real-model tests (``slow``)
# use up to two cores, shared out between the workers when pytest-xdist runs the suite
# (README command 2: ``-n 2``, one thread a worker on two cores). The processes the tests
# start get the same share unless the environment or the test names one.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
REAL_MODEL_THREADS = max(1, min(2, (os.cpu_count() or 1) // XDIST_WORKERS))
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(REAL_MODEL_THREADS))
torch.set_num_threads(1)


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported as the module ``<name>_benchmark`` (a fresh copy each
    call, registered in ``sys.modules``), with ``benchmarks/`` on the import path for its own
    imports (``runner``, ``wikitext``)."""
    import importlib.util

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _threads_per_test_kind(request):
    threads = REAL_MODEL_THREADS if request.node.get_closest_marker("slow") else 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """Every test leaves the method registries as it found them: a strategy, repair, pruner or
    other entry a test registers for itself is gone from every table afterwards (a leaked one
    would reach the next tests' choices, docs tables and registry checks)."""
    import hf_layerswap  # noqa: F401  (registers the built-ins)
    from hf_layerswap.selection import registry as strategies
    from hf_layerswap.utils.registry import Registry

    tables = [*Registry.ALL.values(), strategies.STRATEGIES, strategies.STRATEGY_OPTIONS]
    saved, models, kinds = [dict(table) for table in tables], set(strategies.MODEL_STRATEGIES), dict(Registry.ALL)
    yield
    if Registry.ALL != kinds:  # a registry a test made for itself
        Registry.ALL.clear()
        Registry.ALL.update(kinds)
    for table, entries in zip(tables, saved):
        if dict(table) != entries:
            table.clear()
            dict.update(table, entries)
    if strategies.MODEL_STRATEGIES != models:
        strategies.MODEL_STRATEGIES.clear()
        strategies.MODEL_STRATEGIES.update(models)


def _need_shared(path: Path) -> Path:
    if path.is_file():
        return path
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"shared data file {path} is missing; under CI its absence is a failure")
    pytest.skip(f"shared data file {path} is absent on this machine (real WikiText-2 text needed)")


@pytest.fixture(scope="session")
def wikitext_valid() -> Path:
    """WikiText-2 validation split (tokenized release): calibration text."""
    return _need_shared(WIKITEXT_VALID)


@pytest.fixture(scope="session")
def wikitext_test_raw() -> Path:
    """WikiText-2 raw test split: evaluation text."""
    return _need_shared(WIKITEXT_TEST_RAW)


#: The unit tests' family names and the rows of the architecture matrix
#: (``arch_matrix.FAMILIES``) they build.
TINY_FAMILIES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def tiny_overrides(family: str, num_blocks: int) -> dict:
    """Where the unit tests' models differ from their matrix row:

    - 128 positions (the row has 64): perplexity refuses a window past
      ``max_position_embeddings`` and the rolling contract and lm-eval default to it, so
      the unit tests' windows and recorded contracts rest on it;
    - qwen3 starts with a full-attention block (the row starts with a sliding one);
      sliding and full still alternate, window 4.
    """
    overrides = {"max_position_embeddings": 128}
    if family == "qwen3":
        overrides["layer_types"] = alternating_types(num_blocks, first="full_attention")
    return overrides


def _row(family: str) -> str:
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}")
    return TINY_FAMILIES[family]


def tiny_config(family: str, num_blocks: int = 6, **overrides):
    """Config of a tiny random decoder of the given family (no download): its matrix row
    with :func:`tiny_overrides`, then ``overrides`` (config fields a test sets itself)."""
    return FAMILY_BY_NAME[_row(family)].config(num_blocks, **{**tiny_overrides(family, num_blocks), **overrides})


def tiny_model(family: str = "llama", num_blocks: int = 6, seed: int = 0, **overrides):
    """A tiny random causal LM in eval mode, fp32, eager attention (the config records no
    dtype); ``overrides`` as for :func:`tiny_config`."""
    return build(_row(family), num_blocks, seed, dtype=None, **{**tiny_overrides(family, num_blocks), **overrides})


def pruned_pair(removed=(2, 3)):
    """(student, teacher): a 6-block tiny Llama (seed 0) and a copy with ``removed`` cut, for healing."""
    teacher = tiny_model("llama", num_blocks=6, seed=0)
    student = copy.deepcopy(teacher)
    hl.remove_layers(student, list(removed))
    return student, teacher


def eight_block_search_setup():
    """An 8-block random Llama (seed 0), its six 16-token prompts (one padded from position 10)
    and their swap-KL report: the model on which the paper's greedy rule misses the best pair
    (tests/test_search.py), and whose search costs tests/test_reference_cache.py pins."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (6, 16))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    calib = CalibrationSet(ids, mask, "random tokens")
    return model, calib, hl.score_layers(model, calib, progress=False)


def tiny_checkpoint(path, model=None):
    """Save ``model`` (default: a tiny qwen3) with a word-level tokenizer of its vocabulary
    (tokens ``w0``, ``w1``, ...) into ``path``; returns the model."""
    model = tiny_model("qwen3") if model is None else model
    vocab = {f"w{i}": i for i in range(model.config.vocab_size - 1)}
    vocab["[UNK]"] = model.config.vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def tiny_batch(batch: int = 3, length: int = 12, vocab: int = VOCAB, seed: int = 1, pad_last: int = 3):
    """Random right-padded ids below ``vocab``: the last row has ``pad_last`` padding positions."""
    return prompts(batch, length, seed, pad_last, high=vocab)


def nonfinite_report():
    """A hand-built report of 6 blocks (neighbour pairs only) whose finite values are easy
    to order by hand, with an infinite interchange KL (pair 3-4) and a NaN replacement KL
    (pair 4-5); the report and selection tests work its numbers out in comments."""
    from hf_layerswap.scoring.report import PairResult, SwapReport

    pairs = [
        PairResult(0, 1, 5.0, 4.0, 3.0),
        PairResult(1, 2, 0.30, 0.10, 0.05),
        PairResult(2, 3, 0.20, 0.40, 0.01),
        PairResult(3, 4, 0.02, 0.03, math.inf),
        PairResult(4, 5, math.nan, 0.5, 0.02),
    ]
    return SwapReport(6, pairs, metadata={"note": "hand"})


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, dequantized and cached."""
    from hf_layerswap.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_270m():
    """(model, tokenizer) of the real Gemma-3-270M, dequantized and cached."""
    from hf_layerswap.models import load_model

    return load_model("gemma3-270m")


def counted_prune(cfg: LlamaConfig, config, calibration) -> tuple[int, int]:
    """(decoder-block forward calls, output-head calls) that forward hooks count in the real
    ``hl.prune`` of a fresh model of ``cfg`` (seed 1); a healing teacher, a deep copy of the
    model, carries the hooks too."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg.__class__.from_dict(cfg.to_dict())).eval()
    counts = {"block": 0, "head": 0}
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: counts.__setitem__("block", counts["block"] + 1))
    model.lm_head.register_forward_hook(lambda *_: counts.__setitem__("head", counts["head"] + 1))
    hl.prune(model, config, calibration=calibration)
    return counts["block"], counts["head"]


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of CPU tensor storages made while it is active (every aten call's
    outputs, each storage once, freed when its last tensor goes): what torch allocates on
    the CPU for a step, independent of the machine's resident-memory accounting. Storages
    made inside one kernel and freed before it returns are not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def head_offloaded_llama(folder: Path, num_prompts: int = 8, seq_len: int = 160):
    """``(dense, offloaded, calibration)``: a tiny Llama (4 blocks, hidden 64, a 4,096-entry
    vocabulary, untied head; seed 0) in memory and the same weights reloaded with its output
    head and blocks 2-3 on disk, 0-1 in CPU memory (accelerate ``device_map``,
    ``offload_folder``), and ``num_prompts`` random prompts of ``seq_len`` tokens, the last
    padded from position 100."""
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(config).eval()
    dense.save_pretrained(folder / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk",
                  **{f"model.layers.{i}": "cpu" if i < 2 else "disk" for i in range(4)}}
    from transformers import AutoModelForCausalLM

    offloaded = AutoModelForCausalLM.from_pretrained(folder / "ckpt", device_map=device_map,
                                                     offload_folder=str(folder / "offload")).eval()
    ids = torch.randint(0, 4096, (num_prompts, seq_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, 100:] = 0
    return dense, offloaded, CalibrationSet(ids, mask, "random tokens")


class HeadReads:
    """Context manager counting the reads of an offloaded module's weight: the rows
    :class:`~hf_layerswap.utils.devices.OffloadedTensor` returns for the tensor named ``key``
    (``rows``), and the calls of accelerate's own hook that would load it whole
    (``hook_loads``, its ``pre_forward``)."""

    def __init__(self, module: torch.nn.Module, key: str = "lm_head.weight"):
        self.module, self.key = module, key
        self.rows = self.hook_loads = 0

    def __enter__(self):
        from hf_layerswap.utils.devices import OffloadedTensor

        self._patch = pytest.MonkeyPatch()
        rows = OffloadedTensor.rows

        def counted(reader, ranges):
            if reader.key == self.key:
                self.rows += sum(b - a for a, b in ranges)
            return rows(reader, ranges)

        hook = self.module._hf_hook
        pre = hook.pre_forward

        def pre_forward(module, *args, **kwargs):
            self.hook_loads += 1
            return pre(module, *args, **kwargs)

        self._patch.setattr(OffloadedTensor, "rows", counted)
        self._patch.setattr(hook, "pre_forward", pre_forward)
        return self

    def __exit__(self, *exc):
        self._patch.undo()
        return False


# --------------------------------------------------------------------------- shared by component tests

#: Three one-line prompts of different lengths (the character tokenizer pads the shorter two).
SHORT_TEXTS = [
    "Layer removal keeps the kept blocks in order.",
    "A swap probe runs the model under a plan.",
    "The cache is indexed by the layer index.",
]

#: Six paragraphs of real prose (each over 80 characters): a calibration or evaluation text file.
PARAGRAPHS = [
    "Layer removal keeps the kept blocks in order, and the cache is renumbered after the cut.",
    "A swap probe runs the model under a temporary plan and restores the original plan exactly.",
    "Interchange swaps two neighbouring blocks; replacement runs one block twice in a row here.",
    "The calibration prompts are real prose, split at blank lines and truncated to a budget.",
    "Perplexity is measured in sliding windows, and only the new tokens of a window are scored.",
    "A model card records the removed blocks, the scores of both protocols and the contract.",
]


def write_paragraphs(path: Path, paragraphs=PARAGRAPHS) -> Path:
    """``paragraphs`` as a UTF-8 text file, one blank line between them (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


def random_bytes(n: int) -> list[int]:
    """``n`` bytes (0..255) from a seeded generator: a file that is not text."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def matrix_llama():
    """The 6-block Llama row of ``arch_matrix`` (vocabulary 128, 64 positions), shared by a
    module's tests that leave it as it was; a test that changes a model builds its own."""
    return build("llama")


@pytest.fixture(scope="module")
def matrix_report(matrix_llama):
    """The swap-KL report of :func:`matrix_llama` on ``arch_matrix.prompts()``."""
    return hl.score_layers(matrix_llama, prompts(), batch_size=2, progress=False)


@pytest.fixture(scope="module")
def matrix_tokenizer():
    """The character-level tokenizer of the ``arch_matrix`` models (one token per character)."""
    return tiny_tokenizer()


def snapshot_model(model) -> dict:
    """Everything a refused call or a probe must leave untouched: the weights, the config,
    the decoder's block objects in order and every ``layer_idx`` by module name."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "config": copy.deepcopy(model.config.to_dict()),
        "blocks": list(decoder_blocks(model)[2]),
        "layer_idx": [(name, m.layer_idx) for name, m in model.named_modules()
                      if isinstance(getattr(m, "layer_idx", None), int)],
    }


def assert_model_unchanged(model, snap: dict) -> None:
    """``model`` is as :func:`snapshot_model` recorded it, weights bit for bit."""
    now = snapshot_model(model)
    assert now["config"] == snap["config"]
    assert now["blocks"] == snap["blocks"]
    assert now["layer_idx"] == snap["layer_idx"]
    assert now["state"].keys() == snap["state"].keys()
    for k, v in snap["state"].items():
        assert torch.equal(now["state"][k], v), k


def count_forwards(model) -> tuple[list, object]:
    """(calls, handle): ``calls`` gains an entry per forward pass of ``model`` until
    ``handle.remove()``."""
    calls: list = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.fixture
def progress_bars(monkeypatch):
    """Every tqdm bar opened through ``tqdm.auto`` while the test runs: its description,
    total and each update, in order."""
    import tqdm.auto

    opened: list = []

    class Recording(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates: list = []
            opened.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    for name, module in list(sys.modules.items()):  # modules that imported the class itself
        if name.startswith("hf_layerswap") and getattr(module, "tqdm", None) is tqdm.auto.tqdm:
            monkeypatch.setattr(module, "tqdm", Recording)
    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    return opened


#: The advice every non-finite refusal and warning ends with (a regular expression).
NONFINITE_ADVICE = (r"non-finite values are reported, never a basis for removal: load the model in float32 "
                    r"\(from_pretrained\(\.\.\., dtype=torch\.float32\), or --dtype float32 on the command line\) "
                    r"or score on another calibration set")


def overflowing_model(dtype=torch.float16, scale=300.0, family="llama"):
    """A tiny model whose block 3 MLP overflows (fp16 max is 65504): the model's own output is NaN."""
    model = tiny_model(family).to(dtype)
    with torch.no_grad():
        for p in model.model.layers[3].mlp.parameters():
            p.mul_(scale)
    return model


@pytest.fixture(scope="module")
def overflow():
    """(model, calibration, report): :func:`overflowing_model` in fp16, four 12-token prompts
    and its swap-KL report, every value NaN (scored without the non-finite warning)."""
    model, calibration = overflowing_model(), tiny_batch(4, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hl.NonFiniteScoresWarning)
        warnings.simplefilter("ignore", hl.CalibrationShortfallWarning)
        return model, calibration, hl.score_layers(model, calibration, progress=False)


def prune_help(capsys) -> str:
    """``hf-layerswap prune --help`` as one line (argparse's wrapping undone)."""
    from hf_layerswap.cli import main

    with pytest.raises(SystemExit):
        main(["prune", "--help"])
    return " ".join(capsys.readouterr().out.split())
