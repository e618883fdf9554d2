"""Scoring engine performance features: prefix reuse and sharing, streamed KL, memory
budget, reduced precision, resumable runs, accelerate offload and probe-parallel ranks.

Every check compares against an independent way of computing the same numbers (full
forward per probe, the model's own full logits, an uninterrupted run, one process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from arch_matrix import build
from conftest import REPO_ROOT, tiny_batch, tiny_model
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap import scoring
from hf_layerswap.calibration import build_calibration
from hf_layerswap.layerplan import apply_plan, identity_plan, interchange_plan, num_blocks, removal_plan, replacement_plan
from hf_layerswap.scoring.report import PairResult, SwapReport
from hf_layerswap.scoring.engine import plan_engine
from hf_layerswap.scoring import (
    AdaptiveBudget,
    CheckpointMismatchError,
    masked_kl,
    parse_memory,
    plan_kl,
    selection_stability,
    swap_plans,
)


def _pair_values(report):
    return [(p.i, p.j, p.replacement_ij, p.replacement_ji, p.interchange) for p in report.pairs]


def _adjacent_plans(num_blocks):
    return swap_plans(num_blocks, 1)


# ---------------------------------------------------------------- prefix reuse
def test_prefix_reuse_and_sharing_change_no_value():
    model = tiny_model("gemma3", num_blocks=4)  # sliding and full attention blocks move with their type
    calib = build_calibration(tiny_batch(batch=4, length=10))
    plans = _adjacent_plans(4)
    # a gap-2 pair, removals (rm3 drops the last block: its last kept block is re-run) and the identity
    plans.update({"x13": interchange_plan(4, 1, 3), "r13": replacement_plan(4, 1, 3), "r31": replacement_plan(4, 3, 1)})
    plans.update({"rm1": removal_plan(4, [1]), "rm2": removal_plan(4, [2]), "rm3": removal_plan(4, [3]),
                  "id": identity_plan(4)})
    runs = {mode: plan_kl(model, calib, plans, batch_size=2, prefix_reuse=mode) for mode in ("shared", "start", "none")}
    for name in plans:
        assert torch.equal(runs["shared"][0][name], runs["none"][0][name]), name
        assert torch.equal(runs["start"][0][name], runs["none"][0][name]), name
    assert runs["none"][0]["id"].tolist() == [0.0] * 4
    # hand count of block forward calls per batch (2 batches); the reference runs 4 blocks.
    # "start": adjacent pair (i, i+1): repl i<-i+1 and the interchange start at slot i (4-i blocks each),
    # repl i+1<-i at slot i+1 (3-i): 11-3i, i=0..2: 24. x13 [0,3,2,1] and r13 [0,3,2,3]: 3 each from slot 1;
    # r31 [0,1,2,1]: 1; rm1 [0,2,3]: 2 from slot 1; rm2 [0,1,3]: 1; rm3 [0,1,2]: re-runs block 2: 1.
    start_count = 4 + 24 + 3 + 3 + 1 + 2 + 1 + 1
    # "shared": block i+1 at slot i once per adjacent pair (-3), blocks 3, 2 at slots 1, 2 once for
    # x13/r13 (-2), and rm1 starts after block 2 at slot 1, shared with the pair (1, 2) (-1).
    shared_count = start_count - 3 - 2 - 1
    none_count = 4 + 9 * 4 + 3 * 4 + 3 * 3
    assert runs["start"][1]["block_evaluations"] == 2 * start_count
    assert runs["shared"][1]["block_evaluations"] == 2 * shared_count
    assert runs["none"][1]["block_evaluations"] == 2 * none_count
    assert runs["shared"][1]["prefix_reuse"] == "shared" and runs["none"][1]["prefix_reuse"] == "none"


def test_score_layers_records_engine_settings():
    model = tiny_model("qwen3", num_blocks=4)
    report = hl.score_layers(model, tiny_batch(), progress=False, prefix_reuse=False)
    reused = hl.score_layers(model, tiny_batch(), progress=False)
    assert _pair_values(report) == _pair_values(reused)
    meta = reused.metadata
    assert meta["prefix_reuse"] == "shared" and report.metadata["prefix_reuse"] == "none"
    # the engine's own head: the float64 online KL (OnlineKL) whatever the blocks
    assert meta["compute_dtype"] == "float32" and meta["softmax_dtype"] == "float64" and meta["autocast"] is False
    assert meta["stream_logits"] is True and meta["world_size"] == 1
    # 3 prompts, one padded by 3: 33 real positions, through the head once for the reference + 9 probes
    assert meta["head_rows"] == 33 * 10
    with pytest.raises(ValueError, match="prefix_reuse='yes'"):
        hl.score_layers(model, tiny_batch(), progress=False, prefix_reuse="yes")


# ---------------------------------------------------------------- streamed KL
def test_masked_kl_is_independent_of_the_position_chunk(monkeypatch):
    g = torch.Generator().manual_seed(3)
    ref = torch.log_softmax(torch.randn(3, 9, 50, generator=g), -1)
    mod = torch.randn(3, 9, 50, generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    whole = masked_kl(ref, mod, mask)
    monkeypatch.setattr(scoring.kl, "KL_CHUNK_POSITIONS", 4)
    assert torch.equal(masked_kl(ref, mod, mask), whole)
    # against a direct float64 evaluation of the definition
    p = ref.double().exp()
    direct = (p * (ref.double() - torch.log_softmax(mod.double(), -1))).sum(-1)
    expected = (direct * mask).sum(1) / mask.sum(1)
    assert torch.allclose(whole, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_streamed_kl_equals_the_models_full_logits(family):
    if family == "gemma2":  # final logit soft-capping (2.0, so it bites): the head must reproduce it
        # the matrix row with transformers' default window and positions (window 4096: nothing slides at 11 tokens)
        model = build("gemma2", 4, dtype=None, final_logit_softcapping=2.0, sliding_window=4096,
                      max_position_embeddings=8192)
    else:
        model = tiny_model(family, num_blocks=4)
    layers = num_blocks(model)
    batch = tiny_batch(batch=4, length=11, pad_last=4)
    calib = build_calibration(batch)
    plans = _adjacent_plans(layers)
    # ground truth: KL in float64 from the model's own full fp32 logits
    truth = {}
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch, use_cache=False).logits.double(), -1)
        mask = batch["attention_mask"].double()
        for name, plan in plans.items():
            with apply_plan(model, plan):
                lq = torch.log_softmax(model(**batch, use_cache=False).logits.double(), -1)
            truth[name] = ((ref.exp() * (ref - lq)).sum(-1) * mask).sum(1) / mask.sum(1)
    full, stats = plan_kl(model, calib, plans, batch_size=4, stream_logits=False)
    assert stats["kl_chunk_vocab"] == 128 and stats["stream_logits"] is False
    # everything in one block: the whole vocabulary as one slice of the same float64 online KL
    whole, stats = plan_kl(model, calib, plans, batch_size=4)
    assert stats["kl_chunk_vocab"] == 128 and stats["kl_chunk_positions"] == 4 * 11
    # 40 real positions in chunks of 5, 128 vocabulary entries in 3 slices (43, 43, 42): float64 sums, one
    # pass (online log-sum-exp): each position through the head once for the reference and once per probe
    sliced, stats = plan_kl(model, calib, plans, batch_size=4, kl_chunk=5, vocab_chunk=43)
    assert stats["kl_chunk_vocab"] == 43 and stats["head_rows"] == 40 * (1 + len(plans))
    for name in plans:
        assert bool((truth[name] > 0).all())
        # the model's own logits through masked_kl (stream_logits=False): fp32 log-softmax loses up to
        # ~1e-4 relative on KLs of ~1e-3 (log-probs near -5 carry ~5e-7)
        assert torch.allclose(full[name], truth[name], rtol=1e-3, atol=0), name
        # one slice or three: the KL of the fp32 logits to float64 precision, and equal to each other
        assert torch.allclose(whole[name], truth[name], rtol=1e-6, atol=0), name
        assert torch.allclose(sliced[name], truth[name], rtol=1e-6, atol=0), name
        assert torch.allclose(sliced[name], whole[name], rtol=1e-10, atol=0), name  # float64 rounding


@pytest.mark.parametrize("bias,softcap", [(False, None), (True, 3.0)])
def test_reused_logit_buffer_gives_the_heads_own_values_bit_for_bit(bias, softcap):
    """The streamed head writes whole-vocabulary logits into one reused buffer; the values
    are those of the model's own head (plus soft-capping), exactly, and the in-place KL
    arithmetic equals the out-of-place definition exactly."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    head_module = model.get_output_embeddings()
    if bias:
        head_module.bias = torch.nn.Parameter(torch.randn(head_module.out_features))
    model.config.final_logit_softcapping = softcap
    head = scoring.Head(model)
    hidden = torch.randn(7, head_module.in_features)
    buf = torch.full((9, head.vocab), float("nan"))
    with torch.no_grad():
        own = head_module(hidden)
        if softcap is not None:
            own = torch.tanh(own / softcap) * softcap
        out = head.into(hidden, buf[:7])
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, own)
    ref_lp = torch.log_softmax(torch.randn(7, head.vocab) * 3, -1)
    lq = torch.log_softmax(own, -1)
    assert torch.equal(scoring.kl_rows(ref_lp, own), (ref_lp.exp() * (ref_lp - lq)).sum(-1).clamp_min(0.0))


