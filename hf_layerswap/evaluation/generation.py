"""The greedy generation check: a few prompts continued greedily, with repetition
statistics (:func:`generation_check`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..utils.devices import input_device
from ..utils.jsonio import JsonResult, decode_tree



#: Neutral prompts for :func:`generation_check` when none are given.
DEFAULT_PROMPTS = (
    "The history of the city begins",
    "Photosynthesis is the process by which",
    "In the first chapter of the book, the author",
)


@dataclass
class GenerationCheck(JsonResult):
    """Greedy continuations and how repetitive they are.

    Attributes:
        prompts: the prompts.
        continuations: decoded greedy continuations (without the prompt).
        new_tokens: generated token ids per prompt.
        distinct_2: per prompt, distinct bigrams / bigrams among its generated tokens
            (``None`` with fewer than 2 tokens).
        mean_distinct_2: mean of the defined ``distinct_2`` values (1 = no repeated bigram).
        repetition_rate: ``1 - mean_distinct_2``.
        cache_consistent: greedy generation with the KV cache produced the same tokens as
            without it, for every prompt.
        cache_mismatches: indices of prompts where they differ (or the cached run failed).
        cache_errors: prompt index -> the error raised by the cached run, if any.
        max_new_tokens: generation length limit.

    The continuations are those generated without the cache (the reference path).
    """

    prompts: list[str]
    continuations: list[str]
    new_tokens: list[list[int]]
    distinct_2: list[float | None]
    mean_distinct_2: float | None
    repetition_rate: float | None
    cache_consistent: bool
    cache_mismatches: list[int]
    cache_errors: dict[int, str]
    max_new_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GenerationCheck:
        data = decode_tree(dict(data))
        data["cache_errors"] = {int(k): v for k, v in data.get("cache_errors", {}).items()}  # JSON keys are str
        return cls(**data)


def distinct_n(tokens: Sequence[int], n: int = 2) -> float | None:
    """Distinct-n (Li et al., 2016) of one sequence: unique n-grams / n-grams; ``None`` if there are none."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return None
    return len(set(grams)) / len(grams)


@torch.no_grad()
def generation_check(
    model, tokenizer, prompts: Sequence[str] | None = None, *, max_new_tokens: int = 32
) -> GenerationCheck:
    """Greedy continuations of ``prompts`` (one at a time, no padding), their distinct-2,
    and whether generation with the KV cache equals generation without it (an error in
    the cached run is recorded in ``cache_errors``, not raised).

    A pruned model whose ``layer_idx`` or per-layer config was left inconsistent typically
    fails the cache comparison; one that degenerates shows a high ``repetition_rate``
    even when its perplexity looks acceptable.

    Raises:
        ValueError: no prompts, or ``max_new_tokens < 1``.
    """
    if isinstance(prompts, str):
        raise TypeError(f"prompts={prompts[:40]!r}: give a list of strings, e.g. [{prompts[:40]!r}]")
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    for k, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not tokenizer(prompt)["input_ids"]:
            raise ValueError(f"prompt {k} ({prompt!r}) gives no token: every prompt needs at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    device = input_device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad)
    was_training = model.training
    model.eval()
    continuations, new_tokens, mismatches = [], [], []
    cache_errors: dict[int, str] = {}
    try:
        for k, prompt in enumerate(prompts):
            enc = tokenizer(prompt, return_tensors="pt").to(device)
            n_prompt = enc["input_ids"].shape[1]
            uncached = model.generate(**enc, use_cache=False, **settings)[0, n_prompt:].tolist()
            try:
                cached = model.generate(**enc, use_cache=True, **settings)[0, n_prompt:].tolist()
            except (RuntimeError, IndexError) as err:  # e.g. two blocks sharing one cache slot
                cached = None
                cache_errors[k] = f"{type(err).__name__}: {err}"
            if cached != uncached:
                mismatches.append(k)
            new_tokens.append(uncached)
            continuations.append(tokenizer.decode(uncached, skip_special_tokens=True))
    finally:
        model.train(was_training)
    d2 = [distinct_n(t, 2) for t in new_tokens]
    defined = [d for d in d2 if d is not None]
    mean = float(np.mean(defined)) if defined else None
    return GenerationCheck(
        prompts=prompts,
        continuations=continuations,
        new_tokens=new_tokens,
        distinct_2=d2,
        mean_distinct_2=mean,
        repetition_rate=None if mean is None else 1.0 - mean,
        cache_consistent=not mismatches,
        cache_mismatches=mismatches,
        cache_errors=cache_errors,
        max_new_tokens=max_new_tokens,
    )
