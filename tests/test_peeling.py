"""Peeling reference bounds (arXiv 2605.02853, per-site form): exact references, flags on
constructed blocks, the substitution against an independent removal, calibration/evaluation
separation, the gradient reference, training trajectories, round trips, the CLI verb, and
one real-model run on SmolLM2-135M."""

from __future__ import annotations

import argparse
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from hf_layerswap.calibration import build_calibration, embedded_text, split_paragraphs
from hf_layerswap.peeling import (
    PeelReport,
    PeelTrajectory,
    build_evaluation,
    check_disjoint,
    peel,
    peel_plot,
    peel_table_markdown,
    peel_trajectory,
    sequence_nll,
    trajectory_plot,
    trajectory_table_markdown,
)
from hf_layerswap.cli.peel import add_peel_arguments, run_peel
from hf_layerswap.layerplan import decoder_blocks
from hf_layerswap.surgery import remove_layers

VOCAB = 128


def skip_bigram(n: int, length: int, seed: int, follow: float = 0.75) -> dict:
    """Synthetic text where token t is perm(token t-2) with probability ``follow``, else
    uniform: predicting it needs attention to the previous-but-one position."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    for t in range(2, length):
        keep = torch.rand(n, generator=g) < follow
        ids[:, t] = torch.where(keep, perm[ids[:, t - 2]], ids[:, t])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


CALIB = skip_bigram(48, 32, seed=1)
EVAL = skip_bigram(32, 32, seed=2)


@pytest.fixture(scope="module")
def trained():
    """A 4-block tiny Llama trained 80 AdamW steps on the skip-bigram task, with block 2
    identity-like: its attention and MLP writes scaled by 1e-3 and frozen during training."""
    model = tiny_model("llama", num_blocks=4)
    blocks = decoder_blocks(model)[2]
    frozen = [blocks[2].self_attn.o_proj.weight, blocks[2].mlp.down_proj.weight]
    with torch.no_grad():
        for w in frozen:
            w.mul_(1e-3)
    for w in frozen:
        w.requires_grad_(False)
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(80):
        batch = skip_bigram(16, 32, seed=1000 + step)
        loss = model(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    for w in frozen:
        w.requires_grad_(True)
    return model.eval()


class LinearBlock(nn.Module):
    """A decoder block whose forward is exactly ``h ↦ h W + b`` at every position."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states @ self.weight + self.bias


def independent_ce(model, batch) -> float:
    """Token-weighted next-token CE of a plain forward (no hooks, no plans)."""
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    valid = mask[:, :-1] & mask[:, 1:]
    return float(F.cross_entropy(logits[:, :-1][valid], ids[:, 1:][valid], reduction="mean"))


# ----------------------------------------------------------------------------- exactness


def test_exactly_linear_blocks_are_matched_to_numerical_precision():
    model = tiny_model("llama", num_blocks=4)
    owner, name, blocks = decoder_blocks(model)
    g = torch.Generator().manual_seed(11)
    hidden = model.config.hidden_size
    for k in (1, 2, 3):  # blocks 1..3 exactly affine: every own, span-2 and "later" map from sites 1..3 is affine
        w = torch.eye(hidden) + 0.3 * torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden)
        blocks[k] = LinearBlock(w, 0.05 * torch.randn(hidden, generator=g))
    report = peel(model, CALIB, EVAL, spans=(1, 2), targets="own+later", ridge=0.0, sites=[1, 2, 3])
    assert {(p.site, p.span, p.kind) for p in report.probes} == {
        (1, 1, "own"), (2, 1, "own"), (3, 1, "own"), (1, 2, "own"), (2, 2, "own"), (1, 3, "later")
    }
    for p in report.probes:
        assert abs(p.dce) < 1e-5, p
        assert abs(p.ci_low) < 1e-5 and abs(p.ci_high) < 1e-5, p
        assert p.explained_variance > 1 - 1e-8, p
        assert p.nmse < 1e-8, p
        assert p.flag == "matched"
        assert p.fit["lambda"] == 0.0
    # the same blocks against plain deletion: far from matched
    deleted = peel(model, CALIB, EVAL, spans=(1,), targets="own", reference="deletion", sites=[1])
    assert deleted.probes[0].nmse == pytest.approx(1.0)
    assert abs(deleted.probes[0].dce) > 1e-3


