"""Hand-built swap report and pruned tiny model shared by the card and Hub tests.

The report's numbers are chosen so that the two protocols pick different sets at a budget
of 2 (spacing 1, first and last block protected), worked out by hand:

pair   repl i<-j  repl j<-i  repl (max)  interchange  I/R
0-1    0.50       0.40       0.50        0.30         0.600
1-2    0.20       0.25       0.25        0.05         0.200
2-3    0.10       0.12       0.12        0.08         0.667
3-4    0.30       0.35       0.35        0.02         0.0571
4-5    0.60       0.45       0.60        0.04         0.0667

replacement s(i) = [0.50, 0.25, 0.12, 0.12, 0.35, 0.60]: ascending 2, 3 (adjacent to 2:
skipped), 1 (adjacent: skipped), 4 -> {2, 4}.
interchange s(i) = [0.30, 0.05, 0.05, 0.02, 0.02, 0.04]: 3, 4 (adjacent: skipped), 5
(protected), 1 -> {1, 3}.
"""

from __future__ import annotations

import copy
import math

import pytest

from conftest import tiny_model

from hf_layerswap import SwapReport, remove_layers
from hf_layerswap.scoring.report import PairResult

PAIR_VALUES = {
    (0, 1): (0.50, 0.40, 0.30),
    (1, 2): (0.20, 0.25, 0.05),
    (2, 3): (0.10, 0.12, 0.08),
    (3, 4): (0.30, 0.35, 0.02),
    (4, 5): (0.60, 0.45, 0.04),
}
REPLACEMENT_SET, INTERCHANGE_SET = [2, 4], [1, 3]
REMOVAL_KL = {"1,3": 0.011, "2,4": 0.027}
CONTENT_HASH = "0123456789abcdef" * 4
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The shape of hf_layerswap.evaluation's contract (identity and versions are not compared).
CONTRACT = {
    "name": "matched", "source": "file:wiki.test.raw", "split": "test", "dataset": "wikitext-2-raw-v1",
    "words": 5000, "window": 512, "stride": 256, "bos": {"added": False}, "dtype": "float32",
    "versions": {"transformers": "5.24.0"},
}
EVALUATION = {
    "base": {
        "ppl": 20.0, "nll": 6000 * math.log(20.0), "tokens": 6000, "windows": 24, "ci_low": 19.5, "ci_high": 20.6,
        "contract": dict(CONTRACT),
    },
    "pruned": {
        "ppl": 25.0, "nll": 6000 * math.log(25.0), "tokens": 6000, "windows": 24, "ci_low": 24.1, "ci_high": 25.9,
        "contract": dict(CONTRACT),
    },
}


def evaluation_of(model) -> dict:
    """EVALUATION as measured on ``model``: each result records the weights it measured (the
    base before the first removal step, the pruned model as it is now), as evaluate_perplexity does."""
    from hf_layerswap.layerplan import model_fingerprint

    evaluation = copy.deepcopy(EVALUATION)
    before = model.config.layerswap["steps"][0]["fingerprint_before"]
    evaluation["base"]["contract"]["model"] = {"name": BASE_MODEL, "fingerprint": before}
    evaluation["pruned"]["contract"]["model"] = {"name": "tiny-pruned", "fingerprint": model_fingerprint(model)}
    return evaluation


def hand_report() -> SwapReport:
    pairs = [PairResult(i, j, replacement_ij=a, replacement_ji=b, interchange=c) for (i, j), (a, b, c) in PAIR_VALUES.items()]
    metadata = {
        "calibration": {
            "description": "WikiText-2 validation, 8 paragraphs",
            "content_hash": CONTENT_HASH,
            "num_prompts": 8,
            "num_tokens": 250,
            "seq_len": 32,
            "add_special_tokens": True,
        },
        "num_prompts": 8,
        "num_tokens": 250,
        "seq_len": 32,
        "seed": 0,
        "dtype": "float32",
        "forward_passes": 16,
        "block_evaluations": 55,
        "seconds": 1.5,
        "library_versions": {"hf_layerswap": "0.1.0", "transformers": "5.24.0"},
    }
    return SwapReport(6, pairs, max_gap=1, metadata=metadata, removal_kl=dict(REMOVAL_KL))


def pruned_tiny(report: SwapReport | None = None, removed=INTERCHANGE_SET, seed: int = 0):
    """A tiny random Llama (6 blocks) with ``removed`` taken out, provenance as the plugin records it."""
    report = report or hand_report()
    model = tiny_model("llama", 6, seed=seed)
    provenance = {
        "protocol": "interchange",
        "selection": "greedy min-over-partners, spacing=1, protect=[0, -1]",
        "scores": report.summary_dict(),
        "config": {"quant_method": "layerswap", "num_to_remove": 2, "layers": None, "protocol": "interchange",
                   "max_gap": 1, "spacing": 1, "protect": [0, -1], "num_prompts": 8, "seq_len": 32},
    }
    return remove_layers(model, list(removed), provenance=provenance)


@pytest.fixture(scope="module")
def report() -> SwapReport:
    """The hand-built report (module-scoped: tests must not mutate it)."""
    return hand_report()


@pytest.fixture(scope="module")
def pruned(report):
    """The tiny model pruned at the interchange set {1, 3}, with the report's score summary."""
    return pruned_tiny(report)
