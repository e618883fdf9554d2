"""Datasets of the local lm-eval tasks: JSONL files next to this module (no download)."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str, **_):
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(HERE / f"{name}.jsonl"))})


def load_mc(**kwargs):
    return _load("layerswap_mc", **kwargs)


def load_rolling(**kwargs):
    return _load("layerswap_rolling", **kwargs)
