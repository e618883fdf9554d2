"""Width compression: allocators (exact budget and bounds), the streaming percentile
estimator, Wanda/SparseGPT masks and updates, block-by-block propagation, save/reload."""

from __future__ import annotations

import copy
import json
import math
import random
import re

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, tiny_batch, tiny_model

from hf_layerswap.calibration import build_calibration, split_paragraphs
from hf_layerswap.layerplan import capture_residual_stream, decoder_blocks
from hf_layerswap.sparsity import (
    ExactQuantile,
    LogHistogramQuantile,
    SparsityReport,
    fit_budget,
    gradient_allocation,
    magnitude_prune,
    outlier_ratio,
    owl_allocation,
    pals_allocation,
    random_allocation,
    sparsegpt_prune,
    sparsify,
    uniform_allocation,
    wanda_prune,
)
from hf_layerswap.sparsity.engine import prunable_linears
from hf_layerswap.sparsity.pruners import lowest_k_mask


def _weighted_mean(values, weights):
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


# ---------------------------------------------------------------------------- allocators


def _random_case(seed):
    rng = random.Random(seed)
    n_blocks = rng.randint(2, 40)
    params = [rng.choice([1000, 4096, 12_000, 50_000]) * rng.randint(1, 4) for _ in range(n_blocks)]
    stats = [math.exp(rng.gauss(0, 1.5)) for _ in range(n_blocks)]
    return params, stats, rng


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.2, 0.03, 0.98])
@pytest.mark.parametrize("mapping", ["zscore", "minmax"])
def test_pals_budget_exact_and_bounded_on_random_statistics(sparsity, mapping):
    for seed in range(40):
        params, stats, rng = _random_case(seed)
        delta = rng.choice([d for d in (0.01, 0.05, 0.1) if sparsity + d < 1])  # 0.98: only 0.01 (see bad input)
        out = pals_allocation(stats, params, sparsity, delta=delta, mapping=mapping)
        assert len(out) == len(params)
        assert _weighted_mean(out, params) == pytest.approx(sparsity, abs=1e-12)
        lo, hi = max(sparsity - delta, 0.0), sparsity + delta
        assert all(lo - 1e-15 <= s <= hi + 1e-15 for s in out) and max(out) < 1
        # larger percentile -> never a larger sparsity
        order = sorted(range(len(stats)), key=lambda i: stats[i])
        assert all(out[a] >= out[b] - 1e-15 for a, b in zip(order, order[1:]))
        # invert=True flips the direction
        flipped = pals_allocation(stats, params, sparsity, delta=delta, mapping=mapping, invert=True)
        assert all(flipped[a] <= flipped[b] + 1e-15 for a, b in zip(order, order[1:]))


def test_pals_hand_computed_three_blocks():
    # p = (1, 2, 3): z = (-sqrt(1.5), 0, +sqrt(1.5)); d = -0.05 z = (+0.0612, 0, -0.0612)
    d = 0.05 * math.sqrt(1.5)
    # equal blocks: tau = 0 and the outer blocks clip at the bound
    assert pals_allocation([1, 2, 3], [10, 10, 10], 0.5) == pytest.approx([0.55, 0.5, 0.45], abs=1e-15)
    # block 2 twice as large: 0.55 + (0.5 + tau) + 2 (0.5 - d + tau) = 2  ->  tau = (0.45 + 2d - 1 + 0.5) / 3
    tau = (2 - 0.55 - 0.5 - 2 * (0.5 - d)) / 3
    out = pals_allocation([1, 2, 3], [1, 1, 2], 0.5)
    assert out == pytest.approx([0.55, 0.5 + tau, 0.5 - d + tau], abs=1e-12)
    assert 0.45 < out[2] < out[1] < 0.55


def test_constant_statistics_and_zero_delta_give_uniform():
    assert pals_allocation([3.0] * 5, [1, 2, 3, 4, 5], 0.6) == [0.6] * 5
    assert pals_allocation([1.0, 5.0], [1, 1], 0.6, delta=0.0) == [0.6, 0.6]
    assert uniform_allocation([7, 7, 7], 0.25) == [0.25] * 3
    assert owl_allocation([4.0, 4.0], 0.5) == [0.5, 0.5]


def test_random_and_gradient_allocations_meet_budget():
    params = [100, 300, 200, 400, 100]
    for seed in range(10):
        out = random_allocation(params, 0.6, delta=0.05, seed=seed)
        assert _weighted_mean(out, params) == pytest.approx(0.6, abs=1e-12)
        assert all(0.55 - 1e-15 <= s <= 0.65 + 1e-15 for s in out)
    assert random_allocation(params, 0.6, seed=3) == random_allocation(params, 0.6, seed=3)
    assert random_allocation(params, 0.6, seed=3) != random_allocation(params, 0.6, seed=4)
    grad = gradient_allocation([1e-5, 3e-5, 2e-5, 5e-6, 4e-5], params, 0.6)
    assert _weighted_mean(grad, params) == pytest.approx(0.6, abs=1e-12)
    assert grad[4] < grad[1] < grad[2] < grad[0] < grad[3]


