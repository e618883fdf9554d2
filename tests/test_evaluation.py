"""Evaluator: sliding-window perplexity contract, bootstrap, evaluate module, generation check,
models without a language-model head refused, and the progress bar."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch

import hf_layerswap as hl
from hf_layerswap.evaluation import (
    CONTRACTS,
    GenerationCheck,
    PerplexityResult,
    delta_ppl_ci,
    delta_ppl_percent,
    distinct_n,
    evaluate_perplexity,
    generation_check,
    perplexity_from_ids,
    perplexity_metric_path,
    prepare_text,
    sliding_windows,
)
from conftest import PARAGRAPHS, count_forwards, tiny_model

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Rivers carry sediment to the sea, where it settles into layers of sand and clay. "
    "Birds migrate south in winter and return when the days grow longer."
)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A tiny byte-level BPE tokenizer (trained here, no download) that adds BOS like Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny_lm():
    """The tiny Llama of 2 blocks with the byte tokenizer's vocabulary and special ids, and
    256 positions (the windows of the contract tests)."""
    return tiny_model(
        "llama", num_blocks=2, vocab_size=300, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )


# ----------------------------------------------------------------------------- bookkeeping


def test_sliding_windows_hand_computed():
    # N=10, window 4, stride 2: windows [0,4) [2,6) [4,8) [6,10); scored 1-3, 4-5, 6-7, 8-9
    assert sliding_windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # the last window is shorter when N does not line up
    assert sliding_windows(9, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 9, 7)]
    # non-overlapping windows: each window's first token cannot be scored
    assert sliding_windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # the released script's count leaves out the first new token after the first window
    assert sliding_windows(10, 4, 2, paper_token_count=True) == [(0, 4, 1), (2, 6, 5), (4, 8, 7), (6, 10, 9)]


@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (37, 8, 3), (100, 16, 16), (513, 512, 256), (5756, 512, 256)])
def test_every_target_scored_exactly_once(n, window, stride):
    spans = sliding_windows(n, window, stride)
    scored = [t for _, end, start in spans for t in range(start, end)]
    if stride < window:
        assert sorted(scored) == list(range(1, n))  # each target once, none twice
    else:
        assert len(scored) == len(set(scored)) == n - len(spans)
    for begin, end, start in spans:
        assert begin < start <= end and end - begin <= window


def test_paper_token_count_matches_published_counts():
    # Qwen3-8B matched contract: 22 windows / 5,734 tokens, i.e. N = 5,756 input tokens
    spans = sliding_windows(5756, 512, 256, paper_token_count=True)
    assert len(spans) == 22
    assert sum(end - start for _, end, start in spans) == 5734


def test_window_stride_errors():
    with pytest.raises(ValueError, match="stride=5"):
        sliding_windows(10, 4, 5)
    with pytest.raises(ValueError, match="window=1"):
        sliding_windows(10, 1, 1)
    with pytest.raises(ValueError, match="1 token"):
        sliding_windows(1, 4, 2)


def test_prepare_text_matched_rule():
    raw = " = Title = \r\n \r\n First line , here .\n\n\n Second line\n"
    joined, words = prepare_text(raw, None)
    assert joined == " = Title = \n\n First line , here .\n\n Second line"
    assert words == 10
    cut, words = prepare_text(raw, 5)
    assert cut == "= Title = First line"
    assert words == 5


# ----------------------------------------------------------------------------- exactness


def _straightforward_nll(model, ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """One window at a time, overlap labels set to -100, the model's own mean loss times the
    number of labels it actually scored (the transformers perplexity-guide method, with the
    per-window count taken from the shifted labels)."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + window, ids.numel())
        trg_len = end - prev_end
        inp = ids[begin:end].unsqueeze(0)
        labels = inp.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids=inp, labels=labels, use_cache=False).loss
        n = int((labels[:, 1:] != -100).sum())
        total += loss.double().item() * n
        count += n
        prev_end = end
        if end == ids.numel():
            break
    return total, count