def test_head_mismatch_falls_back_to_the_models_logits(monkeypatch):
    model = tiny_model("llama")
    calib = build_calibration(tiny_batch())
    plans = {"x": interchange_plan(6, 2, 3)}
    full, _ = plan_kl(model, calib, plans, stream_logits=False)
    original = scoring.Head._cap  # a head that disagrees with the model's forward (e.g. an unknown scale)
    monkeypatch.setattr(scoring.Head, "_cap", lambda self, logits: original(self, logits) * 1.5)
    with pytest.warns(UserWarning, match="did not reproduce the model's logits"):
        values, stats = plan_kl(model, calib, plans)
    assert stats["stream_logits"] is False and "did not reproduce" in stats["stream_logits_note"]
    assert torch.equal(values["x"], full["x"])


# ---------------------------------------------------------------- budget and precision
def test_memory_budget_sets_chunk_and_batch():
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory("800MiB") == 800 * 2**20
    assert parse_memory(2**30) == 2**30
    for bad in ("lots", "3 parsecs", 1024, True, 1.5):
        with pytest.raises(ValueError, match="max_memory"):
            parse_memory(bad)
    model = tiny_model("llama")  # vocab 128
    calib = build_calibration(tiny_batch(batch=6, length=12))
    _, stats = plan_kl(model, calib, {"x": interchange_plan(6, 1, 2)}, max_memory="1MiB", kl_chunk=1024)
    # the head/KL block gets 0.4 of what the budget leaves after a batch's activations (the fp32 head
    # holds nothing beside its logits); float64 reference weights and fp32 logits: 12 bytes per position
    # and vocabulary entry; the whole vocabulary needs 12 * 1024 * 128 bytes = 1.5 MiB, so sliced:
    # floor(0.4 * slice / (12 * 1024)) entries -> the fewest equal slices of the 128
    plan = plan_engine(model, calib, {"x": interchange_plan(6, 1, 2)},
                       scoring.settings.EngineSettings(max_memory="1MiB", kl_chunk=1024)).plan()
    assert 0 < plan.activation_bytes < 2**20 // 2 and plan.head_working_bytes == 0
    assert plan.slice_bytes == 2**20 - plan.activation_bytes
    width = int(0.4 * plan.slice_bytes) // (12 * 1024)
    slices = -(-128 // width)
    assert scoring.HEAD_BUDGET_FRACTION == 0.4 and scoring.engine.KL_BLOCK_ENTRY_BYTES == 12
    assert stats["kl_chunk_vocab"] == -(-128 // slices) < 32 and stats["kl_chunk_positions"] == 1024
    assert stats["max_memory"] == 2**20
    _, stats = plan_kl(model, calib, {"x": interchange_plan(6, 1, 2)})
    assert stats["kl_chunk_positions"] == 8 * 12  # one chunk holds a whole batch (8 prompts x 12 tokens)
    assert stats["kl_chunk_vocab"] == 128
    _, stats = plan_kl(model, calib, {"x": interchange_plan(6, 1, 2)}, batch_size="auto")
    assert stats["batch_size"] == 6  # everything fits the default 1 GiB: one batch of all prompts
    with pytest.raises(ValueError, match="batch_size"):
        plan_kl(model, calib, {"x": interchange_plan(6, 1, 2)}, batch_size=0)


def test_large_vocabulary_keeps_whole_vocabulary_blocks_of_fewer_positions(monkeypatch):
    """When a block of the default positions x the whole vocabulary exceeds the budget,
    fewer positions keep the whole vocabulary (one head GEMM per block); the vocabulary is
    sliced only when even the minimum of positions does not fit. The KL is the same
    arithmetic either way (float64 online log-sum-exp): equal to float64 rounding."""
    model = tiny_model("llama", 4, vocab_size=8192)
    ids = torch.randint(0, 8192, (8, 12), generator=torch.Generator().manual_seed(0))
    calib = build_calibration({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    plans = {"a": interchange_plan(4, 1, 2), "b": replacement_plan(4, 2, 1)}
    whole, stats = plan_kl(model, calib, plans, batch_size=8)
    assert stats["kl_chunk_positions"] == 96 and stats["kl_chunk_vocab"] == 8192
    # 4 MiB less a batch's activations: 0.4 x that / (12 bytes x 8192 entries) = 16 positions fit with
    # the whole vocabulary
    monkeypatch.setattr(scoring.engine, "MIN_WHOLE_VOCAB_CHUNK", 16)
    fewer, stats = plan_kl(model, calib, plans, batch_size=8, max_memory="4MiB")
    plan = plan_engine(model, calib, plans, scoring.settings.EngineSettings(batch_size=8, max_memory="4MiB")).plan()
    assert plan.slice_bytes == 4 * 2**20 - plan.activation_bytes
    assert stats["kl_chunk_positions"] == int(0.4 * plan.slice_bytes) // (12 * 8192) == 16
    assert stats["kl_chunk_vocab"] == 8192
    assert stats["kl_streaming"] == "position chunks, whole vocabulary, float64 online log-sum-exp (one pass)"
    assert stats["head_rows"] == 96 * (1 + len(plans))  # one head pass per probe and the reference
    monkeypatch.setattr(scoring.engine, "MIN_WHOLE_VOCAB_CHUNK", 32)  # 17 < 32: slices instead
    sliced, stats = plan_kl(model, calib, plans, batch_size=8, max_memory="4MiB")
    assert stats["kl_chunk_positions"] == 96 and stats["kl_chunk_vocab"] < 8192
    assert "vocabulary slices" in stats["kl_streaming"] and set(sliced) == set(plans)
    for name in plans:  # the same arithmetic on fewer positions per block, and in slices
        assert torch.equal(fewer[name], whole[name]), name  # a row's sums do not depend on its block
        assert torch.allclose(sliced[name], whole[name], rtol=1e-10, atol=0), name  # KLs of 1e-4: float64 rounding


def test_bf16_autocast_keeps_weights_and_fp32_softmax():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp32 = hl.score_layers(model, tiny_batch(), progress=False)
    bf16 = hl.score_layers(model, tiny_batch(), progress=False, dtype=torch.bfloat16)
    assert bf16.metadata["compute_dtype"] == "bfloat16" and bf16.metadata["autocast"] is True
    assert bf16.metadata["softmax_dtype"] == "float64" and bf16.metadata["dtype"] == "float32"
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k]), k
    a = [p.interchange for p in fp32.pairs]
    b = [p.interchange for p in bf16.pairs]
    assert a != b  # the forward really ran in bfloat16
    assert b == pytest.approx(a, rel=0.25)
    with pytest.raises(ValueError, match="dtype="):
        hl.score_layers(model, tiny_batch(), progress=False, dtype="int8")


# ---------------------------------------------------------------- resumable runs
_RUN_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from conftest import tiny_batch, tiny_model
    import hf_layerswap as hl
    from hf_layerswap.scoring.checkpoint import ScoringCheckpoint

    mode, out, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    model = tiny_model("gemma3", num_blocks=4)
    batch = tiny_batch(batch=12, length=8)
    if mode == "slow":  # checkpoint parts appear slowly, so the parent can kill us mid-run
        save = ScoringCheckpoint.save
        def slow_save(self, *a, **k):
            save(self, *a, **k)
            print("saved", flush=True)
            time.sleep(1.0)
        ScoringCheckpoint.save = slow_save
    kwargs = dict(progress=False, batch_size=2, max_gap=2)
    report = hl.score_layers(model, batch, checkpoint_path=None if ckpt == "-" else ckpt, **kwargs)
    pairs = [p.to_dict() for p in report.pairs]
    json.dump({{"pairs": pairs, "checkpoint": report.metadata.get("checkpoint")}}, open(out, "w"))
    """
)


def _python_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_resume_after_kill_gives_the_uninterrupted_values(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RUN_SCRIPT.format(tests=str(REPO_ROOT / "tests")))
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), "slow", str(tmp_path / "killed.json"), str(ckpt)],
        env=_python_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        for line in proc.stdout:  # 6 batches, one part each: kill after the second
            if line.strip() == "saved" and len(list(ckpt.glob("part-*.pt"))) >= 2:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    parts = sorted(ckpt.glob("part-*.pt"))
    assert 2 <= len(parts) < 6 and not (tmp_path / "killed.json").exists()
    # resume, and (in the same process) an uninterrupted run without a checkpoint
    resume = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = ["run.py", "fast", {str(tmp_path / "resumed.json")!r}, {str(ckpt)!r}]
        runpy.run_path({str(script)!r}, run_name="__main__")
        sys.argv = ["run.py", "fast", {str(tmp_path / "plain.json")!r}, "-"]
        runpy.run_path({str(script)!r}, run_name="__main__")
        """
    )
    subprocess.run([sys.executable, "-c", resume], env=_python_env(), check=True, timeout=600)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert resumed["pairs"] == plain["pairs"]  # exact: JSON floats round-trip
    # 15 probes per batch (5 pairs with max_gap=2 on 4 blocks, 3 each); >= 2 batches came from the checkpoint
    assert resumed["checkpoint"]["resumed_values"] >= 2 * 15
    assert len(list(ckpt.glob("part-*.pt"))) == 6 and not list(ckpt.glob(".*.tmp"))
    # the folder belongs to this run: another model, calibration or setting is refused
    other = tiny_model("gemma3", num_blocks=4, seed=1)
    with pytest.raises(CheckpointMismatchError, match="model.fingerprint"):
        hl.score_layers(other, tiny_batch(batch=12, length=8), progress=False, batch_size=2, max_gap=2,
                        checkpoint_path=ckpt)
    model = tiny_model("gemma3", num_blocks=4)
    with pytest.raises(CheckpointMismatchError, match="content_hash"):
        hl.score_layers(model, tiny_batch(batch=12, length=8, seed=5), progress=False, batch_size=2, max_gap=2,
                        checkpoint_path=ckpt)
    with pytest.raises(CheckpointMismatchError, match="batch_size"):
        hl.score_layers(model, tiny_batch(batch=12, length=8), progress=False, batch_size=3, max_gap=2,
                        checkpoint_path=ckpt)


# ---------------------------------------------------------------- scale-out
def test_device_map_cpu_and_disk_offload_gives_the_same_report(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    device_map.update({f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)})
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=str(tmp_path / "offload"), attn_implementation="eager"
    )
    assert {p.device.type for p in offloaded.model.layers[4].parameters()} == {"meta"}  # really on disk
    dispatched = hl.score_layers(offloaded, tiny_batch(), progress=False)
    # the head on disk is read in vocabulary slices (128 entries in 16 slices of 8): the values of the model in
    # memory with the same slices, exactly
    assert dispatched.metadata["head_streaming"].startswith("vocabulary slices of 8 entries")
    plain = hl.score_layers(model, tiny_batch(), progress=False, vocab_chunk=8)
    assert _pair_values(dispatched) == _pair_values(plain)
    assert dispatched.metadata["stream_logits"] is True


