"""estimate_cost of the steps after the selection (hf_layerswap/cost/steps.py): a repair,
healing and sparsity, against forward hooks in the real prune of a tiny model."""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

import hf_layerswap as hl
from arch_matrix import tiny_tokenizer
from conftest import PARAGRAPHS, counted_prune, tiny_checkpoint
from hf_layerswap.cost import steps as cost_steps
from hf_layerswap.cli import main
from hf_layerswap.cost import Throughput
from hf_layerswap.healing import heal
from hf_layerswap.healing.methods import get_heal_method

FIXED = Throughput(1e9, 2e9, 1e9, source="fixed for the test")
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"


def _tiny(layers: int = 8) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2)


def _calibration(prompts: int = 6) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (prompts, 16))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _estimate(config, calib, layers: int = 8):
    return hl.estimate_cost(_tiny(layers), config, calibration=calib, throughput=FIXED)


@pytest.mark.parametrize("method", ["ghosted", "fused", "linearpatch"])
def test_a_repair_of_given_blocks_is_counted_exactly(method):
    calib = _calibration()
    config = hl.LayerSwapConfig(layers=[3, 5], recovery=hl.RecoveryConfig(method=method), batch_size=4,
                                progress=False)
    estimate = _estimate(config, calib)
    assert (estimate.block_passes, estimate.head_passes) == counted_prune(_tiny(), config, calib)
    assert estimate.exact and list(estimate.phases) == ["recovery"]
    # 2 batches, each up to the stream entering block 6 (blocks 0..5); fused: two forwards up to
    # block 3 and two up to block 5 first (the host checks of cuts 3 and 5)
    assert estimate.block_passes == 2 * 6 + (2 * 3 + 2 * 5 if method == "fused" else 0)


def test_a_linearpatch_repair_holds_its_own_moments():
    """Per cut an (H, H) XᵀX and XᵀY and two (H,) magnitude sums, where ghosted holds an XᵀX
    and XᵀY per removed block and one more (H, H) per cut: with cuts of one block each (the
    same stream slots read), the estimates differ by exactly that."""
    calib, hidden = _calibration(), _tiny().hidden_size
    phases = {}
    for method in ("ghosted", "linearpatch"):
        config = hl.LayerSwapConfig(layers=[3, 6], recovery=method, batch_size=4, progress=False)
        phases[method] = _estimate(config, calib).phases["recovery"]
    ghosted = 8 * hidden**2 * (2 * 2 + 2)  # cuts [3] and [6]
    linearpatch = 8 * (2 * hidden**2 + 2 * hidden) * 2
    assert phases["ghosted"]["memory_bytes"] - phases["linearpatch"]["memory_bytes"] == ghosted - linearpatch
    assert phases["ghosted"]["block_passes"] == phases["linearpatch"]["block_passes"]


def test_a_repair_after_the_greedy_rule_is_bounded_by_the_deepest_cut():
    calib = _calibration()
    config = hl.LayerSwapConfig(num_to_remove=2, strategy="greedy", recovery=hl.RecoveryConfig(), batch_size=4,
                                progress=False)
    estimate = _estimate(config, calib)
    blocks, heads = counted_prune(_tiny(), config, calib)
    assert not estimate.exact and not estimate.phases["recovery"]["exact"] and estimate.phases["scoring"]["exact"]
    assert blocks <= estimate.block_passes <= 1.5 * blocks and heads == estimate.head_passes
    # the last removable block is 6 (block 7 protected): each batch runs blocks 0..6
    assert estimate.phases["recovery"]["block_passes"] == 2 * 7


