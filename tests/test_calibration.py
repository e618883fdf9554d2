"""Calibration sources -> right-padded prompts; what is refused by name (empty sets, prompts
shorter than two tokens, mismatched shapes, wrong dtypes, token ids outside the embedding,
missing and binary files, before any forward pass), a tokenizer without a pad token, the
shortfall warning and its record, and prefix tokenizing of long texts."""

from __future__ import annotations

import re

import pytest
import torch
from arch_matrix import build, prompts, tiny_tokenizer
from conftest import PARAGRAPHS, SHORT_TEXTS, count_forwards, random_bytes, write_paragraphs

import hf_layerswap as hl
from hf_layerswap import score_layers
from hf_layerswap.card import render_card

from hf_layerswap.calibration import (CalibrationSet, CalibrationShortfallWarning, build_calibration, embedded_text,
                                      split_paragraphs)
from hf_layerswap.layerplan import num_blocks
from hf_layerswap.scoring import masked_kl, removal_kl


class CharTokenizer:
    """One token per character (ids 3..), optional BOS id 1; no pad token."""

    pad_token_id = None
    eos_token_id = None
    bos_token_id = 1

    def __init__(self, bos=False):
        self.bos = bos

    def __call__(self, texts, add_special_tokens=True, truncation=True, max_length=None):
        out = []
        for t in [texts] if isinstance(texts, str) else texts:
            ids = ([1] if self.bos and add_special_tokens else []) + [3 + (ord(c) % 50) for c in t]
            out.append(ids[:max_length] if truncation and max_length else ids)
        return {"input_ids": out[0] if isinstance(texts, str) else out}


def test_split_paragraphs_wikitext_style_blank_lines():
    text = " = Title = \n \n First paragraph line one is long enough to keep here .\n \n short\n \n" \
           " = = Section = = \n \n Second paragraph , also long enough to be kept as a prompt .\n"
    assert split_paragraphs(text) == [
        "First paragraph line one is long enough to keep here .",
        "Second paragraph , also long enough to be kept as a prompt .",
    ]
    assert split_paragraphs("a\r\n\r\nb", min_chars=1) == ["a", "b"]


def test_embedded_splits_never_overlap():
    cal, ev = set(split_paragraphs(embedded_text("calibration"))), set(split_paragraphs(embedded_text("evaluation")))
    assert cal and ev and not (cal & ev)
    with pytest.raises(ValueError, match="split='test'"):
        embedded_text("test")


def test_file_list_and_dataset_sources(tmp_path):
    import datasets

    paras = [f"paragraph number {i} " + "x" * (40 + i) for i in range(10)]
    path = tmp_path / "c.txt"
    path.write_text(" \n \n".join(paras) + "\n")
    tok = CharTokenizer()
    calib = build_calibration(path, tok, num_prompts=4, seq_len=20, seed=3)
    assert calib.input_ids.shape == (4, 20) and calib.num_tokens == 80
    assert set(calib.texts) <= set(paras) and len(set(calib.texts)) == 4
    assert build_calibration(path, tok, num_prompts=4, seq_len=20, seed=3).content_hash == calib.content_hash
    assert build_calibration(path, tok, num_prompts=4, seq_len=20, seed=4).content_hash != calib.content_hash
    listed = build_calibration(["abc", "abcdef"], tok, seq_len=8)
    assert listed.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert listed.input_ids[0, 3:].tolist() == [0, 0, 0]  # no pad token: id 0, masked out
    ds = datasets.Dataset.from_dict({"text": paras[:3]})
    assert build_calibration(ds, tok, num_prompts=8, seq_len=10).num_prompts == 3


