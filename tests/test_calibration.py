"""Calibration sources -> right-padded prompts."""

from __future__ import annotations

import pytest
import torch

from hf_layerswap.calibration import CalibrationShortfallWarning, build_calibration, embedded_text, split_paragraphs


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