@pytest.mark.parametrize("window,stride,batch", [(16, 8, 1), (16, 8, 3), (12, 5, 2), (16, 16, 2)])
def test_cross_check_against_straightforward(tiny_lm, window, stride, batch):
    ids = torch.randint(3, 300, (61,), generator=torch.Generator().manual_seed(3))
    res = perplexity_from_ids(tiny_lm, ids, window=window, stride=stride, batch_size=batch, bootstrap=0)
    ref_nll, ref_count = _straightforward_nll(tiny_lm, ids, window, stride)
    assert res.tokens == ref_count == sum(res.window_tokens)
    assert res.nll == pytest.approx(ref_nll, rel=1e-6)
    assert res.ppl == pytest.approx(math.exp(ref_nll / ref_count), rel=1e-6)
    assert res.ci_low is None and res.ci_high is None


def test_hand_computed_single_window(tiny_lm):
    ids = torch.tensor([5, 9, 17, 4, 200, 33])
    res = perplexity_from_ids(tiny_lm, ids, window=8, stride=4, bootstrap=0)
    with torch.no_grad():
        logp = torch.log_softmax(tiny_lm(ids[None]).logits[0].double(), -1)
    expected = -sum(logp[t - 1, ids[t]].item() for t in range(1, 6))
    assert res.tokens == 5 and res.windows == 1
    assert res.nll == pytest.approx(expected, rel=1e-6)


def test_bootstrap_deterministic_and_correct(tiny_lm):
    ids = torch.randint(3, 300, (80,), generator=torch.Generator().manual_seed(5))
    a = perplexity_from_ids(tiny_lm, ids, window=16, stride=8, bootstrap=200, seed=42)
    b = perplexity_from_ids(tiny_lm, ids, window=16, stride=8, bootstrap=200, seed=42)
    c = perplexity_from_ids(tiny_lm, ids, window=16, stride=8, bootstrap=200, seed=7)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    # independent recomputation: 200 resamples drawn one at a time from RandomState(42)
    rng = np.random.RandomState(42)
    nll, tok = np.array(a.window_nll), np.array(a.window_tokens)
    ppls = []
    for _ in range(200):
        idx = rng.randint(0, len(nll), size=len(nll))
        ppls.append(math.exp(nll[idx].sum() / tok[idx].sum()))
    assert a.ci_low == pytest.approx(np.percentile(ppls, 2.5), rel=1e-12)
    assert a.ci_high == pytest.approx(np.percentile(ppls, 97.5), rel=1e-12)
    assert a.ci_low < a.ppl < a.ci_high
    assert a.contract["bootstrap"] == {
        "resamples": 200, "seed": 42, "rng": "numpy.random.RandomState", "unit": "window",
        "percentiles": [2.5, 97.5],
    }


def test_windows_that_score_no_token_stay_out_of_the_bootstrap(tiny_lm):
    # N=9, window 4, stride 4: the tail window [8, 9) scores nothing (its one token has no
    # context); resampling it alone once gave exp(0 / 0 -> 1) = PPL 1.0 as the lower bound
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(11))
    res = perplexity_from_ids(tiny_lm, ids, window=4, stride=4, bootstrap=200, seed=42)
    assert res.windows == 3 and res.window_tokens == [3, 3, 0] and res.window_nll[2] == 0.0
    rng = np.random.RandomState(42)
    nll, tok = np.array(res.window_nll[:2]), np.array(res.window_tokens[:2])
    ppls = []
    for _ in range(200):
        idx = rng.randint(0, 2, size=2)
        ppls.append(math.exp(nll[idx].sum() / tok[idx].sum()))
    assert res.ci_low == pytest.approx(np.percentile(ppls, 2.5), rel=1e-12)
    assert res.ci_high == pytest.approx(np.percentile(ppls, 97.5), rel=1e-12)
    assert min(math.exp(x / 3) for x in nll) == pytest.approx(res.ci_low, rel=1e-12) and res.ci_low > 1.0
    # the released script's count leaves a one-token tail window empty too: (6, 8, 8)
    paper = perplexity_from_ids(tiny_lm, ids[:8], window=4, stride=3, paper_token_count=True, bootstrap=50)
    assert paper.window_tokens == [3, 2, 0] and paper.ci_low > 1.0
    # the paired dPPL interval ignores such windows as well (it used to divide by zero)
    worse = PerplexityResult.from_dict({**res.to_dict(), "window_nll": [x * 1.1 for x in res.window_nll]})
    low, high = delta_ppl_ci(res, worse, resamples=100)
    assert math.isfinite(low) and 0 < low <= high