def test_bad_calibration_input(tmp_path):
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="empty calibration set"):
        build_calibration(tmp_path / "empty.txt" if (tmp_path / "empty.txt").write_text("") == 0 else None, tok)
    with pytest.raises(ValueError, match="prompt 1 .* 1 token"):
        build_calibration(["abc", "a"], tok)
    with pytest.raises(FileNotFoundError, match="not a file"):
        build_calibration(str(tmp_path / "missing.txt"), tok)
    with pytest.raises(ValueError, match="shape"):
        build_calibration({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="all padding"):
        build_calibration({"input_ids": torch.ones(2, 3, dtype=torch.long),
                           "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])})
    with pytest.raises(ValueError, match="right-padded"):
        build_calibration({"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1]])})
    with pytest.raises(TypeError, match="needs a tokenizer"):
        build_calibration(["abc"])


class EosCharTokenizer(CharTokenizer):
    """:class:`CharTokenizer` with an EOS token (id 2)."""

    eos_token_id = 2


def _char(text):
    return [3 + (ord(c) % 50) for c in text]


def test_packing_cuts_eos_joined_texts_into_full_windows():
    a, b, c = _char("abc"), _char("defgh"), _char("ij")
    packed = build_calibration(["abc", "defgh", "ij"], EosCharTokenizer(), num_prompts=3, seq_len=4, packing=True)
    # stream a b c EOS d e f g h EOS i j EOS: three full windows, the last token dropped
    assert packed.input_ids.tolist() == [[*a, 2], b[:4], [b[4], 2, *c]]
    assert packed.attention_mask.tolist() == [[1] * 4] * 3 and packed.num_tokens == 12
    assert packed.texts == ["abc", "defgh", "ij"] and packed.shortfall is None
    assert "packed: the first 3 text(s) of that order, EOS (id 2) after each, cut into 3 windows of 4 tokens (no BOS" \
        in packed.description
    # a BOS-adding tokenizer: every window is BOS + 3 text tokens; only the texts the windows need are kept
    tok = EosCharTokenizer(bos=True)
    with_bos = build_calibration(["abc", "defgh", "ij"], tok, num_prompts=2, seq_len=4, packing=True)
    assert with_bos.input_ids.tolist() == [[1, *a], [1, 2, *b[:2]]]
    assert with_bos.texts == ["abc", "defgh"] and "each a BOS (id 1) then 3 text tokens" in with_bos.description


def test_packing_covers_the_seeded_paragraph_order_without_overlap(tmp_path):
    paras = [f"paragraph number {i} " + "x" * (40 + i) for i in range(10)]
    path = tmp_path / "c.txt"
    path.write_text(" \n \n".join(paras) + "\n")
    tok = EosCharTokenizer()
    order = build_calibration(path, tok, num_prompts=10, seq_len=200, seed=3).texts  # every paragraph, seeded order
    stream = [t for text in order for t in [*_char(text), 2]]
    with pytest.warns(CalibrationShortfallWarning, match="100 prompt"):
        packed = build_calibration(path, tok, num_prompts=100, seq_len=32, seed=3, packing=True)
    count = len(stream) // 32
    assert packed.input_ids.shape == (count, 32) and bool(packed.attention_mask.all())
    assert packed.input_ids.flatten().tolist() == stream[: count * 32]  # consecutive: no overlap, no gap
    assert packed.texts == order and packed.shortfall["prompts"] == count
    head = build_calibration(path, tok, num_prompts=3, seq_len=32, seed=3, packing=True)
    assert torch.equal(head.input_ids, packed.input_ids[:3])


def test_packing_false_is_the_paragraph_set_unchanged():
    tok = CharTokenizer(bos=True)
    calib = build_calibration(None, tok, num_prompts=16, seq_len=32, seed=5)
    # the content hash of this set before packing existed
    assert calib.content_hash == "8f4c48bf26888fa62c6527406dc00e9b723121cacc00d5de8c9988d253c09ced"
    assert calib.content_hash == build_calibration(None, tok, num_prompts=16, seq_len=32, seed=5,
                                                   packing=False).content_hash
    assert calib.description.endswith("seed 5; truncated to 32 tokens; BOS prepended")


def test_packing_refusals():
    given = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="packing=True needs a text source, got dict"):
        build_calibration(given, packing=True)
    with pytest.raises(TypeError, match="packing='yes'"):
        build_calibration(["abc"], EosCharTokenizer(), packing="yes")
    with pytest.raises(ValueError, match="gives 4 token"):
        build_calibration(["abc"], EosCharTokenizer(), seq_len=8, packing=True)


# -------------------------- refused sources, the shortfall, prefix tokenizing


def test_empty_calibration_sets_are_refused(matrix_llama, tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"empty calibration set: list of 0 strings"):
        build_calibration([], tok)
    with pytest.raises(ValueError, match=r"empty calibration set: input_ids has 0 rows"):
        score_layers(matrix_llama, {"input_ids": torch.zeros(0, 5, dtype=torch.long),
                             "attention_mask": torch.zeros(0, 5, dtype=torch.long)}, progress=False)
    short = tmp_path / "short.txt"
    short.write_text("too short\n\nalso short\n")  # no paragraph reaches 50 characters
    with pytest.raises(ValueError, match=r"empty calibration set: file:short.txt \(0 paragraphs"):
        score_layers(matrix_llama, short, tokenizer=tok, progress=False)


def test_prompts_shorter_than_two_real_tokens_are_refused(matrix_llama):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"calibration prompt 1 \('a'\) has 1 token\(s\): every prompt needs at least 2"):
        build_calibration([SHORT_TEXTS[0], "a"], tok)
    ids = torch.ones(3, 5, dtype=torch.long)
    one = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"calibration prompt 1 is 1 real token: every prompt needs at least 2"):
        score_layers(matrix_llama, {"input_ids": ids, "attention_mask": one}, progress=False)
    none = one.clone()
    none[2] = 0
    none[1, 1] = 1
    with pytest.raises(ValueError, match=r"calibration prompt 2 is all padding"):
        build_calibration({"input_ids": ids, "attention_mask": none})
    with pytest.raises(ValueError, match=r"seq_len=1: must be an int >= 2"):
        build_calibration(SHORT_TEXTS, tok, seq_len=1)


def test_tokenizer_without_pad_token_is_handled(matrix_llama):
    with_pad, without_pad = tiny_tokenizer(pad_token=True), tiny_tokenizer(pad_token=False)
    assert without_pad.pad_token_id is None
    a = build_calibration(SHORT_TEXTS, with_pad)
    b = build_calibration(SHORT_TEXTS, without_pad)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert bool((a.attention_mask == 0).any())  # prompts of different length: there is padding
    assert torch.equal(a.input_ids * a.attention_mask, b.input_ids * b.attention_mask)
    assert a.content_hash == b.content_hash
    ra = score_layers(matrix_llama, a, batch_size=3, progress=False)
    rb = score_layers(matrix_llama, b, batch_size=3, progress=False)
    for pa, pb in zip(ra.pairs, rb.pairs):
        for field in ("replacement_ij", "replacement_ji", "interchange"):
            assert getattr(pa, field) == pytest.approx(getattr(pb, field), rel=1e-6, abs=1e-12)


def test_mismatched_input_ids_and_attention_mask_shapes(matrix_llama):
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids shape \(2, 5\) and attention_mask shape \(2, 4\) must be equal"):
        score_layers(matrix_llama, {"input_ids": ids, "attention_mask": torch.ones(2, 4, dtype=torch.long)},
                     progress=False)
    with pytest.raises(ValueError, match=r"input_ids shape \(5,\) and attention_mask shape \(5,\)"):
        build_calibration({"input_ids": ids[0], "attention_mask": torch.ones(5, dtype=torch.long)})
    with pytest.raises(ValueError, match="missing \\['attention_mask'\\]"):
        build_calibration({"input_ids": ids})
    with pytest.raises(ValueError, match=r"shape mismatch: ref \(2, 5, 7\), logits \(2, 5, 7\), mask \(2, 4\)"):
        masked_kl(torch.zeros(2, 5, 7), torch.zeros(2, 5, 7), torch.ones(2, 4))


def test_token_ids_outside_the_embedding_are_named(matrix_llama):
    batch = prompts()
    ids = batch["input_ids"].clone()
    ids[1, 3] = 128  # one past the tiny vocabulary
    message = (
        "calibration input_ids hold token id 128, but the model's input embedding has 128 rows: allowed ids 0..127 "
        "(is the tokenizer the model's own? padding positions count too)"
    )
    for call in (lambda c: score_layers(matrix_llama, c, progress=False), lambda c: removal_kl(matrix_llama, c, [1])):
        with pytest.raises(ValueError) as err:
            call({"input_ids": ids, "attention_mask": batch["attention_mask"]})
        assert str(err.value) == message
    padded = batch["input_ids"].clone()
    padded[1, -1] = -100  # a collator's label padding at a masked position is still embedded
    with pytest.raises(ValueError, match=r"^calibration input_ids hold token id -100, "):
        score_layers(matrix_llama, {"input_ids": padded, "attention_mask": batch["attention_mask"]}, progress=False)


def test_calibration_type_errors_name_the_offending_part():
    tok = tiny_tokenizer()
    batch = prompts()
    with pytest.raises(TypeError) as err:
        build_calibration({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].float()})
    assert str(err.value) == "attention_mask must be torch.long, torch.int32 or torch.bool, got torch.float32"
    with pytest.raises(TypeError) as err:
        build_calibration({"input_ids": batch["input_ids"].int(), "attention_mask": batch["attention_mask"]})
    assert str(err.value) == "input_ids must be torch.long, got torch.int32"
    with pytest.raises(TypeError) as err:
        build_calibration([SHORT_TEXTS[0], 7, SHORT_TEXTS[1]], tok)
    assert str(err.value) == (
        "calibration list entry 1 is int (7): a list calibration holds strings, one prompt each "
        "(token ids go in a mapping with input_ids and attention_mask tensors)"
    )
    with pytest.raises(ValueError, match=r"^num_prompts=True: must be an int >= 1$"):
        build_calibration(SHORT_TEXTS, tok, num_prompts=True)
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": SHORT_TEXTS})})
    with pytest.raises(ValueError) as err:
        build_calibration(splits, tok)
    assert str(err.value) == (
        "calibration mapping (DatasetDict with keys ['train']) is missing ['attention_mask', 'input_ids']; "
        "it needs input_ids and attention_mask"
    )


@pytest.mark.parametrize("name", ["my data/wiki.test.raw", "wiki.test.raw", "notes.TXT", "corpus/held-out"])
def test_a_missing_file_is_refused_not_scored_as_text(matrix_llama, matrix_tokenizer, tmp_path, name):
    missing = str(tmp_path / name) if "/" in name else name
    calls, handle = count_forwards(matrix_llama)
    try:
        with pytest.raises(FileNotFoundError) as err:
            hl.evaluate_perplexity(matrix_llama, missing, tokenizer=matrix_tokenizer, bootstrap=0)
        assert repr(missing) in str(err.value) and "no such file" in str(err.value)
        assert "list of strings" in str(err.value)
        for call in (lambda: hl.score_layers(matrix_llama, missing, tokenizer=matrix_tokenizer, progress=False),
                     lambda: hl.build_calibration(missing, matrix_tokenizer)):
            with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
                call()
        with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
            hl.prune_loaded_model(matrix_llama, hl.LayerSwapConfig(num_to_remove=1, calibration=missing,
                                                                   tokenizer=matrix_tokenizer, progress=False))
    finally:
        handle.remove()
    assert calls == []
    assert num_blocks(matrix_llama) == 6


@pytest.mark.parametrize("kind", ["random bytes", "utf-16", "nul bytes"])
def test_a_file_that_is_not_text_is_refused_before_any_forward_pass(matrix_llama, matrix_tokenizer, tmp_path, kind):
    path = tmp_path / "b.bin"
    if kind == "random bytes":
        path.write_bytes(bytes(random_bytes(4096)))
    elif kind == "utf-16":
        path.write_bytes("\n\n".join(PARAGRAPHS).encode("utf-16"))
    else:
        path.write_bytes(("\n\n".join(PARAGRAPHS) + "\0\0\0").encode("utf-8"))
    calls, handle = count_forwards(matrix_llama)
    try:
        for what, call in (
            ("calibration",
             lambda: hl.score_layers(matrix_llama, str(path), tokenizer=matrix_tokenizer, progress=False)),
            ("calibration", lambda: hl.score_layers(matrix_llama, path, tokenizer=matrix_tokenizer, progress=False)),
            ("text", lambda: hl.evaluate_perplexity(matrix_llama, str(path), tokenizer=matrix_tokenizer, bootstrap=0)),
            ("text", lambda: hl.evaluate_perplexity(matrix_llama, path, tokenizer=matrix_tokenizer, bootstrap=0)),
        ):
            with pytest.raises(ValueError) as err:
                call()
            assert type(err.value) is ValueError  # not a bare UnicodeDecodeError
            message = str(err.value)
            assert message.startswith(f"{what}={str(path)!r} is not a text file"), message
            assert "allowed: UTF-8 text" in message
    finally:
        handle.remove()
    assert calls == []


def test_a_one_line_file_warns_of_the_shortfall_and_tokenizes_only_the_budget(matrix_tokenizer, tmp_path, monkeypatch):
    words = ("layer", "block", "swap", "probe", "removal", "prompt")
    line = " ".join(words[k % 6] + str(k % 97) for k in range(1_400_000))  # one line, about 10 MB
    path = tmp_path / "one-line.txt"
    path.write_text(line, encoding="utf-8")
    assert path.stat().st_size > 10_000_000
    tokenizer_class = type(matrix_tokenizer)
    original_call, seen = tokenizer_class.__call__, []

    def recording_call(self, text, *args, **kwargs):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return original_call(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_class, "__call__", recording_call)
    with pytest.warns(hl.CalibrationShortfallWarning) as caught:
        calib = hl.build_calibration(str(path), matrix_tokenizer, num_prompts=4, seq_len=16)
    monkeypatch.undo()
    # the character tokenizer would make 10 million tokens of the whole line; 16 are needed,
    # so only a short prefix of the line ever reaches the tokenizer
    assert seen and max(seen) < 100_000, max(seen, default=None)
    assert (calib.num_prompts, calib.num_tokens) == (1, 16)
    assert calib.input_ids[0].tolist() == matrix_tokenizer(line[:16])["input_ids"]
    message = str(caught[0].message)
    assert "4 prompt(s) requested, the source gave 1 (16 real tokens of the 64 that 4 x 16 could hold)" in message
    assert "file:one-line.txt" in message
    assert calib.spec()["shortfall"] == {"requested_prompts": 4, "prompts": 1, "max_tokens": 64, "tokens": 16}


def test_prefix_tokenizing_gives_the_whole_text_tokens(matrix_tokenizer):
    from hf_layerswap.calibration import encode_prefixes

    texts = [" ".join(PARAGRAPHS * 40), "x" * 5000, "short", PARAGRAPHS[0], "\n".join(PARAGRAPHS * 30)]
    for seq_len in (2, 16, 100, 400):
        assert encode_prefixes(matrix_tokenizer, texts, seq_len) == matrix_tokenizer(
            texts, add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]


@pytest.mark.slow
def test_prefix_tokenizing_matches_a_real_tokenizer(smollm2, wikitext_test_raw):
    from hf_layerswap.calibration import encode_prefixes, split_paragraphs

    _, real = smollm2
    paras = split_paragraphs(wikitext_test_raw.read_text(encoding="utf-8"))
    texts = [" ".join(paras[k:k + 40]) for k in range(0, 200, 40)] + paras[:60] + ["\n".join(paras[:30])]
    for seq_len in (2, 16, 512):
        assert encode_prefixes(real, texts, seq_len) == real(
            texts, add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]


def test_a_calibration_shortfall_is_recorded_in_the_report_and_the_card(matrix_tokenizer, tmp_path):
    path = write_paragraphs(tmp_path / "two.txt", PARAGRAPHS[:2])
    model = build("llama")
    config = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=str(path), tokenizer=matrix_tokenizer,
                                num_prompts=5, seq_len=24, batch_size=2, progress=False)
    with pytest.warns(hl.CalibrationShortfallWarning, match=re.escape(
            "5 prompt(s) requested, the source gave 2 (48 real tokens of the 120 that 5 x 24 could hold)")):
        hl.prune_loaded_model(model, config)
    record = {"requested_prompts": 5, "prompts": 2, "max_tokens": 120, "tokens": 48}
    report = model.layerswap_report
    assert report.metadata["calibration"]["shortfall"] == record
    assert report.summary_dict()["calibration"]["shortfall"] == record
    assert hl.SwapReport.from_dict(report.to_dict()).metadata["calibration"]["shortfall"] == record
    card = str(render_card(model, report=report))
    assert ("| Shortfall | **fewer prompts than requested**: 5 prompt(s) requested, the source gave 2 (48 real "
            "tokens of the 120 that 5 x 24 could hold) |") in card
    # a set that fills the request records nothing and warns nothing
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.CalibrationShortfallWarning)
        full = hl.build_calibration(PARAGRAPHS, matrix_tokenizer, num_prompts=6, seq_len=24)
    assert "shortfall" not in full.spec() and full.shortfall is None


def test_a_prefix_of_the_calibration_takes_the_first_n_prompts_and_refuses_fewer_than_one():
    """CalibrationSet.prefix(n): the first n prompts (the set itself for n >= its size); n < 1
    is refused, where a slice from the end kept all but the last prompts."""
    ids = torch.arange(24).reshape(6, 4)
    calib = CalibrationSet(ids, torch.ones_like(ids), "six prompts", texts=[f"p{k}" for k in range(6)])
    first = calib.prefix(2, "a test")
    assert first.input_ids.tolist() == ids[:2].tolist() and first.texts == ["p0", "p1"]
    assert first.description == "six prompts; first 2 of 6 prompts (a test)"
    assert calib.prefix(6, "a test") is calib and calib.prefix(7, "a test") is calib
    for n in (0, -1):
        with pytest.raises(ValueError, match=f"prefix n={n}: at least 1 prompt"):
            calib.prefix(n, "a test")