@pytest.mark.parametrize("protocol", ["interchange", "replacement"])
def test_a_fused_repair_after_the_greedy_rule_bounds_every_host_check(protocol):
    """fused checks each cut's host: with the blocks not yet chosen, separate cuts (two host
    checks) can cost more than the deepest run of blocks (one): each of the deepest removable
    blocks is counted as a cut of its own."""
    calib = _calibration()
    config = hl.LayerSwapConfig(num_to_remove=2, strategy="greedy", protocol=protocol, recovery="fused",
                                batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    blocks, heads = counted_prune(_tiny(), config, calib)
    assert not estimate.exact and blocks <= estimate.block_passes <= 1.5 * blocks and heads == estimate.head_passes
    # 2 batches up to block 6, then two forwards up to the hosts of blocks 5 and 6 (blocks 0..4, 0..5)
    assert estimate.phases["recovery"]["block_passes"] == 2 * 7 + 2 * 5 + 2 * 6


@pytest.mark.parametrize("pruner,allocation", [("wanda", "pals"), ("sparsegpt", "uniform"),
                                               ("magnitude", "gradient")])
def test_sparsity_passes_are_counted_exactly(pruner, allocation):
    calib = _calibration(prompts=10)
    sparsity = hl.SparsityConfig(sparsity=0.5, allocation=allocation, pruner=pruner)
    config = hl.LayerSwapConfig(layers=[2], sparsity=sparsity, batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    assert (estimate.block_passes, estimate.head_passes) == counted_prune(_tiny(), config, calib)
    # 7 kept blocks, 2 batches of 8 prompts: the dense pass, the statistics replay (not for
    # magnitude), the propagation over 6 blocks; the gradient allocator's forwards with the head
    replay = 0 if pruner == "magnitude" else 7
    gradient = 7 if allocation == "gradient" else 0
    assert estimate.block_passes == 2 * (7 + replay + 6 + gradient)
    assert estimate.head_passes == (2 if allocation == "gradient" else 0)


@pytest.mark.parametrize("top_k", [None, 5])
def test_healing_passes_are_counted_exactly_when_the_early_stop_cannot_fire(top_k):
    calib = _calibration(prompts=7)
    # 3 steps of 2 prompts x 16 tokens; 7 prompts: 5 for training, 2 held out; evaluations before
    # training and after the last step (eval_every=4 > 3 steps: the early stop cannot fire)
    healing = hl.HealConfig(max_tokens=96, seq_len=16, batch_size=2, eval_every=4, heldout_prompts=2,
                            teacher_top_k=top_k, learning_rate=1e-3)  # a rate given: no probe (tests/test_healing_choice.py)
    config = hl.LayerSwapConfig(layers=[3, 5], heal=healing, batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    assert estimate.exact and estimate.phases["healing"]["exact"]
    assert (estimate.block_passes, estimate.head_passes) == counted_prune(_tiny(), config, calib)
    # per step the student's 6 blocks and (without a cache) the teacher's 8; the cache: the
    # teacher over 3 batches of the 5 training prompts; each evaluation (and the finite-start
    # check before them): both on one batch
    teacher = 3 * 8  # 3 steps, or the cache's 3 batches (2 + 2 + 1 prompts)
    assert estimate.block_passes == 3 * 6 + teacher + 3 * (8 + 6)
    # training FLOPs: the student's forward + backward (3 forwards) and the teacher's forward
    phase = estimate.phases["healing"]
    assert phase["flops"] == phase["block_flops"] + phase["head_flops"]
    assert estimate.seconds == pytest.approx(estimate.flops / 1e9 - phase["head_flops"] / 2e9)


def test_healing_on_given_tensors_counts_their_width_in_the_budget():
    # the removal's prompts (16 tokens) under heal's default seq_len=128: 96 tokens are 3 steps of 2 x 16
    calib = _calibration(prompts=7)
    healing = hl.HealConfig(max_tokens=96, batch_size=2, eval_every=4, heldout_prompts=2)
    config = hl.LayerSwapConfig(layers=[3, 5], heal=healing, batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    assert "lora: 3 steps of 2 prompts x 16 tokens, 2 held-out evaluations" in estimate.phases["healing"]["note"]
    assert estimate.exact and (estimate.block_passes, estimate.head_passes) == counted_prune(_tiny(), config, calib)


def test_healing_with_a_possible_early_stop_is_an_upper_bound():
    calib = _calibration(prompts=12)
    healing = hl.HealConfig(max_tokens=8 * 32, seq_len=16, batch_size=2, eval_every=2, patience=2, heldout_prompts=2,
                            learning_rate=1e-3)
    config = hl.LayerSwapConfig(layers=[3, 5], heal=healing, batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    blocks, heads = counted_prune(_tiny(), config, calib)
    assert not estimate.phases["healing"]["exact"]
    # 8 steps and 1 + 4 evaluations at most, and the finite-start check
    assert estimate.block_passes == 8 * (6 + 8) + 6 * (8 + 6)
    assert estimate.head_passes == 8 * 2 + 6 * 2
    assert blocks <= estimate.block_passes <= 1.5 * blocks and heads <= estimate.head_passes <= 1.5 * heads


def test_packed_healing_text_is_counted_as_every_window_of_the_budget(tmp_path):
    # heal packs a text (its default) into steps x batch_size distinct windows, beyond the 256
    # prompts of one paragraph per prompt: 100 steps of 3 windows, the cached teacher over all 300
    text = tmp_path / "heal.txt"
    text.write_text("\n\n".join(PARAGRAPHS * 10))  # 60 paragraphs, over 5,000 tokens: 302 windows of 16
    healing = hl.HealConfig(method="last_k", options={"k": 1}, calibration=str(text), max_tokens=100 * 3 * 16,
                            seq_len=16, batch_size=3, eval_every=200, heldout_prompts=2, teacher_top_k=5,
                            learning_rate=1e-3)
    phase = _estimate(hl.LayerSwapConfig(layers=[3, 5], heal=healing, progress=False), _calibration()).phases["healing"]
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(_tiny()).eval()
    student = copy.deepcopy(teacher)
    hl.remove_layers(student, [3, 5])
    counts = {"block": 0, "head": 0}
    for model in (teacher, student):
        for block in model.model.layers:
            block.register_forward_hook(lambda *_: counts.__setitem__("block", counts["block"] + 1))
        model.lm_head.register_forward_hook(lambda *_: counts.__setitem__("head", counts["head"] + 1))
    report = heal(student, teacher, str(text), tokenizer=tiny_tokenizer(), **healing.heal_kwargs())
    assert (report.steps, report.distinct_tokens) == (100, 300 * 16)
    # 100 batches of the cache (teacher, 8 blocks), 100 steps (student, 6), 2 evaluations of one
    # batch and the finite-start check (both)
    assert (phase["block_passes"], phase["head_passes"]) == tuple(counts.values()) == (100 * 8 + 100 * 6 + 3 * 14,
                                                                                       100 + 100 + 3 * 2)


def test_a_huge_healing_budget_is_estimated_at_once():
    # 10**12 steps (the estimate is what tells that a budget is out of reach): its batches are
    # counted by size, never listed one by one
    def too_slow(*_):
        raise TimeoutError("the healing phase walks its batches one by one")

    healing = hl.HealConfig(method="last_k", options={"k": 1}, max_tokens=10**12 * 3 * 16, seq_len=16, batch_size=3,
                            heldout_prompts=2, learning_rate=1e-3)
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        phase = _estimate(hl.LayerSwapConfig(layers=[3, 5], heal=healing, progress=False),
                          _calibration(12)).phases["healing"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # each step the teacher (8 blocks) and the student (6); 1 + 10**12 / 4 evaluations of the 2 held-out prompts,
    # and the finite-start check
    evaluations = 1 + 10**12 // 4
    assert (phase["block_passes"], phase["head_passes"]) == (10**12 * 14 + (evaluations + 1) * 14,
                                                             (10**12 + evaluations + 1) * 2)
    assert f"{10**12} steps of 3 prompts x 16 tokens, {evaluations} held-out evaluations" in phase["note"]


class _OptimizerBytes(TrainerCallback):
    """Bytes of AdamW's state after the first step (exp_avg, exp_avg_sq, step per tensor)."""

    def __init__(self):
        self.state = None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.state is None:
            self.state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                             if torch.is_tensor(t))


@pytest.mark.parametrize("method,options", [("lora", {"lora_r": 4}), ("adjacent", {}), ("last_k", {"k": 2})])
def test_trainable_parameters_and_optimizer_state_equal_the_real_healing(method, options):
    calib = _calibration(prompts=7)
    healing = hl.HealConfig(method=method, max_tokens=32, seq_len=16, batch_size=2, heldout_prompts=2, options=options)
    config = hl.LayerSwapConfig(layers=[3, 4], heal=healing, batch_size=4, progress=False)
    phase = _estimate(config, calib).phases["healing"]
    torch.manual_seed(1)
    model = LlamaForCausalLM(_tiny()).eval()
    teacher = copy.deepcopy(model)
    hl.remove_layers(model, [3, 4])
    trained = get_heal_method(method).prepare(copy.deepcopy(model), options)
    params = [p for p in trained.parameters() if p.requires_grad]
    assert (phase["trainable_params"], phase["trainable_tensors"]) == (sum(p.numel() for p in params), len(params))
    seen = _OptimizerBytes()
    heal(model, teacher, calib, method=method, max_tokens=32, seq_len=16, batch_size=2, heldout_prompts=2,
         callbacks=[seen], **options)
    grads_and_best = 2 * sum(p.numel() * p.element_size() for p in params)
    assert seen.state + grads_and_best == phase["optimizer_bytes"]


def test_the_steps_peak_memory_holds_the_teacher_copy_and_the_training_state():
    calib = _calibration(prompts=7)
    healing = hl.HealConfig(method="last_k", max_tokens=32, seq_len=16, batch_size=2, heldout_prompts=2)
    config = hl.LayerSwapConfig(layers=[3, 4], heal=healing, batch_size=4, progress=False)
    estimate = _estimate(config, calib)
    weights = sum(p.numel() * 4 for p in LlamaForCausalLM(_tiny()).parameters())
    phase = estimate.phases["healing"]
    # the dense teacher and the pruned student, plus the optimizer state: at least that much
    assert phase["memory_bytes"] > 2 * weights - 2 * weights // 8 + phase["optimizer_bytes"]
    assert estimate.memory_parts["steps"] == phase["memory_bytes"]
    assert estimate.peak_memory_bytes["cpu"] >= phase["memory_bytes"]


def test_healing_the_real_run_would_refuse_is_refused():
    with pytest.raises(ValueError, match="4 calibration prompt\\(s\\) with heldout_prompts=4"):
        _estimate({"layers": [2], "heal": {"method": "lora", "heldout_prompts": 4}}, _calibration(4))
    with pytest.raises(ValueError, match=r"heal option k=9: must be an int in 1\.\.7"):
        _estimate({"layers": [2], "heal": {"method": "last_k", "options": {"k": 9}}}, _calibration())


# ------------------------------------------------------------------ healing's measurements
def _text_of_1299_tokens(path):
    """130 words of 9 letters: 1,299 characters, one token each under the character tokenizer."""
    path.write_text(" ".join(["abcdefghi"] * 130) + "\n")
    return str(path)


def _measuring(text=None, recovery=None, **tasks):
    healing = hl.HealConfig(max_tokens=96, seq_len=16, batch_size=2, eval_every=4, heldout_prompts=2,
                            perplexity_text=text, **tasks)
    return hl.LayerSwapConfig(layers=[3, 5], heal=healing, recovery=recovery, batch_size=4, progress=False,
                              tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("recovery", [None, "ghosted"])
def test_healing_perplexity_passes_equal_what_hooks_count_in_the_real_heal(tmp_path, recovery):
    calib = _calibration(prompts=7)
    config = _measuring(_text_of_1299_tokens(tmp_path / "eval.txt"), recovery)
    estimate = _estimate(config, calib)
    assert estimate.exact and estimate.phases["healing"]["exact"]
    counted = counted_prune(_tiny(), config, calib)
    assert (estimate.block_passes, estimate.head_passes) == counted
    # the measurements' share alone: the same prune without them, subtracted
    plain = counted_prune(_tiny(), _measuring(None, recovery), calib)
    ppl = estimate.phases["healing"]["perplexity"]
    assert (ppl["block_passes"], ppl["head_passes"]) == (counted[0] - plain[0], counted[1] - plain[1])
    # matched windows of 512 tokens every 256 over 1,299 tokens: [0, 512) alone, three windows of
    # 512 scoring 256 tokens each (2 forwards of 2 windows and 1), the last 275 tokens: 4 forwards
    # per stage; the dense teacher runs 8 blocks, each later stage the 6 kept ones
    stages = ["dense", "after_cut"] + (["after_repair"] if recovery else []) + ["after_healing"]
    assert ppl["stages"] == stages and ppl["forwards_per_stage"] == 4
    assert ppl["block_passes"] == 4 * 8 + (len(stages) - 1) * 4 * 6 and ppl["head_passes"] == 4 * len(stages)


def test_healing_perplexity_on_a_model_of_fewer_positions_fits_its_window(tmp_path):
    """max_position_embeddings=200, below the matched contract's 512-token window: the prune
    heals and measures in windows of 200 every 100 tokens (it used to refuse after the cut,
    "lower window"), and the estimate prices those windows: its passes are what hooks count."""
    calib = _calibration(prompts=7)
    short = _tiny()
    short.max_position_embeddings = 200
    config = _measuring(_text_of_1299_tokens(tmp_path / "eval.txt"))
    estimate = hl.estimate_cost(copy.deepcopy(short), config, calibration=calib, throughput=FIXED)
    # [0, 200) alone, ten windows of 200 scoring 100 tokens each (5 forwards of 2), the last 199 tokens
    assert estimate.phases["healing"]["perplexity"]["forwards_per_stage"] == 7
    torch.manual_seed(1)
    model = LlamaForCausalLM(short).eval()
    counts = {"block": 0, "head": 0}
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: counts.__setitem__("block", counts["block"] + 1))
    model.lm_head.register_forward_hook(lambda *_: counts.__setitem__("head", counts["head"] + 1))
    hl.prune(model, config, calibration=calib)
    assert (estimate.block_passes, estimate.head_passes) == (counts["block"], counts["head"])
    ppl = model.config.layerswap["healing"][-1]["perplexity"]
    assert (ppl["window"], ppl["stride"]) == (200, 100)
    assert all(ppl[stage] > 0 for stage in ("dense", "after_cut", "after_healing"))


def test_healing_lm_eval_tasks_are_bounded_or_said_not_estimated(tmp_path):
    pytest.importorskip("lm_eval")
    calib = _calibration(prompts=7)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "missing.jsonl"
    (tasks / "gen.yaml").write_text(
        "task: layerswap_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {TASKS / 'layerswap_mc.jsonl'}\noutput_type: generate_until\ntest_split: test\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: exact_match\n")
    (tasks / "gone.yaml").write_text(
        "task: layerswap_gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n")
    for name in ("layerswap_mc.yaml", "layerswap_mc.jsonl", "layerswap_rolling.yaml", "layerswap_rolling.jsonl",
                 "local_data.py"):
        (tasks / name).write_text((TASKS / name).read_text())
    counted_tasks = ["layerswap_mc", "layerswap_rolling"]
    config = _measuring(eval_tasks=counted_tasks, eval_tasks_path=str(tasks), eval_tasks_limit=4)
    estimate = _estimate(config, calib)
    phase = estimate.phases["healing"]
    blocks, heads = counted_prune(_tiny(), config, calib)
    plain = counted_prune(_tiny(), _measuring(), calib)
    assert not estimate.exact and not phase["exact"]
    assert blocks <= estimate.block_passes and heads <= estimate.head_passes
    assert (phase["tasks"]["block_passes"], phase["tasks"]["head_passes"]) == (blocks - plain[0], heads - plain[1])
    # 4 questions of 4 choices: 16 loglikelihood requests, one forward each; 4 short documents, one window each
    assert phase["tasks"]["forwards"] == {"layerswap_mc": 16, "layerswap_rolling": 4}
    assert phase["tasks"]["block_passes"] == 2 * 20 * 6 and phase["not_estimated"] == []
    lines = "\n".join(estimate.lines())
    assert "of which lm-eval: at most 240 block passes, 40 head passes (20 forwards per run" in lines
    every = _measuring(eval_tasks=[*counted_tasks, "layerswap_gen", "layerswap_gone"], eval_tasks_path=str(tasks),
                       eval_tasks_limit=4)
    estimate = _estimate(every, calib)
    lines = "\n".join(estimate.lines())
    assert "not estimated: lm-eval task 'layerswap_gen' (generate_until): its forwards depend on the generated" in lines
    assert "not estimated: lm-eval task 'layerswap_gone': its requests could not be built here" in lines
    assert estimate.phases["healing"]["tasks"]["block_passes"] == 240
    estimate = _estimate(_measuring(eval_tasks=["hellaswag"]), calib)  # lm-eval's own task: nothing downloaded
    assert estimate.phases["healing"]["not_estimated"] == [
        "lm-eval tasks ['hellaswag']: lm-eval's own tasks read their documents from the Hub; the estimate builds "
        "requests only from a local task folder (eval_tasks_path)"]


def test_healing_lm_eval_without_lm_eval_installed_is_said_not_estimated(monkeypatch):
    def missing(*_, **__):
        raise ImportError("No module named 'lm_eval'")

    monkeypatch.setattr(cost_steps, "task_requests", missing)
    config = _measuring(eval_tasks=["layerswap_mc"], eval_tasks_path=str(TASKS))
    phase = _estimate(config, _calibration(prompts=7)).phases["healing"]
    assert phase["not_estimated"] == ["lm-eval tasks ['layerswap_mc']: lm-eval is not installed (pip install "
                                      "'hf-layerswap[lm-eval]'), so their requests cannot be built"]
    assert not phase["exact"] and "tasks" not in phase


def test_healing_measurements_need_a_tokenizer(tmp_path):
    config = _measuring(_text_of_1299_tokens(tmp_path / "eval.txt"))
    config.tokenizer = None
    with pytest.raises(ValueError, match="no tokenizer given and none could be loaded"):
        _estimate(config, _calibration(prompts=7))


def test_prune_dry_run_prints_the_healing_measurements(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "base", LlamaForCausalLM(_tiny(6)))
    text = _text_of_1299_tokens(tmp_path / "eval.txt")
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "out"), "--layers", "2", "--recovery", "ghosted",
                 "--num-prompts", "8", "--seq-len", "16", "--heal", "--heal-perplexity", text,
                 "--heal-eval-tasks", "layerswap_mc", "--heal-eval-tasks-path", str(TASKS),
                 "--heal-eval-tasks-limit", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    # the word-level tokenizer: 130 words, 130 tokens, one window; 6 blocks dense, 5 at three stages
    assert "of which perplexity: 21 block passes, 4 head passes (4 stages x 1 forwards: dense, after_cut, " in out
    assert "of which lm-eval: at most " in out and "(8 forwards per run, before and after healing)" in out
    # heal's defaults priced: the budget for this machine's measured rates and the learning-rate probe
    assert "    budget chosen: " in out and " min at probe on cpu: one block over 4x128 positions and the head" in out
    assert "    learning-rate probe: 3 rates (0.0003, 0.001, 0.003) x " in out


def test_building_lm_eval_requests_writes_no_cache_and_reaches_no_hub(tmp_path, monkeypatch):
    """The estimate loads a local task's documents offline and into a throwaway cache: with
    the Hub online and the user's datasets cache set, nothing lands in that cache, and a
    task whose documents would need the Hub is built under the offline switch."""
    pytest.importorskip("lm_eval")
    import datasets.config
    from huggingface_hub import constants

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "j.yaml").write_text(
        "task: layerswap_json\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {TASKS / 'layerswap_mc.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n")
    (tasks / "offline.yaml").write_text(  # its loader refuses to run while the Hub is reachable
        "task: layerswap_offline\ncustom_dataset: !function offline_data.load\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n")
    (tasks / "offline_data.py").write_text(
        "import datasets\nfrom huggingface_hub import constants\n\n\ndef load(**_):\n"
        "    if not constants.is_offline_mode():\n        raise RuntimeError('the Hub is reachable')\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list([{'question': 'q', "
        "'choices': ['a', 'b'], 'answer': 0}])})\n")
    user_cache = tmp_path / "user_cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", user_cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", user_cache / "downloads")
    config = _measuring(eval_tasks=["layerswap_json", "layerswap_offline"], eval_tasks_path=str(tasks),
                        eval_tasks_limit=2)
    phase = _estimate(config, _calibration(prompts=7)).phases["healing"]
    # 2 questions of 4 choices; 1 question of 2 choices
    assert phase["tasks"]["forwards"] == {"layerswap_json": 8, "layerswap_offline": 2}
    assert phase["not_estimated"] == []
    assert not user_cache.exists()
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)
    assert datasets.config.HF_DATASETS_CACHE == user_cache


def test_an_lm_eval_task_name_lm_eval_does_not_know_is_refused_before_the_prune(tmp_path):
    """lm-eval's own tasks are not counted (their documents are on the Hub), but their names
    are checked: the real run would stop on an unknown one only after the scoring and the cut."""
    pytest.importorskip("lm_eval")
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['layerswap_no_such_task'\]"):
        _estimate(_measuring(eval_tasks=["hellaswag", "layerswap_no_such_task"]), _calibration(prompts=7))


def test_a_perplexity_text_too_short_to_score_is_named(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match=r"perplexity_text='.*empty\.txt': the text has 0 token\(s\); at least 2"):
        _estimate(_measuring(str(tmp_path / "empty.txt")), _calibration(prompts=7))
    with pytest.raises(FileNotFoundError, match=r"text='.*missing\.txt': no such file"):
        _estimate(_measuring(str(tmp_path / "missing.txt")), _calibration(prompts=7))


def test_a_registered_repair_and_healing_method_are_priced_by_their_entries():
    """The repair's check forwards and the healing method's trainable set come from their
    registry entries: a method registered under a new name with a built-in's behaviour is
    priced exactly like the built-in, and one whose entry plans no trainable set is named."""
    from hf_layerswap.healing.methods import HEAL_METHODS, HealMethod, LastK, register_heal_method
    from hf_layerswap.recovery import RECOVERY_METHODS, register_recovery_method
    from hf_layerswap.recovery.methods import Fused

    register_recovery_method("test_fused_copy")(type("FusedCopy", (Fused,), {}))
    register_heal_method("test_last_k_copy", options=("k",))(type("LastKCopy", (LastK,), {}))
    register_heal_method("test_unpriced")(type("Unpriced", (HealMethod,), {}))
    try:
        calib = _calibration(prompts=7)
        phases = {}
        for repair, method in (("fused", "last_k"), ("test_fused_copy", "test_last_k_copy")):
            healing = hl.HealConfig(method=method, max_tokens=32, seq_len=16, batch_size=2, heldout_prompts=2,
                                    options={"k": 2})
            config = hl.LayerSwapConfig(layers=[3, 5], recovery=repair, heal=healing, batch_size=4, progress=False)
            phases[repair] = _estimate(config, calib).phases
        # 2 batches up to block 6, and the host checks of cuts 3 and 5: two forwards up to blocks 3 and 5
        assert phases["test_fused_copy"]["recovery"]["block_passes"] == 2 * 6 + 2 * 3 + 2 * 5
        for key in ("block_passes", "head_passes", "memory_bytes"):
            assert phases["test_fused_copy"]["recovery"][key] == phases["fused"]["recovery"][key]
        for key in ("trainable_params", "trainable_tensors", "optimizer_bytes", "memory_bytes"):
            assert phases["test_fused_copy"]["healing"][key] == phases["fused"]["healing"][key]
        unpriced = hl.LayerSwapConfig(layers=[3], heal={"method": "test_unpriced"}, batch_size=4, progress=False)
        with pytest.raises(ValueError, match=r"heal method='test_unpriced' plans no trainable set .*estimate_cost "
                                             r"cannot price it; it prices \['adjacent', 'last_k', 'lora', "
                                             r"'test_last_k_copy'\]"):
            _estimate(unpriced, calib)
    finally:
        RECOVERY_METHODS.pop("test_fused_copy", None)
        for name in ("test_last_k_copy", "test_unpriced"):
            HEAL_METHODS.pop(name, None)