def test_token_ids_outside_the_vocabulary_and_bad_batch_size_are_named(tiny_lm):
    with pytest.raises(ValueError) as err:
        perplexity_from_ids(tiny_lm, [5, 9, 300, 4], window=8, stride=4)
    assert str(err.value) == (
        "input_ids hold token id 300, but the model's input embedding has 300 rows: allowed ids 0..299 "
        "(is the tokenizer the model's own? padding positions count too)"
    )
    with pytest.raises(ValueError, match=r"hold token id -1,"):
        perplexity_from_ids(tiny_lm, [5, -1, 4], window=8, stride=4)
    with pytest.raises(ValueError, match=r"^batch_size=1.5: must be an int >= 1$"):
        perplexity_from_ids(tiny_lm, [5, 9, 4], window=8, stride=4, batch_size=1.5)


def test_generation_check_refuses_a_bare_string_and_empty_prompts(tiny_lm, byte_tokenizer):
    # a str is a sequence of characters: it used to run one prompt per character
    with pytest.raises(TypeError, match=r"^prompts='The quick': give a list of strings, e.g. \['The quick'\]$"):
        generation_check(tiny_lm, byte_tokenizer, "The quick", max_new_tokens=2)
    plain = byte_tokenizer.__class__(tokenizer_object=byte_tokenizer.backend_tokenizer, pad_token="<pad>")
    plain.backend_tokenizer.post_processor = None  # no BOS: an empty prompt has no token at all
    with pytest.raises(ValueError, match=r"^prompt 1 \(''\) gives no token: every prompt needs at least one$"):
        generation_check(tiny_lm, plain, ["Rivers", ""], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt 0 \(3\) gives no token"):
        generation_check(tiny_lm, byte_tokenizer, [3], max_new_tokens=2)


# ----------------------------------------------------------------------------- text API


def test_evaluate_perplexity_records_contract(tiny_lm, byte_tokenizer, tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(" = Title = \n\n" + CORPUS + "\n \n" + CORPUS + "\n")
    res = evaluate_perplexity(tiny_lm, path, tokenizer=byte_tokenizer, window=32, stride=16, max_words=40,
                              bootstrap=50)
    c = res.contract
    assert c["name"] == "matched" and c["window"] == 32 and c["stride"] == 16
    assert c["source"] == "file:wiki.test.raw" and c["dataset"] == "wikitext-2-raw-v1" and c["split"] == "test"
    assert c["words"] == 40 and c["max_words"] == 40
    assert c["bos"]["add_bos"] is True and c["bos"]["bos_choice"] == "tokenizer default"
    assert c["bos"]["bos_token_id"] == 1
    assert c["dtype"] == "float32" and set(c["versions"]) >= {"torch", "transformers"}
    prepared, _ = prepare_text(path.read_text(), 40)
    ids = byte_tokenizer(prepared).input_ids
    assert ids[0] == 1 and c["num_input_tokens"] == len(ids)
    assert res.tokens == len(ids) - 1  # BOS is context only; every other token scored once
    # same numbers from the ids directly, and from the string instead of the path
    direct = perplexity_from_ids(tiny_lm, ids, window=32, stride=16, bootstrap=50)
    assert (direct.nll, direct.ci_low, direct.ci_high) == (res.nll, res.ci_low, res.ci_high)
    from_string = evaluate_perplexity(tiny_lm, path.read_text(), tokenizer=byte_tokenizer, window=32, stride=16,
                                      max_words=40, bootstrap=0)
    assert from_string.nll == res.nll and from_string.contract["text_sha256"] == c["text_sha256"]
    # BOS forced off: one token fewer, recorded
    no_bos = evaluate_perplexity(tiny_lm, path, tokenizer=byte_tokenizer, window=32, stride=16, max_words=40,
                                 bootstrap=0, add_bos=False)
    assert no_bos.contract["bos"] == {**c["bos"], "add_bos": False, "bos_token_id": None, "bos_choice": "explicit"}
    assert no_bos.contract["num_input_tokens"] == len(ids) - 1
    # JSON-ready round trip
    assert PerplexityResult.from_dict(res.to_dict()) == res


def test_every_contract_records_the_weights_it_measured(tiny_lm, byte_tokenizer):
    """The card checks that a published perplexity was measured on the model it describes:
    each contract, the rolling one too, names the weights by their fingerprint."""
    from hf_layerswap.layerplan import model_fingerprint

    for contract, options in (("matched", dict(stride=16)), ("rolling", {})):
        res = evaluate_perplexity(tiny_lm, [CORPUS], tokenizer=byte_tokenizer, contract=contract, window=32,
                                  bootstrap=0, **options)
        assert res.contract["model"]["fingerprint"] == model_fingerprint(tiny_lm), contract
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5))
    assert perplexity_from_ids(tiny_lm, ids, window=32, stride=16).contract["model"] == {
        "fingerprint": model_fingerprint(tiny_lm)}


