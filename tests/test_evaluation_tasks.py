"""lm-eval in the loop: evaluate_tasks through lm-eval's Python API on a local task folder,
the "rolling" perplexity contract against lm-eval's rolling loglikelihood, the card section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from arch_matrix import tiny_tokenizer
from conftest import tiny_model

import hf_layerswap as hl
from hf_layerswap.card import render_card

pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
WINDOW = 32  # lm-eval max_length; the tiny models have 128 positions


def _docs():
    return [json.loads(line)["text"] for line in (TASKS / "layerswap_rolling.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def base_and_pruned():
    base = tiny_model("llama", 6)
    pruned = tiny_model("llama", 6)
    hl.remove_layers(pruned, [2, 4])
    return base, pruned


@pytest.fixture(scope="module")
def results(base_and_pruned, tok):
    return {
        name: hl.evaluate_tasks(model, ["layerswap_mc", "layerswap_rolling"], tokenizer=tok, include_path=TASKS,
                                max_length=WINDOW)
        for name, model in zip(("base", "pruned"), base_and_pruned)
    }


@torch.no_grad()
def _continuation_ll(model, tok, context: str, continuation: str) -> float:
    ctx = tok(context)["input_ids"]
    ids = torch.tensor([tok(context + continuation)["input_ids"]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return float(sum(logp[t - 1, ids[0, t]] for t in range(len(ctx), ids.shape[1])))


@pytest.mark.parametrize("which", ["base", "pruned"])
def test_multiple_choice_accuracy_matches_direct_scoring(results, base_and_pruned, tok, which):
    model = dict(zip(("base", "pruned"), base_and_pruned))[which]
    docs = [json.loads(line) for line in (TASKS / "layerswap_mc.jsonl").read_text().splitlines()]
    hits, hits_norm = [], []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        lls = [_continuation_ll(model, tok, context, " " + c) for c in doc["choices"]]
        norm = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        hits.append(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])
        hits_norm.append(max(range(len(norm)), key=norm.__getitem__) == doc["answer"])
    got = results[which]
    assert got.results["layerswap_mc"]["acc"] == pytest.approx(sum(hits) / len(docs))
    assert got.results["layerswap_mc"]["acc_norm"] == pytest.approx(sum(hits_norm) / len(docs))
    assert got.n_samples == {"layerswap_mc": 8, "layerswap_rolling": 4}
    assert got.versions["lm_eval"] == __import__("lm_eval").__version__
    assert got.versions["layerswap_mc"] == 1.0
    assert len(got.task_hashes["layerswap_mc"]) == 64
    assert got.settings["num_fewshot"] == 0 and got.settings["max_length"] == WINDOW
    assert got.higher_is_better == {"layerswap_mc": {"acc": True, "acc_norm": True},
                                    "layerswap_rolling": {"word_perplexity": False, "byte_perplexity": False,
                                                          "bits_per_byte": False}}


@pytest.mark.parametrize("which", ["base", "pruned"])
def test_rolling_contract_matches_lm_eval_rolling_loglikelihood(results, base_and_pruned, tok, which):
    model = dict(zip(("base", "pruned"), base_and_pruned))[which]
    lm_eval_ll = results[which].loglikelihoods["layerswap_rolling"]
    docs = _docs()
    assert len(lm_eval_ll) == len(docs)
    for doc, ll in zip(docs, lm_eval_ll):
        ours = hl.evaluate_perplexity(model, [doc], tokenizer=tok, contract="rolling", window=WINDOW, bootstrap=0)
        assert ours.tokens == len(doc)  # character tokenizer, no BOS: every character is scored
        assert abs(-ours.nll - ll) < 1e-4
    both = hl.evaluate_perplexity(model, docs, tokenizer=tok, contract="rolling", window=WINDOW, bootstrap=0)
    assert abs(-both.nll - sum(lm_eval_ll)) < 1e-4
    assert both.contract["name"] == "rolling" and both.contract["bos"]["prefix_token"] == "bos"
    # lm-eval's own perplexity metrics follow from the same total
    words = sum(len(d.split()) for d in docs)
    assert results[which].results["layerswap_rolling"]["word_perplexity"] == pytest.approx(
        float(torch.tensor(both.nll / words, dtype=torch.float64).exp()), rel=1e-6)


def test_rolling_differs_from_full_in_counted_tokens(base_and_pruned, tok):
    model = base_and_pruned[1]
    doc = _docs()[0]
    rolling = hl.evaluate_perplexity(model, [doc], tokenizer=tok, contract="rolling", window=WINDOW, bootstrap=0)
    full = hl.evaluate_perplexity(model, doc, tokenizer=tok, contract="full", window=WINDOW, stride=WINDOW,
                                  bootstrap=0)
    n = len(doc)
    assert rolling.windows == full.windows == -(-n // WINDOW)
    assert rolling.tokens == n and full.tokens == n - full.windows
    assert rolling.ppl != pytest.approx(full.ppl, rel=1e-3)
    with pytest.raises(ValueError, match="window= .* only"):
        hl.evaluate_perplexity(model, doc, tokenizer=tok, contract="rolling", stride=8)


def test_card_renders_task_table_and_model_index(results, base_and_pruned):
    from huggingface_hub.repocard_data import model_index_to_eval_results

    card = render_card(base_and_pruned[1], tasks=results, repo_id="user/tiny-pruned")
    text = str(card)
    acc_b = results["base"].results["layerswap_mc"]["acc"]
    acc_p = results["pruned"].results["layerswap_mc"]["acc"]
    assert f"| layerswap_mc | acc | {acc_b:.4f}" in text and f"{acc_p:.4f}" in text
    assert "## Task evaluation (lm-evaluation-harness)" in text
    assert results["pruned"].task_hashes["layerswap_mc"][:12] in text
    _, evals = model_index_to_eval_results(card.data.to_dict()["model-index"])
    got = {(r.task_name, r.metric_name): r.metric_value for r in evals}
    assert got[("layerswap_mc", "acc (this model)")] == round(acc_p, 4)
    assert got[("layerswap_mc", "acc (base model, same settings)")] == round(acc_b, 4)

    other = hl.TaskResults.from_dict({**results["base"].to_dict(),
                                      "settings": {**results["base"].settings, "num_fewshot": 5}})
    with pytest.raises(ValueError, match="differ in settings"):
        render_card(base_and_pruned[1], tasks={"base": other, "pruned": results["pruned"]})


def test_unknown_task_is_refused(base_and_pruned, tok):
    with pytest.raises(ValueError, match="unknown lm-eval task"):
        hl.evaluate_tasks(base_and_pruned[0], "no_such_task", tokenizer=tok, include_path=TASKS)
    missing = TASKS.parent / "no_such_folder"
    with pytest.raises(FileNotFoundError, match=f"include_path={str(missing)!r} is not a folder"):
        hl.evaluate_tasks(base_and_pruned[0], "layerswap_mc", tokenizer=tok, include_path=[TASKS, missing])
