"""Calibration sources -> right-padded prompts."""

from __future__ import annotations

import pytest
import torch

from hf_layerswap.calibration import build_calibration, embedded_text, split_paragraphs


class CharTokenizer:
    """One token per character (ids 3..), optional BOS id 1; no pad token."""

    pad_token_id = None
    eos_token_id = None
    bos_token_id = 1

    def __init__(self, bos=False):
        self.bos = bos

    def __call__(self, texts, add_special_tokens=True, truncation=True, max_length=None):
        out = []
        for t in texts:
            ids = ([1] if self.bos and add_special_tokens else []) + [3 + (ord(c) % 50) for c in t]
            out.append(ids[:max_length] if truncation and max_length else ids)
        return {"input_ids": out}


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
