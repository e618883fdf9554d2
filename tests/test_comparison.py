"""Baseline criteria and the comparison harness: hand-checkable facts on tiny models.

Facts checked: the Block Influence of an identity block is 0 and equals 1 - cos from an
independent path; angular distance finds a planted run of identity blocks; single-removal
KL and SLEB's NLL equal values from really pruned copies; SLEB's first pick is the argmin
of single-removal NLL; random is reproducible by seed; tail is ``L-1-n .. L-2``; the beam
never scores worse than the greedy set and never reads the evaluation text; evaluating by
a pruned copy and by a removal plan gives the same perplexity.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import HeadReads, head_offloaded_llama, tiny_batch, tiny_model

from hf_layerswap import comparison as B
from hf_layerswap.calibration import CalibrationSet, build_calibration, embedded_text
from hf_layerswap.layerplan import decoder_blocks, removal_plan
from hf_layerswap.recovery import RECOVERY_METHODS
from hf_layerswap.scoring.report import PairResult, SwapReport
from hf_layerswap.scoring import removal_kl, score_layers
from hf_layerswap.selection import select_layers
from hf_layerswap.selection.beam import interchange_beam
from hf_layerswap.selection.criterion import CriterionResult
from hf_layerswap.selection.geometry import angular_distance, block_influence
from hf_layerswap.selection.greedy import swap_guided
from hf_layerswap.selection.nll import plan_nll
from hf_layerswap.selection.single_removal import single_removal_kl
from hf_layerswap.selection.sleb import sleb
from hf_layerswap.surgery import remove_layers


def make_identity(model, layers):
    """Zero the output projections of ``layers``: each such block then returns its input
    exactly (both residual branches add 0)."""
    _, _, blocks = decoder_blocks(model)
    with torch.no_grad():
        for i in layers:
            blocks[i].self_attn.o_proj.weight.zero_()
            blocks[i].mlp.down_proj.weight.zero_()
    return model


def calib_set(batch=4, length=12, seed=1):
    return build_calibration(tiny_batch(batch, length, seed=seed))


def char_tokenizer():
    """A character-level fast tokenizer with ids < 128 (the tiny models' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def direct_kl(model, pruned, calib):
    """E_x KL(p_model || p_pruned): mean over real positions per prompt, then prompts."""
    with torch.no_grad():
        p = torch.log_softmax(model(**_inputs(calib)).logits.double(), -1)
        q = torch.log_softmax(pruned(**_inputs(calib)).logits.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    mask = calib.attention_mask.double()
    return float(((kl * mask).sum(1) / mask.sum(1)).mean())


def _inputs(calib):
    return {"input_ids": calib.input_ids, "attention_mask": calib.attention_mask, "use_cache": False}


def hf_nll(model, calib):
    """Pooled calibration NLL per token from transformers' own loss (pads ignored)."""
    labels = calib.input_ids.masked_fill(calib.attention_mask == 0, -100)
    with torch.no_grad():
        return float(model(**_inputs(calib), labels=labels).loss)


def pruned_copy(model, removed):
    return remove_layers(copy.deepcopy(model), removed)


# ----------------------------------------------------------------------------- block influence


def test_block_influence_identity_block_is_zero_and_matches_hidden_states():
    model = make_identity(tiny_model("llama", 6), [2])
    with torch.no_grad():  # a non-uniform final norm (a unit-weight RMSNorm only rescales, leaving cos unchanged)
        model.model.norm.weight.copy_(torch.linspace(0.2, 3.0, model.config.hidden_size))
    calib = calib_set()
    res = block_influence(model, calib, 1)
    assert res.removed == [2]
    assert abs(res.scores[2]) < 1e-12
    assert min(s for i, s in enumerate(res.scores) if i != 2) > 1e-3
    assert (res.forward_passes, res.block_passes) == (1, 6)
    # independent path: output_hidden_states entries 0..L-1 are the raw stream entering each block
    with torch.no_grad():
        hs = model(**_inputs(calib), output_hidden_states=True).hidden_states
    mask = calib.attention_mask.double()
    for layer in range(5):
        cos = torch.nn.functional.cosine_similarity(hs[layer].double(), hs[layer + 1].double(), dim=-1)
        expected = float((((1 - cos) * mask).sum(1) / mask.sum(1)).mean())
        assert res.scores[layer] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the last entry of output_hidden_states is after the final norm: BI must not use it
    cos_normed = torch.nn.functional.cosine_similarity(hs[5].double(), hs[6].double(), dim=-1)
    normed = float((((1 - cos_normed) * mask).sum(1) / mask.sum(1)).mean())
    assert abs(res.scores[5] - normed) > 1e-3


def test_block_influence_budgets_share_one_pass_and_respect_protect():
    model = make_identity(tiny_model("llama", 6), [1, 4])
    calib = calib_set()
    out = block_influence(model, calib, [1, 2], protect=(1,))
    assert set(out) == {1, 2}
    assert out[1].removed == [4]
    assert 1 not in out[2].removed and 4 in out[2].removed
    assert out[1].scores == out[2].scores
    with pytest.raises(ValueError, match="budget n=6"):
        block_influence(model, calib, 6)


# ----------------------------------------------------------------------------- angular distance


def test_angular_distance_picks_planted_contiguous_run():
    model = make_identity(tiny_model("llama", 8), [3, 4])
    calib = calib_set()
    out = angular_distance(model, calib, [1, 2, 3])
    assert out[2].removed == [3, 4]
    assert out[2].details["distance_by_start"][3] < 1e-6  # arccos(1)/pi = 0
    assert out[1].removed == [3]  # a tie between 3 and 4 goes to the earliest start
    assert out[3].removed[:2] == [3, 4] or out[3].removed[1:] == [3, 4]
    # hand check one entry: last real token, arccos(cos)/pi, mean over prompts
    with torch.no_grad():
        hs = model(**_inputs(calib), output_hidden_states=True).hidden_states
    last = calib.attention_mask.sum(1) - 1
    rows = torch.arange(calib.num_prompts)
    a, b = hs[1][rows, last].double(), hs[3][rows, last].double()
    expected = float((torch.arccos(torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)) / math.pi).mean())
    assert out[2].details["distance_by_start"][1] == pytest.approx(expected, rel=1e-9)
    # protect: no run may contain block 3
    prot = angular_distance(model, calib, 2, protect=(3,))
    assert 3 not in prot.removed and prot.details["distance_by_start"][3] is None


# ----------------------------------------------------------------------------- removal KL, SLEB


def test_single_removal_kl_equals_kl_of_pruned_copies():
    model = make_identity(tiny_model("llama", 6), [3])
    calib = calib_set()
    res = single_removal_kl(model, calib, 2)
    assert len(res.scores) == 6 and res.forward_passes == 7
    assert res.scores[3] < 1e-10 and 3 in res.removed
    assert 0 not in res.removed and 5 not in res.removed
    for layer in (1, 4):
        assert res.scores[layer] == pytest.approx(direct_kl(model, pruned_copy(model, [layer]), calib), rel=1e-4)
    chosen = sorted(range(1, 5), key=lambda i: res.scores[i])[:2]
    assert res.removed == sorted(chosen)


def test_single_removal_kl_extends_budgets_from_its_scores(monkeypatch):
    model = make_identity(tiny_model("llama", 6), [3])
    calib = calib_set()
    one, direct = single_removal_kl(model, calib, 1), single_removal_kl(model, calib, [2, 3])

    def boom(*a, **k):
        raise AssertionError("scored again although resume holds the scores")

    monkeypatch.setattr(B, "removal_kl_values", boom)
    more = single_removal_kl(model, calib, [2, 3], resume=one)
    for n in (2, 3):
        assert (more[n].removed, more[n].scores, more[n].forward_passes) == (
            direct[n].removed, direct[n].scores, direct[n].forward_passes)
    with pytest.raises(ValueError, match="protect"):
        single_removal_kl(model, calib, [2], resume=one, protect=(0,))
    with pytest.raises(ValueError, match="budget below 1"):
        single_removal_kl(model, calib, [1], resume=one)


def test_plan_nll_matches_transformers_loss_on_pruned_copies():
    model = tiny_model("llama", 6)
    calib = calib_set()
    plans = {"skip2": [0, 1, 3, 4, 5], "skip5": [0, 1, 2, 3, 4], "skip0": [1, 2, 3, 4, 5]}
    values, counts, stats = plan_nll(model, calib, plans, batch_size=3)
    total = float(counts.sum())
    assert total == float((calib.attention_mask[:, 1:]).sum())
    assert float(stats["base"].sum()) / total == pytest.approx(hf_nll(model, calib), rel=1e-5)
    for name, removed in (("skip2", [2]), ("skip5", [5]), ("skip0", [0])):
        assert float(values[name].sum()) / total == pytest.approx(hf_nll(pruned_copy(model, removed), calib), rel=1e-5)


def test_plan_nll_shares_the_prefix_tree_bit_identically_and_hooks_count_its_block_passes():
    """SLEB's second step on 8 blocks after removing block 2: the candidates {2, b>2} start
    at slot 2 and run the same blocks up to b, so they share a prefix tree (runs 3457,
    34|67, 3|567, 4567 after the reference: 5 + 4 + 2 + 3 + 4 blocks instead of 5 + 4 * 4);
    every value equals the plan run alone, bit for bit."""
    model = tiny_model("llama", 8)
    calib = calib_set()
    plans = {b: removal_plan(8, sorted({2, b})) for b in (1, 3, 4, 5, 6)}
    calls = []
    handles = [blk.register_forward_hook(lambda *_: calls.append(1)) for blk in model.model.layers]
    try:
        values, _, stats = plan_nll(model, calib, plans, batch_size=2)
    finally:
        for h in handles:
            h.remove()
    assert (stats["block_passes"], stats["head_passes"], stats["forward_passes"]) == (8 + 18, 1 + 5, 1 + 5)
    assert len(calls) == 2 * stats["block_passes"]  # two batches of two prompts
    for b, plan in plans.items():
        alone, _, _ = plan_nll(model, calib, {b: plan}, batch_size=2)
        assert torch.equal(values[b], alone[b])


@pytest.mark.parametrize("max_memory, phases, vocab_chunk", [(1 << 30, 1, 256), (1 << 20, 4, 4)])
def test_plan_nll_reads_an_offloaded_head_once_per_head_phase_and_equals_the_unsliced_nll(tmp_path, max_memory, phases,
                                                                                         vocab_chunk):
    """A tiny Llama whose head (4,096 x 64) and blocks 2-3 are on disk, one batch of 8
    prompts x 160 tokens (1,272 predicted positions: two blocks of rows) and three plans:
    the head runs in vocabulary slices (the scoring engine's: at most 1/16 of it, 256
    entries, under 1 GiB; 4 under 1 MiB, whose slice budget is an eighth of it), each read
    once per head phase from the offload (it read the whole head once per row slice).
    Under 1 GiB the final rows of the reference and the three plans are one phase: one read
    of the head for the batch; under 1 MiB one pass's rows fill the held share, so four
    phases. Accelerate's hook never loads the head whole. The NLL equals the in-memory
    model's unsliced one."""
    dense, offloaded, calib = head_offloaded_llama(tmp_path)
    plans = {"skip1": [0, 2, 3], "skip2": [0, 1, 3], "skip12": [0, 3]}
    whole, counts, stats_whole = plan_nll(dense, calib, plans, batch_size=8)
    assert stats_whole["head_loads"] == stats_whole["head_bytes_read"] == 0 and stats_whole["vocab_chunk"] == 4096
    with HeadReads(offloaded.lm_head) as reads:
        sliced, _, stats = plan_nll(offloaded, calib, plans, batch_size=8, max_memory=max_memory)
    targets = int(counts.sum())
    assert targets == 8 * 159 - 60
    assert stats["vocab_chunk"] == vocab_chunk
    assert stats["head_loads"] == phases
    assert reads.rows == phases * 4096 and reads.hook_loads == 0
    assert stats["head_bytes_read"] == phases * 4096 * 64 * 4
    assert stats["head_slices"] == 4 * (4096 // vocab_chunk) * 2  # 4 passes x the vocabulary slices x 2 row blocks
    assert stats["head_rows"] == stats_whole["head_rows"] == 4 * targets
    assert stats["head_passes"] == stats_whole["head_passes"] == 4
    for name in plans:
        torch.testing.assert_close(sliced[name], whole[name], rtol=1e-6, atol=0)
    torch.testing.assert_close(stats["base"], stats_whole["base"], rtol=1e-6, atol=0)


def test_plan_nll_fills_the_kept_reference_of_an_offloaded_head_with_the_batch_s_first_head_phase(tmp_path):
    """With a kept reference (SLEB's, the search's), the reference NLL of an offloaded head is
    computed in the batch's head phase, after the sweep: the kept entry holds its values (a
    second call reads them and sweeps nothing), and a call interrupted before that phase
    leaves no entry (no zeros served later)."""
    from hf_layerswap.scoring.reference import ReferenceCache
    from hf_layerswap.selection.nll import OnlineNLL

    _, offloaded, calib = head_offloaded_llama(tmp_path, num_prompts=4, seq_len=24)
    cache = ReferenceCache(1 << 30)
    first, _, stats = plan_nll(offloaded, calib, {"skip1": [0, 2, 3]}, batch_size=4, reference_cache=cache)
    assert stats["reference_passes"] == 1 and cache.entries
    again, _, stats_again = plan_nll(offloaded, calib, {"skip2": [0, 1, 3]}, batch_size=4, reference_cache=cache)
    assert stats_again["reference_passes"] == 0 and stats_again["head_loads"] == 1
    assert torch.equal(stats_again["base"], stats["base"]) and bool((stats["base"] > 0).all())
    broken = ReferenceCache(1 << 30)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OnlineNLL, "add", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            plan_nll(offloaded, calib, {"skip1": [0, 2, 3]}, batch_size=4, reference_cache=broken)
    assert not broken.entries and broken.bytes == 0


def test_plan_nll_runs_the_head_on_row_slices_of_the_budget_and_equals_one_slice():
    """A 32,000-entry vocabulary: under a 1 MiB budget the head/KL share of the slice budget
    holds one position's fp32 logits and log-softmax (8 x 32,000 bytes x 1 row), so every
    predicted position is a head call of its own; under 1 GiB a batch's positions are one
    slice. The NLL sums are the same to fp32 rounding (each row's log-softmax is its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 32000, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[3, 7:] = 0
    calib = CalibrationSet(ids, mask, "random tokens")
    plans = {"skip1": [0, 2], "skip2": [0, 1]}
    many, counts, stats_many = plan_nll(model, calib, plans, batch_size=2, max_memory=1 << 20)
    one, _, stats_one = plan_nll(model, calib, plans, batch_size=2, max_memory=1 << 30)
    targets = int(counts.sum())
    assert targets == 4 * 11 - 5
    assert stats_many["rows_per_slice"] == 1 and stats_one["rows_per_slice"] >= 22
    assert stats_many["head_slices"] == 3 * targets  # the reference and two plans, one head call per position
    assert stats_one["head_slices"] == 3 * 2  # one per batch and sweep
    for name in plans:
        torch.testing.assert_close(many[name], one[name], rtol=1e-6, atol=0)
    torch.testing.assert_close(stats_many["base"], stats_one["base"], rtol=1e-6, atol=0)
    assert float(one["skip1"].sum()) / targets == pytest.approx(hf_nll(pruned_copy(model, [1]), calib), rel=1e-5)
    with pytest.raises(ValueError, match="max_memory='lots': give bytes"):
        plan_nll(model, calib, plans, max_memory="lots")


def test_sleb_first_pick_is_argmin_of_single_removal_nll_and_rescoring():
    model = tiny_model("llama", 6, seed=3)
    calib = calib_set()
    res = sleb(model, calib, [1, 2])
    single = {layer: hf_nll(pruned_copy(model, [layer]), calib) for layer in range(1, 5)}
    first = min(single, key=lambda k: (single[k], k))
    assert res[1].removed == [first]
    for layer, value in single.items():
        assert res[1].scores[layer] == pytest.approx(value, rel=1e-5)
    assert res[1].scores[0] is None and res[1].scores[5] is None
    step2 = res[2].details["steps"][1]["candidates"]
    assert set(step2) == {str(b) for b in range(1, 5) if b != first}  # re-scored without the first pick
    second = min(step2, key=lambda k: (step2[k], int(k)))
    assert res[2].removed == sorted([first, int(second)])
    assert step2[second] == pytest.approx(hf_nll(pruned_copy(model, res[2].removed), calib), rel=1e-5)
    assert (res[1].evaluator_calls, res[2].evaluator_calls) == (4, 7)
    assert res[2].forward_passes == 1 + 4 + 3  # the dense reference once for both steps
    assert res[2].details["head_passes"] == 1 + 4 + 3
    resumed = sleb(model, calib, 2, resume=res[1])  # continues from n=1, same as one run
    assert resumed.removed == res[2].removed and resumed.details["steps"] == res[2].details["steps"]
    # a resumed run computes the dense reference once more
    assert (resumed.evaluator_calls, resumed.forward_passes) == (res[2].evaluator_calls, res[2].forward_passes + 1)
    with pytest.raises(ValueError, match="resume"):
        sleb(model, calib, [1], resume=res[2])


# ----------------------------------------------------------------------------- controls


def test_random_is_reproducible_and_tail_is_last_before_final():
    a = B.random_removal(10, [2, 3], seed=7, draws=5)
    b = B.random_removal(10, [2, 3], seed=7, draws=5)
    c = B.random_removal(10, [2, 3], seed=8, draws=5)
    assert a[2].details["draws"] == b[2].details["draws"] and a[3].details == b[3].details
    assert a[3].details["draws"] != c[3].details["draws"]
    for n in (2, 3):
        draws = a[n].details["draws"]
        assert len(draws) == 5 and a[n].removed == draws[0]
        for s in draws:
            assert len(set(s)) == n and s == sorted(s) and all(1 <= i <= 8 for i in s)
    assert B.tail_removal(10, 1).removed == [8]
    assert B.tail_removal(10, 3).removed == [6, 7, 8]
    assert B.tail_removal(tiny_model("llama", 6), 2).removed == [3, 4]
    with pytest.raises(ValueError, match="at most L-2"):
        B.tail_removal(6, 5)
    with pytest.raises(ValueError, match="draws"):
        B.random_removal(6, 1, draws=0)


# ----------------------------------------------------------------------------- ours


def test_swap_guided_matches_select_layers_and_counts_probes():
    model = tiny_model("llama", 8)
    calib = calib_set()
    inter = swap_guided(model, calib, [1, 2], protocol="interchange")
    report = score_layers(model, calib, protocols=("interchange",), progress=False)
    assert inter[2].removed == select_layers(report, 2, protocol="interchange")
    assert inter[1].forward_passes == 1 + 7  # one reference + one probe per adjacent pair
    repl = swap_guided(model, calib, 1, protocol="replacement")
    assert repl.forward_passes == 1 + 14
    auto = swap_guided(model, calib, 2, protocol="auto")
    cands = auto.details["candidates"]
    assert auto.removed == cands[auto.details["chosen_protocol"]]
    if cands["interchange"] != cands["replacement"]:
        kls = auto.details["removal_kl"]
        assert kls[auto.details["chosen_protocol"]] == min(kls.values())
        assert kls["interchange"] == pytest.approx(removal_kl(model, calib, cands["interchange"]), rel=1e-9)


def test_merge_reports_equals_joint_scoring_and_protocol_gap_quartiles():
    model = tiny_model("llama", 6)
    calib = calib_set()
    both = score_layers(model, calib, max_gap=2, progress=False)
    merged = B.merge_reports(
        score_layers(model, calib, protocols=("replacement",), max_gap=2, progress=False),
        score_layers(model, calib, protocols=("interchange",), max_gap=2, progress=False),
    )
    assert [p.to_dict() for p in merged.pairs] == [p.to_dict() for p in both.pairs]
    # quartiles on a hand-made report: I/R = 0.1, 0.2, 0.3, 0.4, 2.0 at gap 1
    values = [(0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 1.0), (2.0, 1.0)]
    pairs = [PairResult(i, i + 1, replacement_ij=r, replacement_ji=r / 2, interchange=x) for i, (x, r) in enumerate(values)]
    pairs.append(PairResult(0, 2, replacement_ij=1.0, replacement_ji=float("nan"), interchange=0.5))
    q = B.protocol_gap_quartiles(SwapReport(6, pairs, max_gap=2))
    g1 = q["by_gap"][1]
    assert g1["pairs"] == 5 and g1["fraction_interchange_le_replacement"] == pytest.approx(0.8)
    assert (g1["ratio_q25"], g1["ratio_median"], g1["ratio_q75"]) == pytest.approx((0.2, 0.3, 0.4))
    assert q["non_finite_pairs"] == 1 and 2 not in q["by_gap"]


def test_merge_reports_refuses_reports_of_two_models_on_the_same_prompts():
    """Two models of one depth scored on the same prompts (one protocol each, so no pair value
    conflicts): their merge would hold one model's scores and set values under the other's
    fingerprint (a later search takes such values as that model's); it is refused."""
    model, calib = tiny_model("llama", 6), calib_set()
    other = tiny_model("llama", 6, seed=1)
    first = score_layers(model, calib, protocols=("replacement",), progress=False)
    second = score_layers(other, calib, protocols=("interchange",), progress=False)
    with pytest.raises(ValueError, match="merge_reports: the reports are of 2 different models"):
        B.merge_reports(first, second)


def test_beam_never_worse_than_greedy_and_counts_calls():
    model = tiny_model("llama", 8, seed=5)
    calib = calib_set()
    report = score_layers(model, calib, protocols=("interchange",), progress=False)
    out = interchange_beam(model, calib, [1, 2, 3], report=report, seed_size=4, width=2)
    for n in (1, 2, 3):
        greedy = select_layers(report, n, protocol="interchange")
        assert out[n].details["score"] <= removal_kl(model, calib, greedy) + 1e-12
        assert out[n].details["score"] == pytest.approx(removal_kl(model, calib, out[n].removed), rel=1e-9)
    levels = out[3].details["levels"]
    assert levels[0]["new_calls"] == 4  # the 4 seeds (the size-1 greedy set is the best seed)
    assert out[3].evaluator_calls == sum(lv["new_calls"] for lv in levels)
    assert out[1].evaluator_calls == levels[0]["new_calls"]
    resumed = interchange_beam(model, calib, 3, report=report, seed_size=4, width=2, resume=out[2])
    assert resumed.removed == out[3].removed and resumed.details["levels"] == levels
    assert (resumed.evaluator_calls, resumed.forward_passes) == (out[3].evaluator_calls, out[3].forward_passes)
    with pytest.raises(ValueError, match="width"):
        interchange_beam(model, calib, [3], report=report, seed_size=4, width=3, resume=out[2])
    seeds = out[1].details["seeds"]
    scores = report.layer_scores("interchange")
    assert seeds == sorted(range(1, 7), key=lambda i: (scores[i], i))[:4]


def test_beam_width_one_over_all_layers_with_nll_is_sleb():
    model = tiny_model("llama", 6, seed=3)
    calib = calib_set()
    beam = interchange_beam(model, calib, [1, 2], evaluator="nll", width=1, seed_size=6, include_greedy=False)
    ref = sleb(model, calib, [1, 2])
    assert [beam[n].removed for n in (1, 2)] == [ref[n].removed for n in (1, 2)]
    assert beam[2].details["score"] == pytest.approx(ref[2].details["steps"][1]["nll"], rel=1e-12)


def test_beam_reads_only_calibration_prompts():
    model = tiny_model("llama", 6)
    calib = calib_set()
    seen = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    try:
        interchange_beam(model, calib, 2, seed_size=3, evaluator="nll")
    finally:
        handle.remove()
    assert seen
    for ids in seen:
        width = ids.shape[1]
        rows = calib.input_ids[:, :width]
        assert all(any(torch.equal(r, c) for c in rows) for r in ids)


# ----------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def harness_setup():
    model = make_identity(tiny_model("llama", 6), [3])
    tok = char_tokenizer()
    model.layerswap_tokenizer = tok
    calib = calib_set()
    text = embedded_text("evaluation")[:3000]
    return model, tok, calib, text


EVAL_OPTS = {"window": 64, "stride": 32, "max_words": 150, "bootstrap": 200}


def test_evaluation_by_copy_equals_evaluation_by_plan(harness_setup):
    model, tok, _, text = harness_setup
    for removed in ([2], [1, 4]):
        by_copy = B.evaluate_removed(model, removed, text, tok, "matched", "copy", EVAL_OPTS)
        by_plan = B.evaluate_removed(model, removed, text, tok, "matched", "plan", EVAL_OPTS)
        assert by_copy.ppl == pytest.approx(by_plan.ppl, rel=1e-10)
        assert by_copy.window_nll == pytest.approx(by_plan.window_nll, rel=1e-9)
    assert len(decoder_blocks(model)[2]) == 6  # the model itself is untouched


def test_compare_criteria_table_resume_and_eval_text_isolation(harness_setup, tmp_path, monkeypatch):
    model, tok, calib, text = harness_setup
    crit = ("block_influence", "single_removal_kl", "random", "tail", "interchange", "interchange_beam")
    opts = {"random": {"draws": 3, "seed": 0}, "interchange_beam": {"seed_size": 3}}
    state = tmp_path / "state.json"
    table = B.compare_criteria(model, calib, [1, 2], criteria=crit, eval_text=text, tokenizer=tok,
                               evaluation_options=EVAL_OPTS, options=opts, state_path=state)
    assert len(table.rows) == len(crit) * 2
    rows = {(r["criterion"], r["n"]): r for r in table.rows}
    assert rows[("block_influence", 1)]["removed"] == [3]  # the identity block
    assert abs(rows[("block_influence", 1)]["dppl"]) < 1e-6  # removing an identity block costs nothing
    assert rows[("tail", 2)]["removed"] == [3, 4]
    assert rows[("random", 2)]["dppl_min"] <= rows[("random", 2)]["dppl"] <= rows[("random", 2)]["dppl_max"]
    lo, hi = rows[("interchange", 2)]["dppl_ci"]
    assert lo <= rows[("interchange", 2)]["dppl"] <= hi
    assert rows[("interchange_beam", 2)]["evaluator_calls"] >= 3
    md = table.to_markdown()
    assert "window 64, stride 32" in md and "| interchange_beam | 2 |" in md
    assert table.contract["window"] == 64 and table.contract["bos"]["add_bos"] is False
    assert table.best_by_n()[1]

    # resume: nothing is recomputed (the evaluator and the probes would raise)
    def boom(*a, **k):
        raise AssertionError("recomputed although the state file has it")

    monkeypatch.setattr(B, "evaluate_perplexity", boom)
    monkeypatch.setattr(B, "removal_kl_values", boom)
    again = B.compare_criteria(model, calib, [1, 2], criteria=crit, eval_text=text, tokenizer=tok,
                               evaluation_options=EVAL_OPTS, options=opts, state_path=state)
    assert again.rows == table.rows
    monkeypatch.undo()

    # another evaluation text: a different state, but identical selections (selection never reads it)
    other = B.compare_criteria(model, calib, [1, 2], criteria=("interchange_beam",), eval_text=text[::-1],
                               tokenizer=tok, evaluation_options=EVAL_OPTS, options=opts, joint_kl=False)
    beam_rows = [r for r in table.rows if r["criterion"] == "interchange_beam"]
    assert [r["removed"] for r in other.rows] == [r["removed"] for r in beam_rows]
    assert [r["ppl"] for r in other.rows] != [r["ppl"] for r in beam_rows]
    with pytest.raises(ValueError, match="state file"):
        B.compare_criteria(model, calib, [1], criteria=("tail",), eval_text=text[::-1], tokenizer=tok,
                           evaluation_options=EVAL_OPTS, state_path=state)


def test_compare_criteria_after_the_same_repair(harness_setup, tmp_path, monkeypatch):
    """``recovery="ghosted"``: every non-random set is also evaluated after the repair, and
    the number equals recovering a copy and evaluating it directly; a resumed run reuses it."""
    from hf_layerswap.evaluation import delta_ppl_percent, evaluate_perplexity
    from hf_layerswap.recovery import recover

    model, tok, calib, text = harness_setup
    crit = ("block_influence", "tail", "random")
    kwargs = dict(criteria=crit, eval_text=text, tokenizer=tok, evaluation_options=EVAL_OPTS,
                  options={"random": {"draws": 2, "seed": 0}}, joint_kl=False)
    state = tmp_path / "state.json"
    table = B.compare_criteria(model, calib, [1, 2], recovery="ghosted", state_path=state, **kwargs)
    rows = {(r["criterion"], r["n"]): r for r in table.rows}
    base = evaluate_perplexity(model, text, tokenizer=tok, **EVAL_OPTS)
    for n in (1, 2):
        row = rows[("tail", n)]
        repaired = copy.deepcopy(model)
        recover(repaired, row["removed"], calib, method="ghosted")
        direct = evaluate_perplexity(repaired, text, tokenizer=tok, **EVAL_OPTS)
        assert row["ppl_recovered"] == direct.ppl
        assert row["dppl_recovered"] == delta_ppl_percent(base, direct)
        lo, hi = row["dppl_recovered_ci"]
        assert lo <= row["dppl_recovered"] <= hi
        assert "ppl_recovered" not in rows[("random", n)]  # the control of the plain cut is not repaired
    assert table.recovery == "ghosted"
    plain = B.compare_criteria(model, calib, [1, 2], **kwargs)  # same selections and plain numbers without it
    assert [r["dppl"] for r in plain.rows] == [r["dppl"] for r in table.rows]
    assert all("ppl_recovered" not in r for r in plain.rows)

    def boom(*a, **k):
        raise AssertionError("recomputed although the state file has it")

    monkeypatch.setattr(B, "evaluate_perplexity", boom)
    assert B.compare_criteria(model, calib, [1, 2], recovery="ghosted", state_path=state, **kwargs).rows == table.rows
    repairs = [name for name, method in RECOVERY_METHODS.items() if method.fits]  # every repair registered now
    assert {"ghosted", "fused", "linearpatch"} <= set(repairs) and "none" not in repairs
    with pytest.raises(ValueError) as err:
        B.compare_criteria(model, calib, [1], recovery="ridge", **kwargs)
    assert str(err.value) == f"recovery='ridge': allowed None or one of {repairs}"
    only_tail = B.compare_criteria(model, calib, [1, 2], recovery="ghosted", recovery_criteria=["tail"],
                                   state_path=state, **kwargs)
    assert [r["criterion"] for r in only_tail.rows if "ppl_recovered" in r] == ["tail", "tail"]
    with pytest.raises(ValueError, match=r"recovery_criteria \['sleb'\] are not among the criteria run"):
        B.compare_criteria(model, calib, [1], recovery="ghosted", recovery_criteria=["sleb"], **kwargs)


def test_states_of_parallel_runs_merge_into_one_comparison(harness_setup, tmp_path, monkeypatch):
    """Disjoint criteria run in separate processes (separate state files) merge into a
    state from which the full comparison resumes without recomputing, with the rows a
    single run produces."""
    model, tok, calib, text = harness_setup
    kwargs = dict(eval_text=text, tokenizer=tok, evaluation_options=EVAL_OPTS, batch_size=2,
                  options={"random": {"draws": 2, "seed": 0}})
    first, second = ("block_influence", "random"), ("tail", "interchange")
    B.compare_criteria(model, calib, [1, 2], criteria=first, state_path=tmp_path / "a.json", **kwargs)
    B.compare_criteria(model, calib, [1], criteria=second, state_path=tmp_path / "b.json", **kwargs)
    B.compare_criteria(model, calib, [2], criteria=second, state_path=tmp_path / "c.json", **kwargs)
    merged = B.merge_criteria_states([tmp_path / n for n in ("a.json", "b.json", "c.json")], tmp_path / "m.json")
    assert sorted(merged["criteria"]) == sorted(first + second)
    assert list(merged["criteria"]["tail"]) == ["1", "2"]  # both budgets, in order
    assert sorted(merged["reports"]) == ["interchange"]

    def boom(*a, **k):
        raise AssertionError("recomputed although the merged state has it")

    monkeypatch.setattr("hf_layerswap.evaluation.evaluate_perplexity", boom)
    monkeypatch.setattr(B, "removal_kl_values", boom)
    monkeypatch.setattr(B, "score_adjacent", boom)
    resumed = B.compare_criteria(model, calib, [1, 2], criteria=first + second, state_path=tmp_path / "m.json",
                                 **kwargs)
    monkeypatch.undo()
    single = B.compare_criteria(model, calib, [1, 2], criteria=first + second, **kwargs)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(resumed.rows) == strip(single.rows)

    # states of another comparison, or files that are not states, are refused by name
    B.compare_criteria(model, calib, [1], criteria=("tail",), eval_text=text[::-1], tokenizer=tok,
                       evaluation_options=EVAL_OPTS, state_path=tmp_path / "other.json")
    with pytest.raises(ValueError, match="other.json was recorded for"):
        B.merge_criteria_states([tmp_path / "a.json", tmp_path / "other.json"], tmp_path / "x.json")
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="junk.json is not a compare_criteria state"):
        B.merge_criteria_states([tmp_path / "junk.json"], tmp_path / "x.json")
    with pytest.raises(ValueError, match="at least one"):
        B.merge_criteria_states([], tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_compare_criteria_killed_while_scoring_keeps_finished_probes(harness_setup, tmp_path, monkeypatch):
    """A run killed in the middle of a protocol's scoring resumes from the probes it
    finished (kept beside the state file) and ends with the uninterrupted report."""
    from hf_layerswap.scoring import ScoringCheckpoint

    model, tok, calib, text = harness_setup
    state = tmp_path / "state.json"
    probes = tmp_path / "state.interchange-probes"
    real_save, saved = ScoringCheckpoint.save, []

    def killed_after_one(self, *args, **kwargs):
        if saved:
            raise KeyboardInterrupt("killed")
        real_save(self, *args, **kwargs)
        saved.append(args[0])

    monkeypatch.setattr(ScoringCheckpoint, "save", killed_after_one)
    kwargs = dict(criteria=("interchange",), eval_text=text, tokenizer=tok, evaluation_options=EVAL_OPTS,
                  batch_size=2, joint_kl=False)
    with pytest.raises(KeyboardInterrupt):
        B.compare_criteria(model, calib, [1], state_path=state, **kwargs)
    assert len(list(probes.glob("part-*.pt"))) == 1 and not state.exists()  # nothing else was recorded
    monkeypatch.undo()
    resumed = B.compare_criteria(model, calib, [1], state_path=state, **kwargs)
    assert not probes.exists()  # removed once the report is in the state
    fresh = B.compare_criteria(model, calib, [1], **kwargs)
    got, want = SwapReport.from_dict(resumed.reports["interchange"]), SwapReport.from_dict(fresh.reports["interchange"])
    assert got.metadata["checkpoint"]["resumed_values"] > 0
    assert [(p.i, p.j, p.interchange) for p in got.pairs] == [(p.i, p.j, p.interchange) for p in want.pairs]
    assert resumed.rows[0]["removed"] == fresh.rows[0]["removed"]


def test_criterion_result_round_trip_and_bad_input():
    res = CriterionResult("sleb", 2, [1, 3], [float("nan"), 0.5], 3, 12, 1.5, evaluator_calls=4,
                            details={"x": float("inf")})
    back = CriterionResult.from_dict(res.to_dict())
    assert back.removed == [1, 3] and math.isnan(back.scores[0]) and back.details["x"] == float("inf")
    model = tiny_model("llama", 6)
    with pytest.raises(ValueError, match="unknown criteria"):
        B.compare_criteria(model, calib_set(), [1], criteria=("shortgpt",))
    with pytest.raises(ValueError, match="evaluator="):
        interchange_beam(model, calib_set(), 1, evaluator="ppl")
    with pytest.raises(ValueError, match="protocol="):
        swap_guided(model, calib_set(), 1, protocol="both")


# ----------------------------------------------------------------------------- real models


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2", "gemma3_270m"])
def test_real_block_influence_uses_pre_norm_stream(fixture, request, wikitext_valid):
    """On the real checkpoints, hook-captured BI equals 1 - cos from output_hidden_states
    for every block but the last, whose output_hidden_states entry is after the final norm."""
    model, tok = request.getfixturevalue(fixture)
    from hf_layerswap.calibration import split_paragraphs

    lines = wikitext_valid.read_text(encoding="utf-8").splitlines()
    paras = [p for p in split_paragraphs("\n\n".join(ln.strip() for ln in lines)) if len(p) > 200][:3]
    calib = build_calibration(paras, tok, num_prompts=3, seq_len=24)
    res = block_influence(model, calib, 2)
    num_blocks = len(res.scores)
    with torch.no_grad():
        hs = model(**_inputs(calib), output_hidden_states=True).hidden_states
    mask = calib.attention_mask.double()

    def bi(a, b):
        cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
        return float((((1 - cos) * mask).sum(1) / mask.sum(1)).mean())

    for layer in range(num_blocks - 1):
        assert res.scores[layer] == pytest.approx(bi(hs[layer], hs[layer + 1]), rel=1e-6, abs=1e-9)
    assert abs(res.scores[-1] - bi(hs[-2], hs[-1])) > 1e-3
    assert 0 <= min(res.scores) and max(res.scores) <= 2


def test_each_objective_is_a_search_criterion_that_minimises_it(harness_setup):
    from hf_layerswap.selection.objectives import removal_nll_values

    model, _, calib, _ = harness_setup
    report = score_layers(model, calib, protocols=("replacement", "interchange"), max_gap=1, progress=False)
    criteria = B.harness_criteria()
    assert [c for c in criteria if c.startswith("search")] == ["search", "search_nll", "search_ghosted"]
    out = criteria["search_nll"].run(model, calib, [1, 2], report=report, batch_size=4)
    singles = [[i] for i in range(1, 5)]  # the blocks it may remove (first and last protected)
    values, _ = removal_nll_values(model, calib, singles, 4)
    assert out[1].removed == singles[values.index(min(values))]
    for n in (1, 2):
        assert (out[n].name, out[n].n, out[n].details["objective"], out[n].details["unit"]) == (
            "search_nll", n, "nll", "nats per token")
        assert out[n].details["value"] == pytest.approx(removal_nll_values(model, calib, [out[n].removed], 4)[0][0],
                                                        rel=1e-9)


def test_the_beams_removal_kl_calls_run_under_the_budget_select_layers_hands_on(monkeypatch):
    """The beam's evaluator calls take select_layers' working-memory budget (they took the
    device's own "auto" budget, outside the prune's one budget)."""
    import hf_layerswap.selection.objectives as objectives

    seen = []
    real = objectives.plan_kl

    def recorded(*args, **kwargs):
        seen.append(kwargs.get("max_memory"))
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives, "plan_kl", recorded)
    model = tiny_model("llama", 8, seed=5)
    calib = calib_set()
    report = score_layers(model, calib, protocols=("interchange",), progress=False)
    chosen = select_layers(report, 2, strategy="beam", model=model, calibration=calib, max_memory="3MiB")
    assert len(chosen) == 2 and len(seen) >= 2 and set(seen) == {"3MiB"}