def test_fit_budget_rejects_bad_input():
    with pytest.raises(ValueError, match="sparsity=1.5"):
        fit_budget([0.0, 0.1], [1, 1], 1.5, 0.05)
    with pytest.raises(ValueError, match="num_params has 3 entries"):
        fit_budget([0.0, 0.1], [1, 1, 1], 0.5, 0.05)
    with pytest.raises(ValueError, match="non-finite"):
        pals_allocation([1.0, float("nan")], [1, 1], 0.5)
    with pytest.raises(ValueError, match="mapping='rank'"):
        pals_allocation([1.0, 2.0], [1, 1], 0.5, mapping="rank")
    # a bound reaching sparsity 1 would zero a whole block: refused for every bounded allocator
    for call in (
        lambda: fit_budget([0.0, 0.1], [1, 1], 0.96, 0.05),
        lambda: pals_allocation([1.0, 2.0], [1, 1], 0.95),
        lambda: random_allocation([1, 1], 0.99, seed=3),
    ):
        with pytest.raises(ValueError, match=r"lets a block reach sparsity 1 .*use delta < 1 - sparsity"):
            call()
    assert max(pals_allocation([1.0, 2.0, 5.0], [1, 1, 1], 0.94)) < 0.99


def test_owl_outlier_ratio_and_mapping_by_hand():
    # mean of all 8 scores = 17/8; M=2 -> threshold 4.25; only the 10 is above
    scores = [torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.tensor([10.0, 1.0, 1.0, 1.0])]
    assert outlier_ratio(scores, 2.0) == pytest.approx(100 * 1 / 8)
    assert outlier_ratio(lambda: iter(scores), 2.0) == pytest.approx(12.5)
    assert outlier_ratio([3 * s for s in scores], 2.0) == pytest.approx(12.5)  # scale-invariant
    # LOD (10, 20, 40), s=0.5, lambda=0.08: r = 0.16 (0, 1/3, 1); s_l = s + mean(r) - r_l
    mean_r = 0.16 * (1 / 3 + 1) / 3
    out = owl_allocation([10.0, 20.0, 40.0], 0.5, lam=0.08)
    assert out == pytest.approx([0.5 + mean_r, 0.5 + mean_r - 0.16 / 3, 0.5 + mean_r - 0.16], abs=1e-15)
    assert max(out) - min(out) == pytest.approx(0.16)
    assert sum(out) / 3 == pytest.approx(0.5, abs=1e-15)
    # the reference's floor: s_l <= 0 becomes 0.01
    assert owl_allocation([10.0, 20.0, 40.0], 0.05, lam=0.08)[2] == 0.01


# ---------------------------------------------------------------------------- percentile estimator


def _heavy_tailed(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(2.0 * torch.randn(n, generator=g)) * torch.sign(torch.randn(n, generator=g))
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x


def test_streaming_percentile_matches_torch_and_numpy_within_bound():
    data = _heavy_tailed(1_000_000, seed=0)
    exact = torch.quantile(data.abs().double(), torch.tensor([0.0, 0.02, 0.5, 0.9, 0.99, 0.999, 1.0]).double())
    numpy_exact = np.quantile(data.abs().numpy().astype(np.float64), [0.0, 0.02, 0.5, 0.9, 0.99, 0.999, 1.0])
    # torch.quantile places ranks with limited precision (about 1e-6 relative here); numpy's
    # float64 'linear' quantile is the reference
    assert np.allclose(exact.numpy(), numpy_exact, rtol=1e-5)
    for bins in (256, 8):
        est = LogHistogramQuantile(bins_per_octave=bins)
        for chunk in data.split(77_777):
            est.update(chunk)
        bound = 2.0 ** (1.0 / (2 * bins)) - 1.0
        assert est.relative_error_bound == pytest.approx(bound)
        assert est.count == data.numel()
        for q, ref in zip([0.0, 0.02, 0.5, 0.9, 0.99, 0.999, 1.0], numpy_exact):
            got = est.quantile(q)
            if ref == 0.0:
                assert got == 0.0  # zeros are exact (5% of the data)
            else:
                assert abs(got / ref - 1) <= bound + 1e-12, (bins, q, got, ref)
    ref = ExactQuantile()
    for chunk in data.split(300_000):
        ref.update(chunk)
    assert ref.quantile(0.99) == pytest.approx(float(numpy_exact[4]), rel=1e-12)


def test_streaming_percentile_errors():
    est = LogHistogramQuantile()
    with pytest.raises(ValueError, match="empty"):
        est.quantile(0.5)
    est.update(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="q=1.5"):
        est.quantile(1.5)
    with pytest.raises(ValueError, match="NaN"):
        est.update(torch.tensor([float("nan")]))
    small = ExactQuantile(max_elements=10)
    with pytest.raises(ValueError, match="histogram"):
        small.update(torch.ones(11))


# ---------------------------------------------------------------------------- pruners


def test_wanda_hand_computed_example():
    w = torch.tensor([[1.0, -2.0, 3.0, -4.0], [4.0, 3.0, -2.0, 1.0]])
    x = torch.tensor([[4.0, 0.0, 0.0, 0.5], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])  # ||X_j|| = 4, 1, 1, 0.5
    # scores row 0: 4, 2, 3, 2 -> prune cols 1 and 3 (tie: lower index first); row 1: 16, 3, 2, 0.5 -> cols 3, 2
    pruned, mask = wanda_prune(w, (x * x).sum(0), 0.5)
    assert torch.equal(pruned, torch.tensor([[1.0, 0.0, 3.0, 0.0], [4.0, 3.0, 0.0, 0.0]]))
    assert torch.equal(mask, pruned == 0)
    # magnitude alone would keep the large weights instead
    assert torch.equal(magnitude_prune(w, 0.5)[0], torch.tensor([[0.0, 0.0, 3.0, -4.0], [4.0, 3.0, 0.0, 0.0]]))


def test_lowest_k_mask_equals_stable_sort_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40, 24), generator=g).float()  # many ties
    for k in (0, 1, 7, 12, 23, 24):
        expected = torch.zeros_like(scores, dtype=torch.bool)
        expected.scatter_(1, torch.sort(scores, dim=1, stable=True).indices[:, :k], True)
        assert torch.equal(lowest_k_mask(scores, k), expected), k