def test_probe_shards_are_disjoint_and_keep_shared_prefixes_together():
    plans = swap_plans(4, 2, ("replacement", "interchange"))
    assert len(plans) == 3 * 5 and plans[("replacement_ji", 1, 3)] == [0, 1, 2, 1]
    assert plans[("interchange", 0, 2)] == [2, 1, 0, 3] and plans[("replacement_ij", 0, 1)] == [1, 1, 2, 3]
    probes = scoring.make_probes(_adjacent_plans(8) | {"x": interchange_plan(8, 1, 5)}, 8)[1]
    shares = [scoring.shard(list(probes.values()), 3, r) for r in range(3)]
    keys = [p.key for share in shares for p in share]
    assert sorted(keys) == sorted(probes) and len(keys) == len(set(keys))
    for share in shares:  # the probes starting at slot i with block i+1 first live on one rank
        for i in range(7):
            group = {p.key for p in probes.values() if (p.start, p.run[0]) == (i, i + 1)}
            assert group <= {p.key for p in share} or not (group & {p.key for p in share})


# ---------------------------------------------------------------- adaptive budget
def _synthetic_report(means, num_blocks=5):
    pairs = [PairResult(i, i + 1, interchange=m) for i, m in enumerate(means)]
    return SwapReport(num_blocks, pairs, protocols=("interchange",))