def test_evaluate_perplexity_errors(tiny_lm, byte_tokenizer):
    with pytest.raises(ValueError, match="contract='paper'"):
        evaluate_perplexity(tiny_lm, CORPUS, tokenizer=byte_tokenizer, contract="paper")
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        evaluate_perplexity(tiny_lm, CORPUS, tokenizer=byte_tokenizer, contract="full")
    with pytest.raises(FileNotFoundError, match="wiki.tst.raw.*no such file"):
        evaluate_perplexity(tiny_lm, "data/wiki.tst.raw", tokenizer=byte_tokenizer)
    with pytest.raises(TypeError, match="int"):
        evaluate_perplexity(tiny_lm, 5, tokenizer=byte_tokenizer)


def test_embedded_default_text(tiny_lm, byte_tokenizer):
    res = evaluate_perplexity(tiny_lm, None, tokenizer=byte_tokenizer, window=64, stride=32, max_words=60,
                              bootstrap=0)
    assert res.contract["source"] == "embedded:pydoc_data.topics"
    assert res.contract["split"] == "evaluation"
    assert res.contract["words"] == 60 and math.isfinite(res.ppl)


def test_delta_ppl(tiny_lm):
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(8))
    base = perplexity_from_ids(tiny_lm, ids, window=16, stride=8, bootstrap=0)
    assert delta_ppl_percent(10.0, 12.5) == pytest.approx(25.0)
    assert delta_ppl_percent(base, base) == 0.0
    assert delta_ppl_ci(base, base) == (0.0, 0.0)
    other = perplexity_from_ids(tiny_lm, ids, window=16, stride=4, bootstrap=0)
    with pytest.raises(ValueError, match="stride"):
        delta_ppl_percent(base, other)
    worse = PerplexityResult.from_dict({**base.to_dict(), "window_nll": [x * 1.1 for x in base.window_nll]})
    low, high = delta_ppl_ci(base, worse, resamples=300)
    assert 0 < low <= high


# ----------------------------------------------------------------------------- evaluate module


def test_evaluate_module_offline(tiny_lm, byte_tokenizer):
    import evaluate

    metric = evaluate.load(perplexity_metric_path())
    kwargs = dict(window=32, stride=16, max_words=50, bootstrap=100)
    out = metric.compute(model=tiny_lm, tokenizer=byte_tokenizer, text=CORPUS, **kwargs)
    ref = evaluate_perplexity(tiny_lm, CORPUS, tokenizer=byte_tokenizer, **kwargs)
    assert out["perplexity"] == ref.ppl and out["tokens"] == ref.tokens
    assert (out["ci_low"], out["ci_high"]) == (ref.ci_low, ref.ci_high)
    texts = [CORPUS[:120], CORPUS[120:]]
    out2 = metric.compute(predictions=texts, model=tiny_lm, tokenizer=byte_tokenizer, **kwargs)
    ref2 = evaluate_perplexity(tiny_lm, texts, tokenizer=byte_tokenizer, **kwargs)
    assert out2["perplexity"] == ref2.ppl


