"""Calibration sets: text sources -> right-padded ``(input_ids, attention_mask)`` prompts.

Accepted sources (:func:`build_calibration`):

- ``None`` or ``"embedded"``: real English prose that ships with Python itself (the
  documentation topics of ``pydoc_data``), so a machine with no Hub access still has a
  default. Topics are split deterministically into a calibration part and an evaluation
  part that never overlap (:func:`embedded_text`).
- a path to a text file (e.g. WikiText-2 ``valid.txt``): split into paragraphs.
- a list of strings: one prompt per string.
- a ``datasets.Dataset``: its ``text`` column (or its only string column).
- a mapping with ``input_ids`` and ``attention_mask`` long tensors of shape ``(B, T)``.

Text sources give one prompt per paragraph (truncated, right-padded), or with
``packing=True`` full windows of packed text: the paragraphs in the same seeded order joined
by the tokenizer's EOS and cut into windows of ``seq_len`` tokens (as transformers'
``run_clm`` ``group_texts`` and TRL's packing do), no padding.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "CalibrationSet",
    "CalibrationShortfallWarning",
    "build_calibration",
    "check_positions",
    "check_token_ids",
    "embedded_text",
    "looks_like_path",
    "pack_windows",
    "read_text_file",
    "split_paragraphs",
    "tokenizer_adds_bos",
]

EMBEDDED_SOURCE = "pydoc_data.topics"


class CalibrationShortfallWarning(UserWarning):
    """The calibration source gave fewer prompts or tokens than were asked for. The message
    has both numbers; the set's :meth:`CalibrationSet.spec` (and so the report metadata and
    the model card) records them under ``"shortfall"``."""

#: Every ``EVAL_EVERY``-th documentation topic (sorted by name) is evaluation text.
EVAL_EVERY = 4


def embedded_text(split: str = "calibration") -> str:
    """Real prose shipped with CPython (``pydoc_data.topics``), split without overlap.

    Topics are sorted by name; topic number k goes to ``"evaluation"`` when
    ``k % 4 == 3`` and to ``"calibration"`` otherwise. Paragraphs (blank-line separated,
    wrapped lines joined) that occur in both parts are kept in calibration only.

    Raises:
        ValueError: ``split`` is not ``"calibration"`` or ``"evaluation"``.
    """
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split={split!r}: allowed 'calibration' or 'evaluation'")
    from pydoc_data.topics import topics

    keys = sorted(topics)
    is_eval = [n % EVAL_EVERY == EVAL_EVERY - 1 for n in range(len(keys))]
    calibration = [p for k, e in zip(keys, is_eval) if not e for p in split_paragraphs(topics[k], min_chars=1)]
    if split == "calibration":
        return "\n\n".join(calibration)
    # some paragraphs repeat across topics: evaluation keeps only those calibration lacks
    seen = set(calibration)
    evaluation = [p for k, e in zip(keys, is_eval) if e for p in split_paragraphs(topics[k], min_chars=1)]
    return "\n\n".join(p for p in evaluation if p not in seen)


#: File endings that make a one-line string a file path (see :func:`looks_like_path`).
PATH_SUFFIXES = (".txt", ".raw", ".text", ".tokens", ".md", ".rst", ".csv", ".tsv", ".json", ".jsonl", ".bin")


def looks_like_path(value: str) -> bool:
    """Whether the string ``value`` is read as a file path rather than as text: it is one
    line and it holds a path separator (``/``, or the platform's) or ends in one of
    :data:`PATH_SUFFIXES` (case-insensitive). Such a string that names no file is an
    error, never scored as text; literal text that looks like this goes in a list of
    strings."""
    if "\n" in value:
        return False
    return "/" in value or os.sep in value or value.lower().endswith(PATH_SUFFIXES)


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The contents of a UTF-8 text file, refused before any model sees it when it is not text.

    Args:
        path: the file.
        what: the argument it was given as (``"calibration"``, ``"text"``), for the messages.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the bytes are not UTF-8 (a binary file, or text in another encoding) or
            hold a NUL byte; the message names the file, the offset and the encoding expected.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}={str(path)!r}: " + ("a folder, not a text file" if path.is_dir() else "no such file"))
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")  # strict: a replacement character would turn bytes into "text"
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{what}={str(path)!r} is not a text file: byte {err.start} ({data[err.start:err.start + 1]!r}) is not "
            "valid UTF-8; allowed: UTF-8 text (convert other encodings first)"
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise ValueError(
            f"{what}={str(path)!r} is not a text file: it holds a NUL byte at offset {nul}; allowed: UTF-8 text"
        )
    return text


def split_paragraphs(text: str, *, min_chars: int = 50) -> list[str]:
    """Split text at blank lines (lines of only spaces/tabs count as blank, as in
    WikiText-2's `` \n`` separators); drop WikiText-style headings (``= Title =``) and
    paragraphs shorter than ``min_chars`` characters; join wrapped lines with spaces."""
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        para = " ".join(lines)
        if para.startswith("=") and para.endswith("="):
            continue
        if len(para) >= min_chars:
            paragraphs.append(para)
    return paragraphs


@dataclass
class CalibrationSet:
    """A calibration set of right-padded prompts.

    Attributes:
        input_ids: ``(N, T)`` long tensor.
        attention_mask: ``(N, T)`` long tensor of 0/1, 1 = real token; every row has at
            least 2 real tokens and all its real tokens before its padding.
        description: where the text came from (source, split, selection rule).
        add_special_tokens: whether the tokenizer added BOS/EOS (None for given tensors; for
            a packed set whether the packer placed any BOS or EOS).
        texts: the texts the prompts were tokenized from (text sources only; for a packed
            set the paragraphs whose tokens are in its windows, in order).
        shortfall: ``None``, or what the source could not give when the set was built:
            ``{"requested_prompts": N, "prompts": n, "max_tokens": N * seq_len,
            "tokens": t}`` (``n < N``); kept when a prefix of the set is taken.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    description: str
    add_special_tokens: bool | None = None
    texts: list[str] | None = field(default=None, repr=False)
    shortfall: dict | None = None

    @property
    def num_prompts(self) -> int:
        return int(self.input_ids.shape[0])

    def prefix(self, n: int, why: str) -> CalibrationSet:
        """The first ``n`` prompts (this set itself when it has no more), their description
        saying so and ``why`` (e.g. ``"adaptive budget"``); ``shortfall`` is kept.

        Raises:
            ValueError: ``n < 1`` (a slice from the end would keep all but the last prompts).
        """
        if n < 1:
            raise ValueError(f"prefix n={n}: at least 1 prompt")
        if n >= self.num_prompts:
            return self
        return CalibrationSet(
            self.input_ids[:n].clone(), self.attention_mask[:n].clone(),
            f"{self.description}; first {n} of {self.num_prompts} prompts ({why})", self.add_special_tokens,
            self.texts[:n] if self.texts is not None else None, shortfall=self.shortfall,
        )

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return int(self.attention_mask.sum())

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def content_hash(self) -> str:
        """sha256 over the token ids at real positions and the mask (hex)."""
        h = hashlib.sha256()
        ids = (self.input_ids * self.attention_mask).to(torch.int64).contiguous()
        h.update(str(tuple(ids.shape)).encode())
        h.update(ids.numpy().tobytes())
        h.update(self.attention_mask.to(torch.int64).contiguous().numpy().tobytes())
        return h.hexdigest()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(input_ids, attention_mask)`` batches of at most ``batch_size`` prompts,
        with trailing all-padding columns trimmed (this changes no result)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        for start in range(0, self.num_prompts, batch_size):
            ids = self.input_ids[start : start + batch_size]
            mask = self.attention_mask[start : start + batch_size]
            width = int(mask.sum(dim=1).max())
            yield ids[:, :width], mask[:, :width]

    def spec(self) -> dict:
        """JSON-able description for reports and cards (``"shortfall"`` only when the source
        gave fewer prompts than requested, see the attribute)."""
        out = {
            "description": self.description,
            "content_hash": self.content_hash,
            "num_prompts": self.num_prompts,
            "num_tokens": self.num_tokens,
            "seq_len": self.seq_len,
            "add_special_tokens": self.add_special_tokens,
        }
        if self.shortfall:
            out["shortfall"] = dict(self.shortfall)
        return out


def shortfall_text(shortfall: Mapping) -> str:
    """One sentence with both numbers of a :attr:`CalibrationSet.shortfall` record."""
    asked, got = shortfall["requested_prompts"], shortfall["prompts"]
    return (
        f"{asked} prompt(s) requested, the source gave {got} ({shortfall['tokens']:,} real tokens of the "
        f"{shortfall['max_tokens']:,} that {asked} x {shortfall['max_tokens'] // max(asked, 1)} could hold)"
    )


def _note_shortfall(calib: CalibrationSet, requested: int, seq_len: int, stacklevel: int = 3) -> CalibrationSet:
    if calib.num_prompts < requested:
        calib.shortfall = {"requested_prompts": requested, "prompts": calib.num_prompts,
                           "max_tokens": requested * seq_len, "tokens": calib.num_tokens}
        warnings.warn(
            CalibrationShortfallWarning(
                f"calibration set smaller than requested: {shortfall_text(calib.shortfall)}; source: "
                f"{calib.description}. Scores rest on fewer prompts than asked (wider error bars): give a larger source "
                "(a text file is split at blank lines) or lower num_prompts"
            ),
            stacklevel=stacklevel,
        )
    return calib


def check_token_ids(input_ids: torch.Tensor, model, what: str) -> None:
    """Raise ValueError if ``input_ids`` (padding positions included: the model embeds
    them too) hold an id outside the model's input embedding."""
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is None or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise ValueError(
            f"{what} hold token id {bad}, but the model's input embedding has {rows} rows: allowed ids "
            f"0..{rows - 1} (is the tokenizer the model's own? padding positions count too)"
        )


def check_positions(model, length: int, what: str, fix: str) -> None:
    """Raise ValueError if sequences of ``length`` tokens are longer than the model's
    ``max_position_embeddings`` (the one rule of the scoring engine and the perplexity
    contracts: a learned position table, GPT-2's ``n_positions``, has no row beyond it).
    Called before any forward pass. ``what`` names the value (``"seq_len=128"``), ``fix``
    says what to lower."""
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and int(length) > int(max_pos):
        raise ValueError(
            f"{what} is longer than the model's max_position_embeddings={max_pos} (the longest sequence it "
            f"has positions for): {fix} to at most {max_pos}"
        )


def _validate_tensors(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            "calibration mapping needs torch tensors 'input_ids' and 'attention_mask', got "
            f"{type(input_ids).__name__} and {type(attention_mask).__name__}"
        )
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids shape {tuple(input_ids.shape)} and attention_mask shape {tuple(attention_mask.shape)} "
            "must be equal and 2-D (B, T)"
        )
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must be torch.long, got {input_ids.dtype}")
    if attention_mask.dtype not in (torch.long, torch.int32, torch.bool):
        raise TypeError(f"attention_mask must be torch.long, torch.int32 or torch.bool, got {attention_mask.dtype}")
    mask = attention_mask.to(torch.long)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must contain only 0 and 1")
    if input_ids.shape[0] == 0:
        raise ValueError("empty calibration set: input_ids has 0 rows")
    real = mask.sum(dim=1)
    for row, n in enumerate(real.tolist()):
        if n < 2:
            kind = "all padding" if n == 0 else "1 real token"
            raise ValueError(f"calibration prompt {row} is {kind}: every prompt needs at least 2 real tokens")
    # every real token must precede every pad (right padding): positions are shared with the model
    cum = mask.flip(1).cummax(dim=1).values.flip(1)
    if not bool((cum == mask).all()):
        raise ValueError("attention_mask must be right-padded (ones, then zeros) in every row")
    return input_ids, mask


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts its BOS token first when it adds special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def _texts_from_source(calibration, *, num_prompts: int, seed: int) -> tuple[list[str], str]:
    if calibration is None or (isinstance(calibration, str) and calibration == "embedded"):
        paras = split_paragraphs(embedded_text("calibration"))
        desc = f"embedded:{EMBEDDED_SOURCE} (calibration split: topics k % {EVAL_EVERY} != {EVAL_EVERY - 1})"
        return _sample(paras, num_prompts, seed), f"{desc}, {len(paras)} paragraphs >= 50 chars, seed {seed}"
    if isinstance(calibration, (str, os.PathLike)):
        path = Path(calibration)
        if not path.is_file():
            raise FileNotFoundError(
                f"calibration={str(calibration)!r} is not a file; pass a text file path, 'embedded', a list of "
                "strings, a datasets.Dataset or a mapping with input_ids/attention_mask"
            )
        text = read_text_file(path, "calibration")
        paras = split_paragraphs(text)
        return _sample(paras, num_prompts, seed), (
            f"file:{path.name} ({len(paras)} paragraphs >= 50 chars, headings dropped, seed {seed})"
        )
    datasets = sys.modules.get("datasets")  # a Dataset given means datasets is imported; else none was given
    if datasets is not None and isinstance(calibration, datasets.Dataset):
        columns = [c for c, f in calibration.features.items() if getattr(f, "dtype", None) == "string"]
        column = "text" if "text" in calibration.column_names else (columns[0] if len(columns) == 1 else None)
        if column is None:
            raise ValueError(
                f"datasets.Dataset has no 'text' column and not exactly one string column: {calibration.column_names}"
            )
        rows = [t for t in calibration[column] if isinstance(t, str) and t.strip()]
        paras = [p for p in rows if len(p.strip()) >= 1]
        name = getattr(calibration.info, "dataset_name", None) or "dataset"
        return _sample(paras, num_prompts, seed), f"datasets:{name} column {column!r} ({len(paras)} rows, seed {seed})"
    if isinstance(calibration, Sequence) and all(isinstance(t, str) for t in calibration):
        texts = list(calibration)[:num_prompts]
        return texts, f"list of {len(calibration)} strings (first {len(texts)} used, in order)"
    if isinstance(calibration, (list, tuple)):
        row, bad = next((k, t) for k, t in enumerate(calibration) if not isinstance(t, str))
        raise TypeError(
            f"calibration list entry {row} is {type(bad).__name__} ({bad!r:.40}): a list calibration holds strings, "
            "one prompt each (token ids go in a mapping with input_ids and attention_mask tensors)"
        )
    raise TypeError(
        f"unsupported calibration of type {type(calibration).__name__}: allowed None/'embedded', a text file path, "
        "a list of strings, a datasets.Dataset, or a mapping with input_ids and attention_mask (B, T) long tensors"
    )


def _sample(paras: list[str], num_prompts: int, seed: int) -> list[str]:
    order = list(range(len(paras)))
    random.Random(seed).shuffle(order)
    return [paras[i] for i in order[:num_prompts]]


def build_calibration(
    calibration=None,
    tokenizer=None,
    *,
    num_prompts: int = 64,
    seq_len: int = 128,
    seed: int = 0,
    packing: bool = False,
) -> CalibrationSet:
    """Turn a calibration source into right-padded prompts, or into packed windows.

    Args:
        calibration: see the module docstring. A :class:`CalibrationSet` is returned as is.
        tokenizer: a transformers tokenizer; needed for every text source. A tokenizer with
            no pad token is fine (padding positions are masked out).
        num_prompts: at most this many prompts (paragraphs are drawn by a seeded shuffle;
            a list of strings or given tensors are used in order).
        seq_len: prompts are truncated to this many tokens; only the prefix of each text that
            the budget needs is tokenized (:func:`encode_prefixes`).
        seed: shuffle seed for paragraph sources.
        packing: ``False`` (default): one prompt per paragraph, as above. ``True``: the
            paragraphs in the same order (a list of strings in its order) are tokenized
            without special tokens, joined with the tokenizer's EOS after each (none when it
            has no EOS) and cut into ``num_prompts`` consecutive windows of ``seq_len`` real
            tokens each, no padding (transformers' ``run_clm`` ``group_texts``, TRL's
            packing); when the tokenizer puts a BOS first by default, every window is that
            BOS and ``seq_len - 1`` text tokens. Only as many paragraphs as the windows need
            are tokenized; a paragraph may run across two windows; a last piece shorter than
            a window is dropped. Text sources only.

    Warns:
        CalibrationShortfallWarning: the source gives fewer than ``num_prompts`` prompts
            (e.g. a one-line file is one paragraph); the message has both numbers and the
            real-token count, and :attr:`CalibrationSet.shortfall` records them.

    Raises:
        ValueError: ``num_prompts``/``seq_len`` below their minimum (1 and 2), an empty
            set, a prompt with fewer than 2 real tokens, mismatched tensor shapes; with
            ``packing``: given tensors, or a text shorter than one window.
        TypeError: an unsupported source or a text source without a tokenizer, or
            ``packing`` not a bool.
    """
    if not isinstance(packing, bool):
        raise TypeError(f"packing={packing!r}: must be True (full windows of packed text) or False (one prompt per "
                        "paragraph)")
    if packing and isinstance(calibration, (CalibrationSet, Mapping)):
        raise ValueError(f"packing=True needs a text source, got {type(calibration).__name__} (prompts already "
                         "tokenized): pass the text, or packing=False")
    if isinstance(calibration, CalibrationSet):
        return calibration
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r}: must be an int >= 1")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: must be an int >= 2 (a KL needs at least 2 tokens)")
    if isinstance(calibration, Mapping):
        missing = {"input_ids", "attention_mask"} - set(calibration)
        if missing:
            raise ValueError(
                f"calibration mapping ({type(calibration).__name__} with keys {sorted(map(str, calibration))}) is missing "
                f"{sorted(missing)}; it needs input_ids and attention_mask"
            )
        ids, mask = _validate_tensors(calibration["input_ids"], calibration["attention_mask"])
        ids, mask = ids[:num_prompts], mask[:num_prompts]
        given = CalibrationSet(ids.clone(), mask.clone(), f"tensors ({ids.shape[0]} x {ids.shape[1]}, given)")
        return _note_shortfall(given, num_prompts, int(ids.shape[1]))
    texts, description = _texts_from_source(calibration, num_prompts=sys.maxsize if packing else num_prompts, seed=seed)
    if not texts:
        raise ValueError(f"empty calibration set: {description} yields no prompt")
    if tokenizer is None:
        raise TypeError("a text calibration source needs a tokenizer (pass tokenizer=...)")
    if packing:
        return _note_shortfall(pack_windows(tokenizer, texts, description, num_prompts, seq_len), num_prompts, seq_len)
    encoded = encode_prefixes(tokenizer, texts, seq_len)
    for row, ids in enumerate(encoded):
        if len(ids) < 2:
            raise ValueError(
                f"calibration prompt {row} ({texts[row][:40]!r}) has {len(ids)} token(s): every prompt needs at least 2"
            )
    width = max(len(ids) for ids in encoded)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    input_ids = torch.full((len(encoded), width), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and all(ids[0] == bos for ids in encoded)
    built = CalibrationSet(
        input_ids,
        attention_mask,
        f"{description}; truncated to {seq_len} tokens" + ("; BOS prepended" if adds_bos else "; no BOS"),
        add_special_tokens=True,
        texts=texts,
    )
    return _note_shortfall(built, num_prompts, seq_len)


#: Paragraphs :func:`pack_windows` tokenizes at once (the first call; each next one doubles it).
PACK_CHUNK = 64


def pack_windows(tokenizer, texts: Sequence[str], description: str, num_windows: int, seq_len: int) -> CalibrationSet:
    """At most ``num_windows`` windows of ``seq_len`` real tokens packed from ``texts`` in
    order (the ``packing=True`` rule of :func:`build_calibration`, which documents it):
    ``(N, seq_len)`` ids, an all-ones mask, ``N < num_windows`` only when the text runs out.
    The texts are tokenized a chunk at a time until the windows are full.

    Raises:
        ValueError: the texts hold fewer tokens than one window.
    """
    bos = [int(tokenizer.bos_token_id)] if tokenizer_adds_bos(tokenizer) else []
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    body = seq_len - len(bos)
    stream: list[int] = []
    ends: list[int] = []  # stream length after each tokenized text
    chunk = PACK_CHUNK
    while len(stream) < num_windows * body and len(ends) < len(texts):
        part = list(texts[len(ends) : len(ends) + chunk])
        for ids in tokenizer(part, add_special_tokens=False)["input_ids"]:
            stream.extend([*ids, *eos])
            ends.append(len(stream))
        chunk *= 2
    count = min(num_windows, len(stream) // body)
    if count == 0:
        raise ValueError(f"packing: {description} gives {len(stream)} token(s), fewer than one window of "
                         f"seq_len={seq_len}: give more text or a lower seq_len")
    used = next(k for k, end in enumerate(ends) if end >= count * body) + 1
    windows = torch.tensor(stream[: count * body], dtype=torch.long).view(count, body)
    if bos:
        windows = torch.cat([torch.full((count, 1), bos[0], dtype=torch.long), windows], dim=1)
    joint = f"EOS (id {eos[0]}) after each" if eos else "nothing between them (the tokenizer has no EOS)"
    first = f"each a BOS (id {bos[0]}) then {body} text tokens" if bos else "no BOS"
    return CalibrationSet(
        windows, torch.ones_like(windows),
        f"{description}; packed: the first {used} text(s) of that order, {joint}, cut into {count} windows of "
        f"{seq_len} tokens ({first}; no padding, a text may run across windows)",
        add_special_tokens=bool(bos or eos), texts=list(texts[:used]),
    )


#: Characters per wanted token of the first prefix :func:`encode_prefixes` tokenizes (it
#: doubles the prefix until the tokens reach past the budget).
CHARS_PER_TOKEN_GUESS = 8
#: Tokens beyond ``seq_len`` a prefix must give before its first ``seq_len`` are trusted to
#: be those of the whole text (the cut falls at a blank, a word boundary of the tokenizer).
PREFIX_MARGIN = 8


def encode_prefixes(tokenizer, texts: Sequence[str], seq_len: int) -> list[list[int]]:
    """Token ids of each text truncated to ``seq_len`` (``add_special_tokens=True``), as
    ``tokenizer(texts, truncation=True, max_length=seq_len)`` gives, tokenizing only a
    prefix of each text: ``CHARS_PER_TOKEN_GUESS * (seq_len + PREFIX_MARGIN)`` characters cut
    at the last blank, doubled until it gives more than ``seq_len + PREFIX_MARGIN`` tokens
    or is the whole text. A 10 MB one-line file costs a few kB of tokenizing, not all of it."""
    want = seq_len + PREFIX_MARGIN
    chars = CHARS_PER_TOKEN_GUESS * want
    prefixes = list(texts)
    todo = [k for k, t in enumerate(texts) if len(t) > chars]
    while todo:
        for k in todo:
            text = texts[k]
            cut = max(text.rfind(" ", 0, chars), text.rfind("\n", 0, chars), text.rfind("\t", 0, chars))
            prefixes[k] = text[: cut if cut > chars // 2 else chars]
        counts = [len(ids) for ids in tokenizer([prefixes[k] for k in todo], add_special_tokens=True)["input_ids"]]
        chars *= 2
        todo = [k for k, n in zip(todo, counts) if n <= want and len(texts[k]) > len(prefixes[k])]
        for k in todo:
            if len(texts[k]) <= chars:
                prefixes[k] = texts[k]
        todo = [k for k in todo if len(texts[k]) > chars]
    return tokenizer(prefixes, add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]