def test_selection_stability_by_hand():
    # layer scores (min over adjacent pairs): s = [1.0, 1.0, 3.0, 0.5, 0.5] -> with spacing 1 and
    # protect (0, -1) the budget-1 pick is layer 3 (pair 3-4); the alternatives are layers 1 and 2.
    f64 = torch.float64
    values = {
        ("interchange", 0, 1): torch.tensor([1.0, 1.25, 0.75, 1.0], dtype=f64),
        ("interchange", 1, 2): torch.tensor([3.0, 3.0, 3.0, 3.0], dtype=f64),
        ("interchange", 2, 3): torch.tensor([4.0, 4.0, 4.0, 4.0], dtype=f64),
        ("interchange", 3, 4): torch.tensor([0.5, 0.75, 0.25, 0.5], dtype=f64),
    }
    report = _synthetic_report([float(v.mean()) for v in values.values()])
    assert report.layer_scores("interchange") == [1.0, 1.0, 3.0, 0.5, 0.5]
    out = selection_stability(report, values, 1, z=2.0)
    # s_1(x) - s_3(x) = 0.5 on every prompt (standard error 0); s_2(x) - s_3(x) = [2.5, 2.25, 2.75, 2.5]:
    # mean 2.5, sample std sqrt(0.125 / 3), standard error that / 2 -> the closest exchange is 3 -> 2
    assert out["selected"] == [3] and out["stable"] is True
    assert out["closest"]["selected"] == 3 and out["closest"]["alternative"] == 2
    assert out["closest"]["margin"] == 2.5 and out["closest"]["se"] == pytest.approx((0.125 / 3) ** 0.5 / 2)
    # now layer 1 ties layer 3 at 0.5 (and wins the tie by index): their paired difference has mean 0
    values[("interchange", 0, 1)] = torch.tensor([1.0, 0.25, 0.5, 0.25], dtype=f64)
    values[("interchange", 3, 4)] = torch.tensor([0.25, 0.75, 0.25, 0.75], dtype=f64)
    report = _synthetic_report([float(v.mean()) for v in values.values()])
    out = selection_stability(report, values, 1, z=2.0)
    assert out["selected"] == [1] and out["stable"] is False
    assert out["closest"]["alternative"] == 3 and out["closest"]["margin"] == 0.0