# ----------------------------------------------------------------------------- generation


def test_distinct_n_hand_computed():
    assert distinct_n([1, 2, 1, 2, 1]) == 0.5  # bigrams 12 21 12 21 -> 2 distinct of 4
    assert distinct_n([1, 2, 3]) == 1.0
    assert distinct_n([7]) is None
    assert distinct_n([1, 1, 1, 1], n=1) == 0.25


def test_generation_check_tiny(byte_tokenizer):
    model = tiny_model("llama", num_blocks=2)
    model.resize_token_embeddings(len(byte_tokenizer))
    check = generation_check(model, byte_tokenizer, ["The quick brown", "Rivers carry"], max_new_tokens=8)
    assert check.cache_consistent and check.cache_mismatches == [] and check.cache_errors == {}
    assert [len(t) for t in check.new_tokens] == [8, 8]
    for toks, d2 in zip(check.new_tokens, check.distinct_2):
        assert d2 == distinct_n(toks)
    assert check.repetition_rate == pytest.approx(1 - np.mean(check.distinct_2))
    assert GenerationCheck.from_dict(check.to_dict()) == check


def test_generation_check_detects_broken_cache(byte_tokenizer):
    """Two blocks sharing one ``layer_idx`` corrupt the cache: generation with it differs."""
    model = tiny_model("llama", num_blocks=2)
    model.resize_token_embeddings(len(byte_tokenizer))
    model.model.layers[1].self_attn.layer_idx = 0
    check = generation_check(model, byte_tokenizer, ["The quick brown", "Rivers carry"], max_new_tokens=8)
    assert not check.cache_consistent and check.cache_mismatches == [0, 1]
    assert set(check.cache_errors) == {0, 1} and "RuntimeError" in check.cache_errors[0]
    assert [len(t) for t in check.new_tokens] == [8, 8]  # the no-cache continuations
    import json

    assert GenerationCheck.from_dict(json.loads(json.dumps(check.to_dict()))) == check


# ----------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_smollm2_matched_wikitext(smollm2, wikitext_test_raw):
    model, tokenizer = smollm2
    start = time.perf_counter()
    res = evaluate_perplexity(model, wikitext_test_raw, tokenizer=tokenizer)
    elapsed = time.perf_counter() - start
    print(f"SmolLM2-135M matched WikiText-2 test PPL {res.ppl:.3f} [{res.ci_low:.3f}, {res.ci_high:.3f}] "
          f"{res.tokens} tokens / {res.windows} windows in {elapsed:.1f}s")
    c = res.contract
    assert c["words"] == CONTRACTS["matched"]["max_words"] and c["bos"]["add_bos"] is False
    assert c["model"]["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "path" not in c["model"]
    assert res.windows == len(sliding_windows(c["num_input_tokens"], 512, 256))
    assert res.tokens == c["num_input_tokens"] - 1
    assert 5000 < res.tokens < 7000
    assert 8 < res.ppl < 40  # a 135M model on WikiText-2 raw
    assert res.ci_low < res.ppl < res.ci_high


@pytest.mark.slow
def test_smollm2_generation(smollm2):
    model, tokenizer = smollm2
    check = generation_check(model, tokenizer, ["The capital of France is"], max_new_tokens=12)
    assert check.cache_consistent
    assert "Paris" in check.continuations[0]
    assert check.mean_distinct_2 > 0.5


def test_one_window_has_no_confidence_interval(tiny_lm):
    """One window resampled 1,000 times is one value: the "95% CI" used to be [ppl, ppl].
    Now it is absent (None), and printed and rendered as such."""
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5))
    one = perplexity_from_ids(tiny_lm, ids, window=64, stride=32)  # 40 tokens: one window
    assert one.windows == 1 and one.tokens == 39
    assert one.ci_low is None and one.ci_high is None
    assert "ci_low=None, ci_high=None" in repr(one)
    assert one.ci_text() == "none (1 scored window: a bootstrap over windows needs 2)"
    assert PerplexityResult.from_dict(one.to_dict()) == one
    other = perplexity_from_ids(tiny_lm, (ids + 7) % 300, window=64, stride=32)
    assert delta_ppl_ci(one, other) == (None, None)
    two = perplexity_from_ids(tiny_lm, torch.cat([ids, ids]), window=64, stride=32)  # 80 tokens: two windows
    assert two.windows == 2 and two.ci_low < two.ci_high
    assert two.ci_text() == f"[{two.ci_low:.3f}, {two.ci_high:.3f}]"
    assert perplexity_from_ids(tiny_lm, ids, window=64, stride=32, bootstrap=0).ci_text() == "none (bootstrap=0)"

    from hf_layerswap.card import render_card

    text = render_card(tiny_lm, evaluation={"base": one.to_dict(), "pruned": other.to_dict()}).text
    rows = [line for line in text.splitlines() if line.startswith(("| base |", "| pruned (this model) |"))]
    assert len(rows) == 2 and all("| none (1 window) |" in row for row in rows), rows