def _correlated_inputs(n_tokens, dim, seed):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
    scales = torch.exp(torch.randn(dim, generator=g))
    return (torch.randn(n_tokens, dim, generator=g) @ mixing) * scales


def _output_error(x, w_dense, w_pruned):
    return float(((x @ w_dense.T - x @ w_pruned.T) ** 2).sum())


def test_sparsegpt_fixed_prefix_mask_equals_least_squares():
    # pruning a prefix of columns is one OBS step per column with every later column free:
    # SparseGPT then equals the exact damped least-squares reconstruction of the kept weights
    torch.manual_seed(0)
    x = _correlated_inputs(256, 32, seed=1).double()
    w = torch.randn(12, 32, dtype=torch.float64)
    h = 2 * x.T @ x / x.shape[0]
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, :10] = True
    got, got_mask = sparsegpt_prune(w.float(), h.float(), 0.0, blocksize=8, percdamp=0.01, mask=mask)
    assert torch.equal(got_mask, mask)
    hd = h + 0.01 * torch.diag(h).mean() * torch.eye(32, dtype=torch.float64)
    keep = ~mask[0]
    expected = torch.zeros_like(w)
    # minimise (w' - w)^T Hd (w' - w) with w'_P = 0: w'_K = w_K + Hd_KK^-1 Hd_KP w_P
    expected[:, keep] = w[:, keep] + (torch.linalg.solve(hd[keep][:, keep], hd[keep][:, ~keep] @ w[:, ~keep].T)).T
    assert torch.allclose(got.double(), expected, atol=2e-4, rtol=1e-4)


def test_sparsegpt_beats_magnitude_and_wanda_and_respects_optimum():
    x = _correlated_inputs(512, 64, seed=2)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    h = 2 * x.T @ x / x.shape[0]
    s = 0.5
    sgpt, mask = sparsegpt_prune(w, h, s, blocksize=16)
    # exact count per column block: round(s * rows * 16) zeros in each of the 4 blocks
    for i in range(0, 64, 16):
        assert int(mask[:, i : i + 16].sum()) == round(s * 24 * 16)
    assert torch.equal(sgpt == 0, mask)
    err_sgpt = _output_error(x, w, sgpt)
    err_mag = _output_error(x, w, magnitude_prune(w, s)[0])
    err_wanda = _output_error(x, w, wanda_prune(w, (x * x).sum(0), s)[0])
    assert err_sgpt < 0.9 * err_wanda and err_wanda < 0.2 * err_mag
    # never below the least-squares optimum for its own mask (per row)
    xd = x.double()
    optimum = 0.0
    for r in range(w.shape[0]):
        keep = ~mask[r]
        coef = torch.linalg.lstsq(xd[:, keep], xd @ w[r].double()).solution
        optimum += float(((xd[:, keep] @ coef - xd @ w[r].double()) ** 2).sum())
    assert optimum <= err_sgpt * (1 + 1e-6)
    assert err_sgpt < 2.0 * optimum


def test_nm_patterns_on_single_layers():
    w = torch.randn(6, 16)
    h = torch.eye(16) + 0.1
    for pruned, mask in (wanda_prune(w, torch.rand(16), 0.5, "2:4"), sparsegpt_prune(w, h, 0.5, "2:4", blocksize=8)):
        assert torch.equal(mask.reshape(6, 4, 4).sum(-1), torch.full((6, 4), 2))
        assert torch.equal(pruned == 0, mask)
    with pytest.raises(ValueError, match="divisible by 4"):
        wanda_prune(torch.randn(2, 6), torch.ones(6), 0.5, "2:4")
    with pytest.raises(ValueError, match="'N:M'"):
        wanda_prune(w, torch.ones(16), 0.5, "2/4")


