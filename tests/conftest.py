"""Shared fixtures: tiny random models (fast unit tests), the real WikiText-2 text, and the
real pretrained SmolLM2-135M / Gemma-3-270M checkpoints (marked ``slow``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
WIKITEXT_VALID = SHARED_DATA / "wikitext-2" / "valid.txt"
WIKITEXT_TEST_RAW = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"

# Tiny-model forwards are dominated by threading overhead (and on a busy CPU, spin-waits
# make them far slower), so unit tests run on one thread; real-model tests (``slow``)
# use up to two cores.
REAL_MODEL_THREADS = max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _threads_per_test_kind(request):
    threads = REAL_MODEL_THREADS if request.node.get_closest_marker("slow") else 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(previous)


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


TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_config(family: str, num_layers: int = 6):
    """Config of a tiny random decoder of the given family (no download)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    if family == "llama":
        return LlamaConfig(num_hidden_layers=num_layers, **TINY_COMMON)
    if family == "qwen3":
        return Qwen3Config(
            num_hidden_layers=num_layers,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=num_layers // 2,
            layer_types=["sliding_attention" if i % 2 else "full_attention" for i in range(num_layers)],
            **TINY_COMMON,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            num_hidden_layers=num_layers,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention" if i % 3 != 2 else "full_attention" for i in range(num_layers)],
            **TINY_COMMON,
        )
    raise ValueError(f"unknown tiny family {family!r}")


def tiny_model(family: str = "llama", num_layers: int = 6, seed: int = 0):
    """A tiny random causal LM in eval mode, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, num_layers)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.eval()


def tiny_batch(batch: int = 3, length: int = 12, vocab: int = 128, seed: int = 1, pad_last: int = 3):
    """Random right-padded ids: the last row has ``pad_last`` padding positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad_last:
        mask[-1, length - pad_last :] = 0
        ids[-1, length - pad_last :] = 0
    return {"input_ids": ids, "attention_mask": mask}


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