# ------- text that looks like a path, models without a head, the progress bar


def test_literal_text_that_looks_like_a_path_goes_in_a_list(matrix_llama, matrix_tokenizer):
    path_like = "see docs/usage.txt"
    as_list = hl.evaluate_perplexity(matrix_llama, [path_like], tokenizer=matrix_tokenizer, window=16, stride=8,
                                     bootstrap=0)
    assert as_list.contract["source"] == "list of 1 strings"
    assert as_list.tokens == len(path_like) - 1  # one token per character, the first is context only
    # prose with no separator and no file suffix stays text, and so does several lines of it
    prose = hl.evaluate_perplexity(matrix_llama, "A plain sentence, no path.", tokenizer=matrix_tokenizer, window=16,
                                   stride=8, bootstrap=0)
    assert prose.contract["source"] == "string" and prose.tokens == 25
    lines = hl.evaluate_perplexity(matrix_llama, "first line with a/b\nsecond line.txt", tokenizer=matrix_tokenizer,
                                   window=16, stride=8, bootstrap=0)
    assert lines.contract["source"] == "string"


def test_perplexity_refuses_a_model_without_a_language_model_head(matrix_tokenizer):
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    bert = BertModel(BertConfig(vocab_size=128, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32)).eval()
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2)).eval()
    for model, message in ((bert, "BertModel has no language-model head (get_output_embeddings() is None)"),
                           (t5, "T5ForConditionalGeneration is an encoder-decoder model")):
        calls, handle = count_forwards(model)
        try:
            with pytest.raises(ValueError, match=re.escape(message)):
                hl.evaluate_perplexity(model, PARAGRAPHS, tokenizer=matrix_tokenizer, bootstrap=0)
            with pytest.raises(ValueError, match=re.escape(message)):
                perplexity_from_ids(model, torch.arange(4, 40), window=16, stride=8, bootstrap=0)
        finally:
            handle.remove()
        assert calls == []


def test_the_perplexity_bar_counts_tokens_per_batch_of_windows(progress_bars, matrix_llama, matrix_tokenizer):
    result = hl.evaluate_perplexity(matrix_llama, PARAGRAPHS, tokenizer=matrix_tokenizer, window=32, stride=16,
                                    batch_size=2, bootstrap=0, progress=True)
    (bar,) = [b for b in progress_bars if b.desc == "perplexity windows"]
    windows = result.windows
    fed = sum(min(begin + 32, result.contract["num_input_tokens"]) - begin
              for begin in range(0, result.contract["num_input_tokens"] - 16, 16))
    assert bar.total == fed and sum(bar.updates) == fed
    assert len(bar.updates) >= windows // 2
    assert max(bar.updates) == 2 * 32
    hl.evaluate_perplexity(matrix_llama, PARAGRAPHS, tokenizer=matrix_tokenizer, window=32, stride=16, bootstrap=0,
                           progress=False)
    assert all(b.disable for b in progress_bars[1:])