# ---------------------------------------------------------------------------- sparsify on tiny models


def _capture_linear_inputs(model, block_index, batch):
    """Dense inputs of every linear of one block at real tokens, from the model's own forward."""
    _, _, blocks = decoder_blocks(model)
    token_mask = batch["attention_mask"].bool().reshape(-1)
    seen, handles = {}, []
    for name, lin in prunable_linears(blocks[block_index]):
        handles.append(
            lin.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, args[0].reshape(-1, args[0].shape[-1])[token_mask])
            )
        )
    with torch.no_grad():
        model(**batch, use_cache=False)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_wanda_masks_match_direct_computation_with_propagation(family):
    """Each block is calibrated on the outputs of the already-pruned blocks: restoring one
    block's dense weights in the pruned model and recomputing |W| ||X|| per row from that
    block's real inputs must reproduce its mask exactly (non-uniform PALS targets)."""
    dense = tiny_model(family)
    model = tiny_model(family)
    batch = tiny_batch(batch=4, length=16)
    report = sparsify(model, batch, sparsity=0.5, allocation="pals", pruner="wanda", batch_size=3)
    assert len({round(t, 9) for t in report.block_targets}) > 1
    _, _, pruned_blocks = decoder_blocks(model)
    _, _, dense_blocks = decoder_blocks(dense)
    for block_index in (0, 3):
        pruned_state = {k: v.clone() for k, v in pruned_blocks[block_index].state_dict().items()}
        pruned_blocks[block_index].load_state_dict(dense_blocks[block_index].state_dict())
        inputs = _capture_linear_inputs(model, block_index, batch)
        pruned_blocks[block_index].load_state_dict(pruned_state)
        s_l = report.blocks[block_index].target
        for name, lin in prunable_linears(pruned_blocks[block_index]):
            w = dict(prunable_linears(dense_blocks[block_index]))[name].weight.detach()
            x = inputs[name]
            scores = w.abs() * x.norm(dim=0).unsqueeze(0)
            k = round(w.shape[1] * s_l)
            expected = torch.zeros_like(w, dtype=torch.bool)
            expected.scatter_(1, torch.sort(scores, dim=1, stable=True).indices[:, :k], True)
            assert torch.equal(lin.weight == 0, expected), (family, block_index, name)
            assert torch.equal(lin.weight[~expected], w[~expected])


def test_pals_statistic_block_input_equals_exact_quantile():
    model = tiny_model("qwen3")
    batch = tiny_batch(batch=4, length=16)
    streams, _ = capture_residual_stream(model, batch["input_ids"], batch["attention_mask"])
    report = sparsify(
        model, batch, sparsity=0.4, allocation="pals", pruner="magnitude", source="block_input", estimator="exact"
    )
    real = batch["attention_mask"].bool()
    for b in report.blocks:
        expected = torch.quantile(streams[b.index][real].abs().double().reshape(-1), 0.99).item()
        assert b.statistic == pytest.approx(expected, rel=1e-6)
    assert report.allocator["source"] == "block_input" and report.allocator["estimator"]["estimator"] == "exact"


def test_pals_statistic_linear_inputs_pools_each_distinct_input_once():
    model = tiny_model("llama")
    batch = tiny_batch(batch=4, length=16)
    inputs = _capture_linear_inputs(model, 2, batch)
    distinct = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")  # k/v, up share inputs
    pooled = torch.cat([inputs[n].abs().reshape(-1) for n in distinct])
    report = sparsify(model, batch, sparsity=0.5, allocation="pals", pruner="magnitude", estimator="histogram")
    expected = torch.quantile(pooled.double(), 0.99).item()
    assert abs(report.blocks[2].statistic / expected - 1) <= report.allocator["estimator"]["relative_error_bound"]
    assert report.allocator["values_per_block"][2] == pooled.numel()