def test_deletion_probe_equals_an_independent_removal():
    """The plan-based substitution with ĥ = h_k is plain removal: compare with surgery."""
    model = tiny_model("llama", num_blocks=4)
    base = independent_ce(model, EVAL)
    report = peel(model, CALIB, EVAL, spans=(1, 2), targets="own", reference="deletion", sites=[0, 2, 3])
    assert report.base_ce == pytest.approx(base, abs=1e-6)
    for p in report.probes:
        pruned = remove_layers(copy.deepcopy(model), list(range(p.site, p.site + p.span)))
        assert p.ce == pytest.approx(independent_ce(pruned, EVAL), abs=1e-6), p
        assert p.dce == pytest.approx(p.ce - report.base_ce, abs=1e-12)
        assert p.ci_low <= p.dce <= p.ci_high
    # the cut that reaches the last block (site 2, span 2; site 3, span 1) took the output-hook path
    assert report.probe(2, 2, "deletion") is not None and report.probe(3, 1, "deletion") is not None


def test_sequence_nll_hand_computed():
    logits = torch.zeros(2, 3, 4)
    logits[0, 0, 2] = math.log(3.0)  # p(token 2) = 3/6 at position 0
    ids = torch.tensor([[0, 2, 1], [1, 1, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    nll, count = sequence_nll(logits, ids, mask)
    assert count.tolist() == [2, 1]
    assert nll[0].item() == pytest.approx(-math.log(0.5) + math.log(4.0))
    assert nll[1].item() == pytest.approx(math.log(4.0))


# ----------------------------------------------------------------------------- flags


def test_identity_like_block_is_flagged_and_useful_blocks_are_not(trained):
    report = peel(trained, CALIB, EVAL, spans=(1,), targets="own")
    gaps = report.layer_gaps(1)
    flags = {p.site: p.flag for p in report.probes}
    assert flags[2] == "matched"
    assert abs(gaps[2]) < 1e-3
    # the trained blocks do work no linear map does: positive gaps, CIs above tau, unflagged
    for k in (0, 1, 3):
        p = report.probe(k, 1)
        assert p.ci_low > report.settings["tau"], p
        assert p.flag == ""
    assert report.flagged("matched") == [report.probe(2, 1)]
    assert report.flagged("beaten") == []


def test_noisy_block_is_beaten_by_its_reference(trained):
    model = copy.deepcopy(trained)
    down = decoder_blocks(model)[2][2].mlp.down_proj
    with torch.no_grad():  # block 2 now writes a large random nonlinear function into the stream
        down.weight.copy_(0.3 * torch.randn(down.weight.shape, generator=torch.Generator().manual_seed(7)))
    report = peel(model, CALIB, EVAL, spans=(1,), targets="own", reference=("linear", "deletion"), sites=[1, 2])
    for ref in ("linear", "deletion"):
        p = report.probe(2, 1, ref)
        assert p.dce < 0 and p.ci_high < 0, p
        assert p.flag == "beaten"
        assert report.probe(1, 1, ref).flag == ""
    assert report.peel_bound.site == 2 and report.peel_bound.reference == "linear"
    assert report.peel_bound.dce < 0


def test_gradient_reference_is_a_reinitialised_block_that_learns(trained):
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    report = peel(trained, CALIB, EVAL, spans=(1,), targets="own", reference="gradient", sites=[1],
                  gradient_steps=40, gradient_lr=3e-3)
    (p,) = report.probes
    assert p.reference == "gradient" and p.kind == "own"
    fit = p.fit
    # a fresh initialisation: the copy starts far from block 1 (a copy of it would start at 0)
    assert fit["initial_loss"] > 0.2
    assert fit["final_loss"] < 0.5 * fit["initial_loss"]
    assert math.isfinite(p.dce) and 0 < p.explained_variance < 1
    assert report.settings["gradient_steps"] == 40
    after = trained.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model itself is untouched


# ----------------------------------------------------------------------------- data separation


def char_tokenizer():
    """A real fast tokenizer (BPE trained on the embedded calibration prose) within the
    tiny models' vocabulary of 128."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, limit_alphabet=60, special_tokens=["<unk>", "<pad>"])
    tok.train_from_iterator(split_paragraphs(embedded_text("calibration"))[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    assert len(fast) <= VOCAB
    return fast


def test_default_calibration_and_evaluation_text_never_overlap():
    tokenizer = char_tokenizer()
    cal_paras = [" ".join(p.split()) for p in split_paragraphs(embedded_text("calibration"))]
    eval_list = split_paragraphs(embedded_text("evaluation"))
    eval_paras = {" ".join(p.split()) for p in eval_list}
    assert len(eval_paras) > 100
    # no evaluation paragraph occurs in, or contains, a calibration paragraph
    assert not any(e in c or c in e for e in eval_paras for c in cal_paras)
    evalset = build_evaluation(None, tokenizer, num_prompts=1000, seq_len=48)
    assert evalset.texts == eval_list
    check_disjoint(build_calibration(None, tokenizer, num_prompts=1000, seq_len=48), evalset)
    model = tiny_model("llama", num_blocks=3)
    report = peel(model, None, None, tokenizer=tokenizer, spans=(1,), targets="own", sites=[1],
                  num_prompts=24, seq_len=48, eval_prompts=8, eval_seq_len=48, bootstrap=200)
    assert "calibration split" in report.metadata["calibration"]["description"]
    assert "evaluation split" in report.metadata["evaluation"]["description"]
    assert report.metadata["calibration"]["content_hash"] != report.metadata["evaluation"]["content_hash"]
    cal = build_calibration(None, tokenizer, num_prompts=24, seq_len=48)
    assert not {" ".join(t.split()) for t in cal.texts} & eval_paras


def test_overlapping_calibration_and_evaluation_are_refused():
    model = tiny_model("llama", num_blocks=3)
    with pytest.raises(ValueError, match="also a calibration prompt"):
        peel(model, CALIB, CALIB, spans=(1,))
    mixed = {k: torch.cat([EVAL[k][:4], CALIB[k][5:6]]) for k in EVAL}
    with pytest.raises(ValueError, match="evaluation prompt 4"):
        peel(model, CALIB, mixed, spans=(1,))
    tokenizer = char_tokenizer()
    paras = split_paragraphs(embedded_text("calibration"))[:12]
    cal = build_calibration(paras, tokenizer, num_prompts=12, seq_len=40)
    inner = paras[3][: len(paras[3]) // 2]  # a paragraph contained in a calibration paragraph
    ev = build_calibration([inner] + split_paragraphs(embedded_text("evaluation"))[:3], tokenizer, seq_len=40)
    with pytest.raises(ValueError, match="overlaps calibration paragraph"):
        check_disjoint(cal, ev)


def test_bad_arguments_name_the_value():
    model = tiny_model("llama", num_blocks=3)
    for kwargs, pattern in [
        ({"spans": (0,)}, r"span 0"),
        ({"spans": (3,)}, r"span 3 .* 1\.\.2"),
        ({"targets": "everything"}, r"targets='everything'"),
        ({"reference": "quadratic"}, r"reference='quadratic'"),
        ({"ridge": -1.0}, r"ridge=-1\.0"),
        ({"tau": -0.1}, r"tau=-0\.1"),
        ({"bootstrap": 10}, r"bootstrap=10"),
        ({"sites": [5]}, r"layer index 5"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            peel(model, CALIB, EVAL, **kwargs)


# ----------------------------------------------------------------------------- reports


def test_report_round_trip_table_and_plot(trained, tmp_path):
    report = peel(trained, CALIB, EVAL, spans=(1, 2), targets="own+later", reference=("linear", "deletion"))
    path = report.to_json(tmp_path / "peel.json")
    back = PeelReport.from_json(path)
    assert back == report
    assert back.to_dict() == json.loads(path.read_text())
    assert back.layer_gaps(2) == report.layer_gaps(2)
    assert report.later_gaps()[0] is None and report.later_gaps()[1] == report.probe(1, 3).dce
    table = peel_table_markdown(report)
    lines = table.splitlines()
    assert lines[0].startswith("| layer | EV k | ΔCE k [95% CI] | EV k..k+1 |")
    assert len([ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]) == 4
    assert "matched (linear, span 1)" in lines[2 + 2]
    png = peel_plot(report, tmp_path / "plots" / "peel.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary file left behind


# ----------------------------------------------------------------------------- trajectory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, trained):
    root = tmp_path_factory.mktemp("run")
    dirs = []
    for step, model in ((0, tiny_model("llama", num_blocks=4)), (80, trained)):
        d = root / f"step-{step}"
        model.save_pretrained(d)
        dirs.append(d)
    return dirs


def test_trajectory_over_saved_checkpoints_is_deterministic(checkpoints, tmp_path):
    kwargs = dict(spans=(1,), targets="own+later", max_gap=2, swap_prompts=16, swap_seq_len=32, bootstrap=200)
    first = peel_trajectory(checkpoints, CALIB, EVAL, **kwargs)
    second = peel_trajectory([str(d) for d in checkpoints], CALIB, EVAL, **kwargs)
    assert first.to_dict(timings=False) == second.to_dict(timings=False)
    assert first.steps == [0, 80]
    gaps = first.gap_matrix(1)
    assert len(gaps) == 2 and all(len(row) == 4 for row in gaps)
    assert gaps[0] != gaps[1]
    assert first.points[1].peel.base_ce < first.points[0].peel.base_ce  # training lowered the CE
    series = first.protocol_gap_series()
    assert set(series) == {"0-1", "1-2", "2-3", "0-2", "1-3"}
    pair = first.points[1].swap.pair(0, 1)
    assert series["0-1"][1] == pair.interchange / pair.replacement
    back = PeelTrajectory.from_json(first.to_json(tmp_path / "traj.json"))
    assert back.to_dict() == first.to_dict()
    assert trajectory_plot(first, tmp_path / "traj.png").read_bytes()[:4] == b"\x89PNG"
    table = trajectory_table_markdown(first)
    assert table.splitlines()[2].startswith("| 0 |") and table.splitlines()[3].startswith("| 80 |")


def test_cli_verb_single_checkpoint(checkpoints, tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(checkpoints[1])
    parser = argparse.ArgumentParser()
    add_peel_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args([
        str(checkpoints[1]), "--spans", "1", "--targets", "own", "--num-prompts", "24", "--seq-len", "48",
        "--eval-prompts", "8", "--eval-seq-len", "48", "--bootstrap", "200", "-o", str(out),
        "--plot", str(tmp_path / "p.png"), "--table", str(tmp_path / "t.md"),
    ])
    assert run_peel(args) == 0
    report = PeelReport.from_json(out)
    assert [p.site for p in report.probes] == [0, 1, 2, 3]
    assert (tmp_path / "t.md").read_text() == peel_table_markdown(report)
    assert (tmp_path / "p.png").is_file()


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_linear_references_on_wikitext(smollm2, wikitext_valid, wikitext_test_raw):
    model, tokenizer = smollm2
    report = peel(model, wikitext_valid, wikitext_test_raw, tokenizer=tokenizer, spans=(1,), targets="own",
                  reference=("linear", "deletion"), sites=[28, 29], num_prompts=16, seq_len=64,
                  eval_prompts=4, eval_seq_len=64, batch_size=4, bootstrap=300)
    assert 1.5 < report.base_ce < 6.0
    for k in (28, 29):  # site 29 replaces the last block: the output-hook path on a real model
        lin, dele = report.probe(k, 1, "linear"), report.probe(k, 1, "deletion")
        # the last blocks' updates are largely linear: the map explains most of them held out and
        # its hybrid is closer to the model than plain removal, in the stream and in CE
        assert 0.5 < lin.explained_variance <= 1 and lin.nmse < dele.nmse == pytest.approx(1.0)
        assert math.isfinite(lin.dce) and lin.ci_low <= lin.dce <= lin.ci_high
        assert lin.dce < dele.dce
    assert report.metadata["calibration_tokens_used"] > 577
