"""Peeling data: the held-out evaluation set (disjoint from the calibration text) and
per-sequence next-token NLL (the paired bootstrap over sequences is :mod:`.references`'s)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..calibration import CalibrationSet, build_calibration, embedded_text, split_paragraphs


# ----------------------------------------------------------------------------- data


def _normalise_paragraph(text: str) -> str:
    return " ".join(text.split())


def check_disjoint(calibration: CalibrationSet, evaluation: CalibrationSet) -> None:
    """Refuse calibration and evaluation sets that share text.

    Two checks: no evaluation prompt's real token ids equal a calibration prompt's; and,
    when both sets keep their texts, no paragraph (whitespace-normalised) of one occurs
    inside a paragraph of the other.

    Raises:
        ValueError: naming the first shared prompt.
    """
    def rows(cs: CalibrationSet) -> list[tuple[int, ...]]:
        return [tuple(ids[m.bool()].tolist()) for ids, m in zip(cs.input_ids, cs.attention_mask)]

    cal_rows = set(rows(calibration))
    for n, row in enumerate(rows(evaluation)):
        if row in cal_rows:
            raise ValueError(
                f"evaluation prompt {n} ({len(row)} tokens) is also a calibration prompt: the references are fitted "
                "on the calibration text and must be scored on different text (pass disjoint eval_text)"
            )
    if calibration.texts and evaluation.texts:
        cal = [_normalise_paragraph(t) for t in calibration.texts]
        for n, text in enumerate(evaluation.texts):
            t = _normalise_paragraph(text)
            for c in cal:
                if t and c and (t in c or c in t):
                    raise ValueError(
                        f"evaluation paragraph {n} ({t[:60]!r}...) overlaps calibration paragraph ({c[:60]!r}...): "
                        "calibration and evaluation text must be kept apart"
                    )


def _looks_like_path(value) -> bool:
    if isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and "\n" not in value and len(value) < 4096 and os.path.isfile(value)


def build_evaluation(eval_text, tokenizer, *, num_prompts: int = 32, seq_len: int = 128, seed: int = 0) -> CalibrationSet:
    """Held-out evaluation prompts for :func:`peel`.

    Args:
        eval_text: ``None``/``"embedded"`` (the first ``num_prompts`` paragraphs of
            ``embedded_text("evaluation")``, in order), raw text (split into
            paragraphs, first ``num_prompts`` in order), or any source
            :func:`~hf_layerswap.calibration.build_calibration` accepts (a text file is
            sampled with ``seed``).
        tokenizer, num_prompts, seq_len, seed: as in ``build_calibration``.

    Returns:
        A :class:`CalibrationSet` (``.texts`` kept for text sources).

    Raises:
        ValueError: raw text without a paragraph of at least 50 characters, and every
            error of ``build_calibration``.
    """
    if eval_text is None or (isinstance(eval_text, str) and eval_text == "embedded"):
        paras = split_paragraphs(embedded_text("evaluation"))
        cs = build_calibration(paras, tokenizer, num_prompts=num_prompts, seq_len=seq_len)
        cs.description = (
            f"embedded:pydoc_data.topics (evaluation split: topics k % 4 == 3), first {cs.num_prompts} paragraphs "
            f">= 50 chars; truncated to {seq_len} tokens"
        )
        return cs
    if isinstance(eval_text, str) and not _looks_like_path(eval_text):
        paras = split_paragraphs(eval_text)
        if not paras:
            raise ValueError("eval_text has no paragraph of at least 50 characters")
        cs = build_calibration(paras, tokenizer, num_prompts=num_prompts, seq_len=seq_len)
        cs.description = f"given text, first {cs.num_prompts} of {len(paras)} paragraphs; truncated to {seq_len} tokens"
        return cs
    return build_calibration(eval_text, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)


@torch.no_grad()
def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood per sequence.

    Position t predicts token t+1 when both are real (right padding).

    Args:
        logits: ``(B, T, V)``; input_ids, attention_mask: ``(B, T)``.

    Returns:
        ``(nll, count)``: ``(B,)`` float64 summed NLL in nats (fp32 log-softmax) and
        ``(B,)`` int64 number of predicted tokens.
    """
    nll = torch.zeros(logits.shape[0], dtype=torch.float64)
    count = torch.zeros(logits.shape[0], dtype=torch.int64)
    valid = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    for b in range(logits.shape[0]):
        keep = valid[b]
        if not bool(keep.any()):
            continue
        lp = F.cross_entropy(logits[b, :-1][keep].float(), input_ids[b, 1:][keep], reduction="sum")
        nll[b] = float(lp)
        count[b] = int(keep.sum())
    return nll, count