def test_gradient_statistic_equals_autograd():
    model = tiny_model("llama", num_blocks=3)
    batch = tiny_batch(batch=3, length=12)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.zero_grad()
    model(**batch, labels=labels, use_cache=False).loss.backward()
    _, _, blocks = decoder_blocks(model)
    expected = []
    for block in blocks:
        weights = [lin.weight for _, lin in prunable_linears(block)]
        expected.append(float(sum(w.grad.abs().sum() for w in weights) / sum(w.numel() for w in weights)))
    model.zero_grad(set_to_none=True)
    report = sparsify(model, batch, sparsity=0.5, allocation="gradient", pruner="magnitude", batch_size=8)
    assert [b.statistic for b in report.blocks] == pytest.approx(expected, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_owl_statistic_matches_hand_lod():
    dense = tiny_model("llama", num_blocks=4)
    model = tiny_model("llama", num_blocks=4)
    batch = tiny_batch(batch=3, length=12)
    report = sparsify(model, batch, sparsity=0.5, allocation="owl", pruner="wanda", owl_m=3, owl_lambda=0.05)
    _, _, blocks = decoder_blocks(dense)
    lods = []
    for index, block in enumerate(blocks):
        inputs = _capture_linear_inputs(dense, index, batch)
        scores = torch.cat(
            [(lin.weight.abs() * inputs[n].norm(dim=0)).reshape(-1) for n, lin in prunable_linears(block)]
        ).detach()
        lods.append(100.0 * int((scores.double() > 3 * scores.double().mean()).sum()) / scores.numel())
    assert [b.statistic for b in report.blocks] == pytest.approx(lods, rel=1e-9)
    assert report.block_targets == pytest.approx(owl_allocation(lods, 0.5, lam=0.05), abs=1e-12)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_two_four_pattern_every_group(method):
    model = tiny_model("qwen3")
    report = sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner=method, pattern="2:4")
    _, _, blocks = decoder_blocks(model)
    for block in blocks:
        for _, lin in prunable_linears(block):
            zeros = (lin.weight == 0).reshape(lin.out_features, -1, 4).sum(-1)
            assert torch.equal(zeros, torch.full_like(zeros, 2))
    assert report.achieved_sparsity == 0.5 and report.pattern == "2:4"