def test_adaptive_budget_rounds_and_stop_reasons():
    model = tiny_model("llama", num_blocks=4)
    batch = tiny_batch(batch=8, length=8)
    full = hl.score_layers(model, batch, progress=False, batch_size=2)
    never = hl.score_layers(model, batch, progress=False, batch_size=2,
                            adaptive=AdaptiveBudget(num_to_remove=1, z=1e9, min_prompts=3, step=2))
    record = never.metadata["adaptive"]
    assert record["stopped"] == "max_prompts" and "maximum of 8 prompts" in record["reason"]
    assert [r["num_prompts"] for r in record["rounds"]] == [4, 6, 8]  # 3 rounded up to whole batches of 2
    assert _pair_values(never) == _pair_values(full)  # same batches: the full run's numbers exactly
    quick = hl.score_layers(model, batch, progress=False, batch_size=2,
                            adaptive=AdaptiveBudget(num_to_remove=1, z=1e-9, min_prompts=4, step=2))
    record = quick.metadata["adaptive"]
    assert record["stopped"] == "stable" and [r["num_prompts"] for r in record["rounds"]] == [4]
    assert quick.metadata["num_prompts"] == 4 and record["rounds"][0]["selected"] == hl.select_layers(quick, 1)
    with pytest.raises(ValueError, match="not among the scored protocols"):
        hl.score_layers(model, batch, progress=False, protocols=("replacement",), adaptive=AdaptiveBudget(1))


def test_a_head_run_by_its_own_forward_takes_the_same_kl_arithmetic():
    """A head the engine cannot slice (a custom forward) runs whole through its own forward;
    its KL is the same float64 online arithmetic as a plain head's: the same values (its fp32
    GEMM gives the plain head's logits here)."""

    class CustomHead(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    plain = tiny_model("llama")
    custom = tiny_model("llama")
    head = plain.get_output_embeddings()
    custom.lm_head = CustomHead(head.in_features, head.out_features, bias=False)
    custom.lm_head.weight = head.weight
    calib = build_calibration(tiny_batch())
    plans = _adjacent_plans(6)
    ours, stats = plan_kl(plain, calib, plans)
    theirs, own = plan_kl(custom, calib, plans)
    assert not scoring.Head(custom).sliceable and scoring.Head(custom).own_forward
    assert own["kl_streaming"] == stats["kl_streaming"] == "position chunks, whole vocabulary, float64 online log-sum-exp (one pass)"
    assert all(torch.equal(theirs[name], ours[name]) for name in plans)