def test_per_linear_sparsity_and_report_round_trip(tmp_path):
    model = tiny_model("llama")
    calib = build_calibration(tiny_batch(batch=5, length=16))
    report = sparsify(model, calib, sparsity=0.6, allocation="pals", pruner="sparsegpt", pattern=None, blocksize=32)
    for row in report.linears:
        rows, cols = row.shape
        per_block = [round(rows * min(32, cols - i) * row.target) for i in range(0, cols, 32)]
        assert row.num_zeros == sum(per_block), row.name
    weighted = _weighted_mean(report.block_targets, [b.num_params for b in report.blocks])
    assert weighted == pytest.approx(0.6, abs=1e-12)
    assert abs(report.achieved_sparsity - 0.6) <= 0.5 / (32 * 32)
    assert report.options["blocksize"] == 32 and report.options["estimator"] == "histogram"
    assert report.calibration["content_hash"] == calib.content_hash
    again = SparsityReport.from_json(report.to_json())
    assert again == report
    path = tmp_path / "sparsity.json"
    report.to_json(path)
    assert SparsityReport.from_json(path) == report
    assert "| 5 |" in report.to_markdown()
    png = report.plot(tmp_path / "blocks.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_reload_identical_logits_and_zero_count(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("gemma3")
    batch = tiny_batch()
    report = sparsify(model, batch, sparsity=0.5, allocation="owl", pruner="wanda")
    model.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        a = model(**batch).logits
        b = reloaded(**batch).logits
    assert torch.equal(a, b)
    zeros = sum(int((lin.weight == 0).sum()) for blk in decoder_blocks(reloaded)[2] for _, lin in prunable_linears(blk))
    assert zeros == report.num_zeros


def test_bad_arguments_change_nothing():
    model = tiny_model("llama", num_blocks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = tiny_batch()
    with pytest.raises(ValueError, match="allocation='uniform'"):
        sparsify(model, batch, sparsity=0.5, allocation="pals", pattern="2:4")
    with pytest.raises(ValueError, match="fixes the sparsity at 0.25"):
        sparsify(model, batch, sparsity=0.5, allocation="uniform", pattern="1:4")
    with pytest.raises(ValueError, match="divisible by M=3"):
        sparsify(model, batch, sparsity=2 / 3, allocation="uniform", pattern="2:3")
    with pytest.raises(ValueError, match="allocation='best'"):
        sparsify(model, batch, allocation="best")
    with pytest.raises(ValueError, match="pruner='obc'"):
        sparsify(model, batch, pruner="obc")
    with pytest.raises(TypeError, match=r"unknown options \['method'\]; allowed: the keywords sparsity, allocation, "
                                        "pruner, pattern, tokenizer and the options"):
        sparsify(model, batch, method="magnitude")  # the pruner's former keyword is gone
    with pytest.raises(TypeError, match="unknown options \\['lamda'\\]"):
        sparsify(model, batch, allocation="owl", lamda=0.1)
    with pytest.raises(ValueError, match="percentile=99"):
        sparsify(model, batch, percentile=99)
    with pytest.raises(ValueError, match="sparsity=0.97 with delta=0.05 lets a block reach sparsity 1"):
        sparsify(model, batch, sparsity=0.97, allocation="random")
    with pytest.warns(UserWarning, match="no effect"):
        sparsify(model, batch, sparsity=0.0, allocation="uniform", pruner="magnitude", owl_m=3)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_smollm2_pals_wanda_meets_target(smollm2, wikitext_valid):
    model, tokenizer = copy.deepcopy(smollm2[0]), smollm2[1]  # the session model stays dense
    # valid.txt separates paragraphs by lines holding one space: normalise them to blank lines
    text = re.sub(r"\n[ \t]+(?=\n)", "\n", wikitext_valid.read_text(encoding="utf-8"))
    calib = build_calibration(split_paragraphs(text)[:8], tokenizer, num_prompts=8, seq_len=64)
    report = sparsify(model, calib, sparsity=0.5, allocation="pals", pruner="wanda")
    widths = {row.shape[1] for row in report.linears}
    assert abs(report.achieved_sparsity - 0.5) <= 0.5 / min(widths)
    for b in report.blocks:
        assert abs(b.target - 0.5) <= 0.05 + 1e-12
        assert abs(b.achieved - b.target) <= 0.5 / min(widths)
    assert len(report.blocks) == 30 and max(report.block_targets) > min(report.block_targets)
    with torch.no_grad():
        ids = calib.input_ids[:2]
        logits = model(input_ids=ids, attention_mask=calib.attention_mask[:2]).logits
    assert torch.isfinite(logits).all()
    # the model card's sparsity section matches the real weights block by block
    from hf_layerswap.card import render_card, sparsity_mismatches

    assert sparsity_mismatches(model, report) == [] and sparsity_mismatches(model) == []
    text = render_card(model, sparsity_report=report, plots=[]).text
    for b in report.blocks:
        assert f"| {b.index} | {b.target:.4f} | {b.achieved:.4f} | {b.statistic:.4g} | kept |" in text


def _sparsity_benchmark():
    import importlib.util

    from conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("sparsity_benchmark", REPO_ROOT / "benchmarks" / "sparsity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_pals_verdict_rests_on_the_paired_sign_flip_test():
    """The benchmark's verdict on the PALS paper's direction: reproduced or reversed only at an
    exact sign-flip p < 0.05 (2/2^n when every seed agrees), undecided otherwise."""
    bench = _sparsity_benchmark()
    uniform = {s: 100.0 for s in range(9)}

    def verdict(pals, method="wanda"):
        groups = {("unstructured", "uniform", method): uniform, ("unstructured", "pals", method): pals}
        return bench.pals_verdict(groups, method, 0.6)

    assert bench.sign_flip_p([1.0] * 9) == 2 / 2**9
    worse = verdict({s: 110.0 + s for s in range(9)})
    assert " is reversed " in worse and "better on 0 of 9" in worse and "p = 0.004" in worse
    assert "+14.000" in worse  # mean of 10..18
    better6 = verdict({s: 90.0 for s in range(6)})
    assert " reproduces " in better6 and "p = 0.031" in better6  # 2/64
    better5 = verdict({s: 90.0 for s in range(5)})
    assert "is undecided (no reliable direction)" in better5 and "p = 0.062" in better5  # 2/32: never below 0.05
    mixed = verdict({s: 100.0 + (1 if s % 2 else -1) for s in range(9)})
    assert "undecided" in mixed and "better on 5 of 9" in mixed
    one = verdict({0: 90.0}, method="sparsegpt")
    assert "below uniform sparsegpt" in one and "1 calibration seed (PALS better on 1), no paired test" in one


def test_benchmark_page_renders_results_scored_in_one_window():
    """``--eval-words 200`` scores one 512-token window: the perplexities have no bootstrap
    interval (``ci_low`` None) and the paired test vs uniform none either; the page shows the
    dash where the interval goes instead of failing."""
    bench = _sparsity_benchmark()
    store = json.loads((REPO_ROOT / "benchmarks" / "results" / "sparsity-smollm2-135m.json").read_text())

    def one_window(ppl):
        return {**ppl, "windows": 1, "ci_low": None, "ci_high": None, "window_nll": [ppl["nll"]],
                "window_tokens": [ppl["tokens"]]}

    dense = store["dense|wordsNone"]
    dense["ppl"] = one_window(dense["ppl"])
    for run in store["runs"].values():
        run["ppl"] = one_window(run["ppl"])
    text = bench.render(store, "python benchmarks/sparsity.py --eval-words 200", "sparsity-smollm2-135m.json")
    assert f"Dense PPL: **{dense['ppl']['ppl']:.3f}** [—]." in text
    uniform = next(r for r in store["runs"].values() if r["allocation"] == "uniform" and r["pattern"] is None)
    pals = next(r for r in store["runs"].values() if r["allocation"] == "pals" and r["pattern"] is None
                and r["method"] == uniform["method"] and r["seed"] == uniform["seed"]
                and r["report"]["target_sparsity"] == uniform["report"]["target_sparsity"])
    assert f"| {uniform['ppl']['ppl']:.3f} [—] |" in text
    change = 100 * (pals["ppl"]["ppl"] / uniform["ppl"]["ppl"] - 1)
    assert f"| {change:+.2f} [—] |" in text
    assert "the paired window-bootstrap 95% interval excludes 0 on 0 of 1 (no interval on 1: fewer than two windows " \
           "score a token)." in text
    assert "None" not in text


def test_benchmark_cache_shared_by_processes_loses_no_run(tmp_path):
    """Two processes writing one result cache at once (each read-modify-write under the lock)
    keep every run of both."""
    import multiprocessing

    bench = _sparsity_benchmark()
    path = tmp_path / "cache.json"

    def add(prefix):
        store = bench.open_store(path)
        for i in range(25):
            store.put(f"{prefix}{i}", {"i": i})

    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=add, args=(p,)) for p in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    runs = bench.open_store(path).cells
    assert sorted(runs) == sorted(f"{p}{i}" for p in "ab" for i in range(25))
    assert bench.open_store(path).state == json.loads(path.read_text())


def test_benchmark_commands_differing_only_in_seeds_share_one_line():
    """The page's command list: a rerun with other ``--seeds`` extends the matching line's
    seeds (sorted, no repeats); any other difference, or an exact repeat, is kept apart or once."""
    bench = _sparsity_benchmark()
    line = "python benchmarks/sparsity.py --model m --allocations owl --patterns 2:4 --seeds {} --threads 1"
    commands = bench.merge_command([], line.format(5))
    commands = bench.merge_command(commands, line.format("3 4"))
    commands = bench.merge_command(commands, line.format(4))
    assert commands == [line.format("3 4 5")]
    other = line.replace("owl", "random").format(4)
    no_seeds = "python benchmarks/sparsity.py --model m --render-only"
    commands = bench.merge_command(bench.merge_command(commands, other), no_seeds)
    assert commands == [line.format("3 4 5"), other, no_seeds]
    assert bench.merge_command(commands, no_seeds) == commands


def test_benchmark_ablation_verdict_is_a_paired_test_per_method():
    """Gradient vs random: holds / reversed only at sign-flip p < 0.05, per method."""
    bench = _sparsity_benchmark()
    random_ = {s: 100.0 for s in range(9)}

    def verdict(gradient):
        groups = {("unstructured", "gradient", "wanda"): gradient, ("unstructured", "random", "wanda"): random_}
        return bench.ablation_verdict(groups, "wanda")

    better = verdict({s: 95.0 for s in range(9)})
    assert "wanda) is reversed here: gradient worse on 0 of 9" in better and "-5.000" in better and "p = 0.004" in better
    assert " holds here: gradient worse on 9 of 9" in verdict({s: 101.0 for s in range(9)})
    mixed = verdict({s: 100.0 + (1 if s < 7 else -1) for s in range(9)})
    assert "is undecided (no reliable direction)" in mixed and "worse on 7 of 9" in mixed
    assert "1 paired seed, no test" in verdict({0: 90.0})


def test_benchmark_scope_names_what_the_grid_lacks():
    """The page's scope line: cells short of the grid's seed count are named with their count,
    option variants are listed apart, and a complete grid says so."""
    bench = _sparsity_benchmark()
    full = {s: 100.0 for s in range(bench.ISSUE_SEEDS)}
    groups = {("unstructured", a, m): dict(full) for a in bench.ALLOCATIONS for m in ("wanda", "sparsegpt")}
    assert bench.scope_statement(groups, 0.6) == (
        f"Scope: this model at sparsity 0.6, calibration seeds {list(range(9))} in every cell. "
        "(2:4 fixes the sparsity at 0.5: it is in that section.)"
    )
    at_half = bench.scope_statement(groups, 0.5)
    assert at_half.endswith("in every cell. Not run here (shared 2-core CPU): 2:4 pattern.")
    groups[("2:4", "uniform", "wanda")] = dict(full)
    groups[("unstructured", "gradient", "sparsegpt")] = {0: 1.0, 1: 2.0}
    groups[("unstructured", "pals/invert=true", "wanda")] = {0: 1.0}
    del groups[("unstructured", "owl", "wanda")], groups[("unstructured", "owl", "sparsegpt")]
    text = bench.scope_statement(groups, 0.5)
    assert "(not every cell has all of them: see the tables)." in text
    assert "Not run here (shared 2-core CPU): owl allocation, 9 seeds in unstructured gradient sparsegpt (2)." in text
    assert text.endswith("Option variants outside the grid (seeds): unstructured pals/invert=true wanda (1).")


# ----------------------------------------------------------------------------- registries
def test_unknown_allocation_or_method_lists_the_registered_ones():
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS, get_allocator, get_pruner

    assert list(ALLOCATORS) == ["uniform", "pals", "owl", "random", "gradient"]
    assert list(PRUNERS) == ["wanda", "sparsegpt", "magnitude"]
    model = tiny_model("llama", num_blocks=2)
    with pytest.raises(ValueError, match=re.escape("allocation='best': allowed ['uniform', 'pals', 'owl', 'random', 'gradient']")):
        sparsify(model, build_calibration(tiny_batch()), allocation="best")
    with pytest.raises(ValueError, match=re.escape("pruner='obc': allowed ['wanda', 'sparsegpt', 'magnitude']")):
        get_pruner("obc")
    with pytest.raises(ValueError, match=r"allocation=\['pals'\]: allowed"):
        get_allocator(["pals"])


class _RowCount:
    """A toy per-linear statistic: how many real input rows the pruning pass saw."""

    def __init__(self, in_features, device):
        self.rows = 0

    def update(self, rows):
        self.rows += rows.shape[0]


def test_a_registered_toy_allocator_and_pruner_run_end_to_end():
    """One decorator each: the toy method is accepted by sparsify, its options are
    checked, its statistics are fed, and the card names it."""
    from hf_layerswap.card import render_card
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS, register_allocator, register_pruner

    seen_rows = []

    @register_allocator("toy_front", label="toy: the first block dense", options=("seed",),
                        card_options=lambda info: [f"dense block {info['dense_block']}"], record_keys=("dense_block",))
    def toy_front(inputs):
        n = inputs.num_params
        rest = inputs.sparsity * sum(n) / sum(n[1:])  # same parameter-weighted budget
        return [0.0] + [rest] * (len(n) - 1), None, {"statistic": "none", "dense_block": 0}

    @register_pruner("toy_magnitude", label="toy: magnitude after counting rows", statistics=_RowCount)
    def toy_magnitude(weight, counts, target, pattern, opts):
        seen_rows.append(counts.rows)
        return magnitude_prune(weight, target, pattern)[0]

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_pruner("toy_magnitude", label="again")(toy_magnitude)
        model = tiny_model("llama", num_blocks=3)
        calib = build_calibration(tiny_batch())
        with pytest.warns(UserWarning, match=r"options \['delta'\] have no effect with allocation='toy_front'"):
            sparsify(copy.deepcopy(model), calib, sparsity=0.25, allocation="toy_front", pruner="toy_magnitude", delta=0.1)
        report = sparsify(model, calib, sparsity=0.25, allocation="toy_front", pruner="toy_magnitude", seed=3)
        assert report.allocator["name"] == "toy_front" and report.allocator["dense_block"] == 0
        assert report.blocks[0].num_zeros == 0 and report.blocks[0].target == 0.0
        assert abs(report.achieved_sparsity - 0.25) < 0.02
        real_tokens = int(calib.attention_mask.sum())
        assert seen_rows and set(seen_rows) == {real_tokens}  # every linear saw every real token once
        text = render_card(model, sparsity_report=report, plots=[]).text
        assert "| Method | toy: magnitude after counting rows |" in text
        assert "| Layerwise allocation | toy: the first block dense; dense block 0 |" in text
    finally:
        del ALLOCATORS["toy_front"], PRUNERS["toy_magnitude"]


def test_sparsity_experiment_is_exactly_the_stored_grid():
    """experiments/sparsity.toml expands to the configurations the committed pages store, no more, no less."""
    bench = _sparsity_benchmark()
    argvs = bench.experiment_argvs("sparsity")
    assert argvs[-1] == ["--model", "smollm2-135m", "--sparsity", "0.5", "--num-prompts", "32", "--seq-len", "128",
                         "--threads", "1", "--allocations", "pals/source=block_input", "pals/invert=true", "--methods",
                         "wanda", "--seeds", "0"]
    planned = {}
    for argv in argvs:
        args = bench.build_parser().parse_args(argv)
        planned.setdefault(args.model, set()).update(bench.config_key(*c, vars(args)) for c in bench.configurations(args))
    for model, keys in planned.items():
        stored = json.loads((REPO_ROOT / "benchmarks" / "results" / f"sparsity-{model}.json").read_text())["runs"]
        assert keys == set(stored), model
    assert {m: len(k) for m, k in planned.items()} == {"smollm2-135m": 200, "gemma3-270m": 198}
    with pytest.raises(ValueError, match=r"--groups \['nope'\]: experiment 'sparsity' has the groups \['unstructured', 'nm', 'pals_variants'\]"):
        bench.experiment_argvs("sparsity", ["nope"])


def test_an_offloaded_model_is_refused_before_any_forward_pass(tmp_path):
    from conftest import tiny_checkpoint
    from hf_layerswap.models import load_model

    tiny_checkpoint(tmp_path / "base")
    model, _ = load_model(tmp_path / "base", max_memory={"cpu": "60KB"}, offload_folder=str(tmp_path / "off"))
    before = {k: v.clone() for k, v in model.state_dict().items() if v.device.type != "meta"}
    with pytest.raises(ValueError, match=r"sparsity on a model with offloaded weights \(model\.layers\.\d.*are "
                                         r"offloaded by its device map\)"):
        sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="magnitude")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert "layerswap_sparsity" not in model.config.to_dict()
