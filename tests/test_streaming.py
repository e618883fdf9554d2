"""Slot-major streaming of offloaded models (:mod:`hf_layerswap.scoring.slotmajor`): a
model whose decoder blocks accelerate offloads to disk is scored with every block read
once per batch, and its pair KLs equal the in-memory model's; the movement and peak
memory are in the report's metadata."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.hooks import AlignDevicesHook
from accelerate.utils import compute_module_sizes, PrefixedDataset
from conftest import tiny_batch, tiny_model, WIKITEXT_VALID
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.calibration import build_calibration
from hf_layerswap.cost import Throughput
from hf_layerswap.utils.devices import (BlockPrefetcher, offloaded_bytes, offloaded_modules, OffloadedTensor, onloaded,
                                  peak_memory, sliced_calls)
from hf_layerswap.models import bundled_checkpoint_dir, load_model
from hf_layerswap.layerplan import decoder_blocks, removal_plan
from hf_layerswap.scoring.layerscores import swap_plans
from hf_layerswap.scoring import plan_kl
from hf_layerswap.scoring.head import Head
from hf_layerswap.scoring.probes import make_probes
from hf_layerswap.scoring.settings import EngineSettings
from hf_layerswap.scoring.engine import plan_engine
from hf_layerswap.scoring.reference import ReferenceCache
from hf_layerswap.scoring.slotmajor import (blocks_offloaded, capture_block_inputs, movable_blocks, plan_pass, probe_groups,
                                            run_pass, state_capacity)

FIELDS = ("replacement_ij", "replacement_ji", "interchange")


def _disk_offloaded(model, folder: Path, share: float = 0.25):
    """``model`` dispatched by accelerate with a CPU cap of ``share`` of its weights: what
    does not fit goes to ``folder`` on disk (``infer_auto_device_map`` + ``dispatch_model``)."""
    cap = int(share * compute_module_sizes(model)[""])
    device_map = infer_auto_device_map(model, max_memory={"cpu": cap}, no_split_module_classes=model._no_split_modules)
    return dispatch_model(model, device_map, offload_dir=str(folder)).eval()


class _Counts:
    """Per block: onloads (accelerate's ``pre_forward`` with offload on, the call that
    reads the weights, of the block's first offloaded module: every onload of the block
    reads it) and calls (a forward pre-hook on the block)."""

    def __init__(self, model):
        self.onloads, self.calls = Counter(), Counter()
        _, _, blocks = decoder_blocks(model)
        self.handles = []
        for b, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda *_, b=b: self.calls.update([b])))
            hooks = [m._hf_hook for m in block.modules() if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook)]
            offloading = [h for h in hooks if h.offload]
            if offloading:
                offloading[0].pre_forward = self._counting(offloading[0], offloading[0].pre_forward, b)

    def _counting(self, hook, pre_forward, b):
        def counted(module, *args, **kwargs):
            if hook.offload:
                self.onloads.update([b])
            return pre_forward(module, *args, **kwargs)

        return counted

    def reset(self):
        self.onloads.clear()
        self.calls.clear()


def _max_rel(a, b) -> float:
    out = 0.0
    for p, q in zip(a.pairs, b.pairs, strict=True):
        assert (p.i, p.j) == (q.i, q.j)
        for f in FIELDS:
            x, y = getattr(p, f), getattr(q, f)
            out = max(out, abs(x - y) / max(abs(x), 1e-30))
    return out


# ----------------------------------------------------------------------------- tiny models
def test_a_head_held_in_memory_under_a_hook_writes_into_the_reused_logit_buffer(tmp_path, monkeypatch):
    # the map a quarter of SmolLM2-135M's weights gives: embeddings and head on a "cpu" entry (an
    # accelerate hook that does not offload them), the rest on disk. Such a head is run like a
    # head in memory: its logits go into the one reused buffer (a fresh logit tensor per probe
    # fragmented the heap by about one logit block per probe, up to the size of the weights)
    dense = tiny_model("llama")
    calib = build_calibration(tiny_batch(batch=3, length=12))
    ours = hl.score_layers(dense, calib, progress=False, max_gap=2)
    device_map = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.layers": "disk", "model.norm": "disk",
                  "model.rotary_emb": "disk"}
    split = dispatch_model(tiny_model("llama"), device_map, offload_dir=str(tmp_path / "offload")).eval()
    head = Head(split)
    assert hasattr(split.lm_head, "_hf_hook") and not offloaded_modules(split.lm_head)
    assert head.sliceable
    calls = Counter()
    for name in ("__call__", "into"):
        original = getattr(Head, name)
        monkeypatch.setattr(Head, name, lambda self, *a, _f=original, _n=name: (calls.update([_n]), _f(self, *a))[1])
    theirs = hl.score_layers(split, calib, progress=False, max_gap=2)
    assert theirs.metadata["slot_major"] is True
    # every head GEMM goes into the buffer: the first batch's head check, the reference, one per probe
    assert calls == Counter({"into": 1 + 1 + theirs.metadata["distinct_probes"]})
    assert _max_rel(ours, theirs) == 0.0  # the in-memory run's GEMM, bit for bit


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_disk_offloaded_scoring_streams_each_block_once_and_equals_the_in_memory_run(family, tmp_path):
    dense = tiny_model(family)
    calib = build_calibration(tiny_batch(batch=5, length=12))
    ours = hl.score_layers(dense, calib, progress=False, max_gap=2, batch_size=3)
    split = _disk_offloaded(tiny_model(family), tmp_path / "offload")
    _, _, blocks = decoder_blocks(split)
    assert blocks_offloaded(split) and {p.device.type for p in blocks[5].parameters()} == {"meta"}
    counts = _Counts(split)
    theirs = hl.score_layers(split, calib, progress=False, max_gap=2, batch_size=3)  # two batches

    if family == "llama":  # the map puts the head on disk: read in vocabulary slices, float64 online KL
        assert theirs.metadata["head_streaming"] == "vocabulary slices of 8 entries read from the offload (16 per head phase)"
        sliced = hl.score_layers(dense, calib, progress=False, max_gap=2, batch_size=3, vocab_chunk=8)
        assert _max_rel(sliced, theirs) == 0.0  # the in-memory run with the same slices, bit for bit
        # the in-memory default takes the whole vocabulary at once: the same float64 online KL as one
        # slice, on fp32 logits from GEMMs of another shape (their sums in another order on some CPUs)
        assert _max_rel(ours, theirs) <= 1e-6
    else:  # the tied embedding and head on the map's "cpu" entry: held in memory
        assert theirs.metadata["head_streaming"] == "in memory"
        assert _max_rel(ours, theirs) == 0.0  # the same head GEMM and KL, bit for bit
    assert theirs.metadata["slot_major"] is True and ours.metadata["slot_major"] is False
    L = len(blocks)
    offloaded = [b for b in range(L) if offloaded_modules(blocks[b])]
    assert offloaded == list(range(L))  # a quarter of the weights: every block on disk
    assert counts.onloads == Counter({b: 2 for b in offloaded})  # once per batch each
    moved = theirs.metadata["movement"]
    assert moved["block_onloads_per_batch"] == [L, L] and moved["block_onloads"] == 2 * L
    assert moved["bytes_moved"] == 2 * sum(offloaded_bytes(blk) for blk in blocks)
    assert moved["bytes_moved"] == 2 * sum(p.numel() * 4 for p in dense.model.layers.parameters())
    # every block call is one distinct prefix of a plan: the plan's count, the same as depth-first
    assert sum(counts.calls.values()) == theirs.metadata["block_evaluations"] == ours.metadata["block_evaluations"]
    assert theirs.metadata["peak_memory"]["cpu"] > 0


def _all_on_disk(model, folder: Path):
    """``model`` with every module on disk (embeddings and head too): accelerate's ``.dat`` files."""
    device_map = {f"model.{n}": "disk" for n, _ in model.model.named_children()} | {"lm_head": "disk"}
    return dispatch_model(model, device_map, offload_dir=str(folder)).eval()


def test_offloaded_tensor_reads_only_the_rows_asked_for(tmp_path):
    """Rows of an offloaded weight from each storage accelerate uses: its ``.dat`` memmap, the
    checkpoint's safetensors file (a model loaded with an offload folder), tensors in CPU memory."""
    dense = tiny_model("llama")
    full = dense.lm_head.weight.detach().clone()
    split = _all_on_disk(tiny_model("llama"), tmp_path / "dat")
    dense.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", device_map={"": "disk"},
                                                  offload_folder=str(tmp_path / "st"))
    info = loaded.lm_head._hf_hook.weights_map.dataset.index["lm_head.weight"]
    assert info["safetensors_file"].endswith("model.safetensors")  # read from the checkpoint, not copied
    assert OffloadedTensor.of(dense.lm_head) is None  # in memory: nothing to read
    for module in (split.lm_head, loaded.lm_head):
        src = OffloadedTensor.of(module)
        assert module.weight.device.type == "meta" and src.shape == full.shape and src.dtype == torch.float32
        a, b = src.rows([(5, 9), (100, 101)])
        assert torch.equal(a, full[5:9]) and torch.equal(b, full[100:101])
        assert torch.equal(src.take(torch.tensor([0, 1, 2, 7, 127])), full[[0, 1, 2, 7, 127]])
        assert src.bytes_read == (4 + 1 + 5) * 32 * 4  # rows x hidden x fp32
    in_memory = OffloadedTensor(PrefixedDataset({"lm_head.weight": full}, "lm_head."), "weight", full.shape, full.dtype)
    assert torch.equal(in_memory.rows([(3, 6)])[0], full[3:6])


def test_sliced_calls_give_the_modules_own_values_and_restore_the_hook(tmp_path):
    """Gemma-3's scaled embedding (tied to the head) and its head, both on disk: the embedding reads
    only the rows of its ids (the padding row among them), the head its output in slices; both
    give the module's own output exactly, and accelerate's hook reads nothing meanwhile."""
    dense = tiny_model("gemma3")
    split = _all_on_disk(tiny_model("gemma3"), tmp_path / "offload")
    embed, head = split.model.embed_tokens, split.lm_head
    assert type(embed).__name__ == "Gemma3TextScaledWordEmbedding" and embed.padding_idx == 0
    ids = torch.tensor([[5, 3, 3, 100, 9], [7, 7, 1, 2, 127]])
    x = torch.randn(2, 3, dense.config.hidden_size, generator=torch.Generator().manual_seed(0))
    onloads = Counter()
    for name, m in (("embed", embed), ("head", head)):
        original = m._hf_hook.pre_forward
        m._hf_hook.pre_forward = lambda mod, *a, _o=original, _h=m._hf_hook, _n=name, **k: (
            onloads.update([_n] if _h.offload else []), _o(mod, *a, **k))[1]
    with sliced_calls(embed) as rows, sliced_calls(head, 10) as slices:
        assert torch.equal(embed(ids), dense.model.embed_tokens(ids))
        # a GEMM over slices of 10 vocabulary rows against one over all 128: the same products,
        # summed in an order the CPU's kernel picks by shape (bit for bit on some CPUs, not on all)
        torch.testing.assert_close(head(x), dense.lm_head(x), rtol=1e-6, atol=1e-7)
        assert head(x).shape == (2, 3, 128) and embed.weight.device.type == "meta"
    assert onloads == Counter()
    assert rows.bytes_read == 9 * 32 * 4  # the 8 distinct ids and the padding row, fp32 rows of 32
    assert slices.bytes_read == 2 * 128 * 32 * 4  # every row once per call, in 13 slices of up to 10
    assert embed._hf_hook.offload and head._hf_hook.offload and embed.padding_idx == 0
    assert torch.equal(embed(ids), dense.model.embed_tokens(ids)) and onloads == Counter({"embed": 1})
    with sliced_calls(dense.lm_head) as nothing:  # in memory: left alone
        assert nothing is None
    with pytest.raises(ValueError, match="slice_rows=0: must be >= 1"):
        with sliced_calls(head, 0):
            pass


def test_an_offloaded_head_and_embedding_are_never_read_whole(tmp_path):
    """Everything on disk: scoring reads the head in vocabulary slices (each slice once per head
    phase) and the embedding's rows of the batch's ids; accelerate's hook never onloads either.
    The values are the in-memory run's with the same slices, bit for bit."""
    calib = build_calibration(tiny_batch(batch=5, length=12))
    split = _all_on_disk(tiny_model("llama"), tmp_path / "offload")
    onloads = Counter()
    for name in ("model.embed_tokens", "lm_head"):
        hook = split.get_submodule(name)._hf_hook
        hook.pre_forward = lambda mod, *a, _o=hook.pre_forward, _h=hook, _n=name, **k: (
            onloads.update([_n] if _h.offload else []), _o(mod, *a, **k))[1]
    theirs = hl.score_layers(split, calib, progress=False, max_gap=2, batch_size=3)  # two batches
    assert onloads == Counter()
    meta = theirs.metadata
    assert meta["head_streaming"] == "vocabulary slices of 8 entries read from the offload (16 per head phase)"
    assert meta["kl_streaming"] == "vocabulary slices x position chunks, float64 online log-sum-exp (one pass)"
    head_bytes = 128 * 32 * 4
    # per batch one head phase (every probe in one group), plus the first batch's check: ours and the model's own
    assert meta["movement"]["head_bytes_moved"] == (2 + 2) * head_bytes
    # the embedding is called once per batch (on its ids up to the widest prompt, padding included) and reads
    # the rows of the distinct ids (this config has no padding index)
    assert split.model.embed_tokens.padding_idx is None
    widths = [int(calib.attention_mask[k:k + 3].sum(dim=1).max()) for k in (0, 3)]
    distinct = [len(calib.input_ids[k:k + 3, :w].unique()) for k, w in zip((0, 3), widths)]
    assert meta["movement"]["embedding_bytes_moved"] == sum(distinct) * 32 * 4 < 2 * 128 * 32 * 4
    sliced = hl.score_layers(tiny_model("llama"), calib, progress=False, max_gap=2, batch_size=3, vocab_chunk=8)
    assert _max_rel(sliced, theirs) == 0.0


def test_depth_first_on_an_offloaded_model_reads_each_block_at_every_call(tmp_path):
    """The same model scored probe after probe: the same values, one onload per block call
    (about 1.5 L^2 per batch for adjacent pairs' swap probes instead of L)."""
    calib = build_calibration(tiny_batch(batch=3, length=12))
    split = _disk_offloaded(tiny_model("llama", num_blocks=8), tmp_path / "offload")
    counts = _Counts(split)
    plans = swap_plans(8, 1, ("replacement", "interchange"))
    streamed, s_stats = plan_kl(split, calib, plans)
    n_streamed = sum(counts.onloads.values())
    counts.reset()
    depth, d_stats = plan_kl(split, calib, plans, slot_major=False)
    assert s_stats["slot_major"] is True and d_stats["slot_major"] is False
    assert n_streamed == s_stats["movement"]["block_onloads"] == 8
    assert sum(counts.onloads.values()) == d_stats["movement"]["block_onloads"] == d_stats["block_evaluations"]
    planned = plan_engine(split, calib, plans, EngineSettings(slot_major=False)).plan()
    assert planned.block_loads == d_stats["movement"]["block_onloads"] and not planned.slot_major
    assert plan_engine(split, calib, plans, EngineSettings()).plan().block_loads == n_streamed
    # identity, then per pair (i, i+1): replacement i<-i+1 and the interchange share block i+1
    # at slot i (8 - i calls and 7 - i more), replacement i+1<-i runs from slot i+1 (7 - i)
    assert d_stats["block_evaluations"] == s_stats["block_evaluations"] == 8 + sum(22 - 3 * i for i in range(7))
    for name in plans:
        assert torch.equal(streamed[name], depth[name])


def test_slot_major_in_memory_and_in_groups_gives_the_depth_first_values():
    """Forced on an in-memory model the streamed path gives the depth-first values bit
    for bit; with a budget that holds few states it splits the probes into groups, each
    one pass (blocks move once per group)."""
    model = tiny_model("llama", num_blocks=6, hidden_size=64)
    calib = build_calibration(tiny_batch(batch=4, length=16))
    plans = swap_plans(6, 2, ("replacement", "interchange")) | {"removal": [0, 2, 3, 5]}
    budget = 1 << 20
    whole = model.config.vocab_size  # the same head/KL blocks at both budgets (1 MiB would slice them)
    depth, d_stats = plan_kl(model, calib, plans, slot_major=False, max_memory=budget, vocab_chunk=whole)
    streamed, s_stats = plan_kl(model, calib, plans, slot_major=True, vocab_chunk=whole)
    grouped, g_stats = plan_kl(model, calib, plans, slot_major=True, max_memory=budget, vocab_chunk=whole)
    for name in plans:
        assert torch.equal(streamed[name], depth[name]) and torch.equal(grouped[name], depth[name])
    assert s_stats["movement"]["block_onloads"] == 0  # nothing offloaded, nothing moved
    assert s_stats["block_evaluations"] == d_stats["block_evaluations"]
    probes = list(make_probes(plans, 6)[1].values())
    shape = (4, 16, model.config.hidden_size)
    capacity = state_capacity(shape, torch.float32, budget)
    assert capacity == (budget // 4) // (4 * 16 * model.config.hidden_size * 4)  # (B, T, H) fp32 states
    groups = probe_groups(probes, shape, torch.float32, budget, 6)
    assert len(probes) == 28 and sum(len(g) for g in groups) == 28
    order = sorted(probes, key=lambda p: (p.start, p.run))
    assert [p for g in groups for p in g] == order  # consecutive runs of the (start, run) order
    passes = [plan_pass([p.key for p in g], 6, reference=n == 0) for n, g in enumerate(groups)]
    done = 0
    for n, (g, pp) in enumerate(zip(groups, passes)):
        assert pp.peak_states <= capacity  # each group fits
        done += len(g)
        if done < 28:  # and is the longest that does: one probe more holds too many states
            assert plan_pass([p.key for p in order[done - len(g):done + 1]], 6, reference=n == 0).peak_states > capacity
    # the old rule (two states per probe held, floor(capacity / 2) - 1 probes a group) cut 4 groups
    assert capacity == 16 and [len(g) for g in groups] == [13, 14, 1]
    assert len(groups) == 3 < math.ceil(28 / (capacity // 2 - 1)) == 4
    assert g_stats["block_evaluations"] == sum(p.block_evaluations for p in passes) > s_stats["block_evaluations"]
    assert g_stats["movement"]["block_onloads"] == 0


def test_pass_plan_holds_a_window_of_2g_plus_1_blocks_and_moves_each_once():
    L, g = 10, 2
    probes = make_probes(swap_plans(L, g, ("replacement", "interchange")), L)[1]
    plan = plan_pass(list(probes), L, reference=True, offloaded=frozenset(range(L)))
    assert plan.onloads == L and sorted(plan.first) == list(range(L))
    resident = [sum(1 for b in plan.first if plan.first[b] <= s <= plan.last[b]) for s in range(L)]
    assert max(resident) == 2 * g + 1 and resident[0] == g + 1
    assert {b: (plan.first[b], plan.last[b]) for b in (0, 5, 9)} == {0: (0, 2), 5: (3, 7), 9: (7, 9)}
    # identity (L) + per probe the blocks from its start on, shared prefixes once
    assert plan.finals[tuple(range(L))] == tuple(range(L))
    assert plan.block_evaluations == len({k[: s + 1] for k in [*probes, tuple(range(L))] for s in range(L)})


def test_onloaded_keeps_an_offloaded_block_resident_and_restores_the_hook(tmp_path):
    split = _disk_offloaded(tiny_model("llama"), tmp_path / "offload")
    block = decoder_blocks(split)[2][4]
    hooked = offloaded_modules(block)
    assert hooked
    size = offloaded_bytes(block)
    with onloaded(block) as nbytes:
        assert nbytes == size == sum(p.numel() * 4 for p in block.parameters())
        assert {p.device.type for p in block.parameters()} == {"cpu"}
        assert {m._hf_hook.offload for m in hooked} == {False}
    assert {p.device.type for p in block.parameters()} == {"meta"} and {m._hf_hook.offload for m in hooked} == {True}
    with onloaded(tiny_model("llama").model.layers[0]) as nbytes:
        assert nbytes == 0  # in memory: nothing moves


def test_progress_bar_shows_the_blocks_and_bytes_moved(tmp_path, capsys):
    split = _disk_offloaded(tiny_model("llama"), tmp_path / "offload")
    hl.score_layers(split, build_calibration(tiny_batch()), progress=True)
    assert "moved=6 blocks/" in capsys.readouterr().err


def test_slot_major_setting_is_checked():
    with pytest.raises(ValueError, match="slot_major='yes'"):
        EngineSettings(slot_major="yes")
    with pytest.raises(ValueError, match="slot_major=True: the model's logits are not streamed"):
        plan_kl(tiny_model("llama"), build_calibration(tiny_batch()), {"a": [1, 0, 2, 3, 4, 5]}, slot_major=True,
                stream_logits=False)
    assert set(peak_memory()) >= {"cpu"}


# ----------------------------------------------------------------------------- real models
def _real_offloaded(name: str, folder: Path):
    ckpt = bundled_checkpoint_dir(name)
    weights = (ckpt / "model.safetensors").stat().st_size
    dense, tok = load_model(ckpt, device_map=None)
    split, _ = load_model(ckpt, max_memory={"cpu": weights // 4}, offload_folder=str(folder))
    return dense, split, tok


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_with_a_quarter_of_its_weights_in_memory_streams_to_the_in_memory_values(name, tmp_path):
    """Both protocols' probes of three adjacent pairs (first, middle, last: a few probes keep
    the test short; the reference still streams every block), 4 prompts x 32 tokens. Pair KLs
    equal to the in-memory run's to float64 rounding (measured: SmolLM2 0, Gemma-3 5e-15
    relative)."""
    if not WIKITEXT_VALID.is_file():
        pytest.skip("WikiText-2 calibration text absent")
    dense, split, tok = _real_offloaded(name, tmp_path / "offload")
    calib = build_calibration(WIKITEXT_VALID, tok, num_prompts=4, seq_len=32)
    L = len(decoder_blocks(dense)[2])
    plans = {k: v for k, v in swap_plans(L, 1).items() if k[1] in (0, L // 2, L - 2)}
    assert len(plans) == 9
    counts = _Counts(split)
    head_onloads = Counter()  # accelerate's hook reading the whole embedding or head
    for module in (split.get_input_embeddings(), split.get_output_embeddings()):
        hook = module._hf_hook  # accelerate's, offloading or not
        hook.pre_forward = lambda mod, *a, _o=hook.pre_forward, _h=hook, **k: (
            head_onloads.update([type(mod).__name__] if _h.offload else []), _o(mod, *a, **k))[1]
    ours, o_stats = plan_kl(dense, calib, plans)
    theirs, t_stats = plan_kl(split, calib, plans)
    assert head_onloads == Counter()
    worst = max(float(((theirs[k] - ours[k]).abs() / ours[k].abs()).max()) for k in plans)
    head = split.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    if name == "gemma3-270m":
        # the tied embedding and head (62.5% of the weights) are on disk: the head is read in vocabulary slices
        # (at least 16; their width follows the budget, here what max_memory leaves after the weights), each once
        # per head phase (a flush of the held rows: as many as the engine's plan has) and twice more for the first
        # batch's check (ours and the model's own call); the embedding reads the rows of the batch's ids
        found = re.fullmatch(r"vocabulary slices of (\d+) entries read from the offload \((\d+) per head phase\)",
                             t_stats["head_streaming"])
        assert found, t_stats["head_streaming"]
        width, slices = int(found[1]), int(found[2])
        assert width <= 262144 // 16 and slices == math.ceil(262144 / width) >= 16
        flushes = sum(len(b.flush_groups) for b in plan_engine(split, calib, plans, EngineSettings()).plan().batches)
        assert flushes >= 1 and t_stats["movement"]["head_bytes_moved"] == (flushes + 2) * head_bytes
        ids = calib.input_ids[:, :int(calib.attention_mask.sum(dim=1).max())]
        pad = split.get_input_embeddings().padding_idx
        distinct = len(torch.cat([ids.flatten(), torch.tensor([pad])]).unique())  # the padding row among them
        assert t_stats["movement"]["embedding_bytes_moved"] == distinct * 640 * 4 < head_bytes / 1000
        # the in-memory run with the same slices, bit for bit; the in-memory default (the whole vocabulary as
        # one slice of the same float64 online KL) to float64 rounding
        same, _ = plan_kl(dense, calib, plans, vocab_chunk=width)
        assert all(torch.equal(theirs[k], same[k]) for k in plans)
        assert worst <= 1e-9
    else:  # SmolLM2 at a quarter: the embeddings and head on the map's "cpu" entry, held in memory
        assert t_stats["head_streaming"] == "in memory" and t_stats["movement"]["head_bytes_moved"] == 0
        assert worst <= 1e-9
    _, _, blocks = decoder_blocks(split)
    offloaded = {b for b in range(L) if offloaded_modules(blocks[b])}
    assert len(offloaded) >= L * 3 // 4 - 1  # about three quarters of the weights on disk
    assert t_stats["slot_major"] is True and o_stats["slot_major"] is False
    assert counts.onloads == Counter({b: 1 for b in offloaded})  # one batch: each offloaded block once
    assert t_stats["movement"]["block_onloads_per_batch"] == [len(offloaded)]
    assert t_stats["movement"]["bytes_moved"] == sum(offloaded_bytes(blocks[b]) for b in offloaded)


def test_a_tiny_budget_slices_the_head_and_kl_and_gives_the_large_budgets_kls():
    """The head/KL phase under a 1 MiB budget: vocabulary slices, and row blocks of the KL's
    float64 temporaries cut to budget / 16 instead of the CPU's fixed 2 MiB, both within the
    budget; the KLs are those of a 1 GiB budget (whole vocabulary, large row blocks) up to the
    fp32 GEMM's rounding of other shapes (the KL arithmetic itself: the next tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 8192, (4, 24))
    calib = hl.CalibrationSet(ids, torch.ones_like(ids), "random tokens")
    plans = swap_plans(4, 3, ("replacement", "interchange"))
    small, small_stats = plan_kl(model, calib, plans, max_memory="1MiB", batch_size=4)
    large, large_stats = plan_kl(model, calib, plans, max_memory="1GiB", batch_size=4)
    # row blocks of a sixteenth of what the budget leaves after a batch's activations (the slice
    # budget), not the CPU's fixed 2 MiB whatever the budget
    plan = plan_engine(model, calib, plans, EngineSettings(max_memory="1MiB", batch_size=4)).plan()
    assert plan.slice_bytes == (1 << 20) - plan.activation_bytes
    assert small_stats["kl_block_bytes"] == plan.slice_bytes // 16
    assert small_stats["kl_chunk_vocab"] < 8192 == large_stats["kl_chunk_vocab"]
    # the activations, the head/KL block and the float64 temporaries of one row block stay within the budget
    block = 12 * small_stats["kl_chunk_positions"] * small_stats["kl_chunk_vocab"]
    rows = max(1, small_stats["kl_block_bytes"] // (4 * small_stats["kl_chunk_vocab"]))
    assert plan.activation_bytes + block + 16 * rows * small_stats["kl_chunk_vocab"] <= 1 << 20
    for name in plans:
        assert torch.allclose(small[name], large[name], rtol=1e-4, atol=0.0), name
        assert float(large[name].min()) > 0


def test_streamed_kl_under_a_tiny_budget_gives_the_large_budgets_kls_to_1e_12():
    """:class:`StreamedKL` (the engine's head/KL phase) with 5-entry vocabulary slices,
    3-position chunks and 1-row blocks of its float64 temporaries gives the KLs of one
    whole-vocabulary block with 2 MiB row blocks, to 1e-12 relative. Head weights and hidden
    rows are multiples of 1/8 below 1, so every fp32 logit is exact whatever the GEMM's shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_layerswap.scoring.streamed import StreamedKL

    cfg = LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randint(-7, 8, (97, 16), generator=gen) / 8)
    ref = torch.randint(-7, 8, (20, 16), generator=gen) / 8
    probes = [ref + torch.randint(-1, 2, (20, 16), generator=gen) / 8 for _ in range(3)]
    prompt_of_row, counts = torch.arange(20) // 5, torch.full((4,), 5.0, dtype=torch.float64)

    def phase(kl_chunk, vocab_chunk, block_bytes):
        stats = {"head_rows": 0}
        kl = StreamedKL(Head(model), kl_chunk, vocab_chunk, None, "cpu", stats, block_bytes)
        with torch.no_grad():  # as the engine runs it
            return torch.stack(kl.head_phase(ref, probes, prompt_of_row, counts, 4))

    large, tiny = phase(1024, 97, 1 << 21), phase(3, 5, 4)
    assert float(large.min()) > 0
    assert torch.allclose(tiny, large, rtol=1e-12, atol=0.0)


def test_online_kl_in_one_row_blocks_and_narrow_slices_equals_the_whole_vocabulary():
    """:class:`OnlineKL` with 1-row blocks and 7-entry vocabulary slices gives the KLs of one
    whole-vocabulary slice with the default row blocks, to 1e-12 relative."""
    from hf_layerswap.scoring.kl import OnlineKL, chunk_bounds

    torch.manual_seed(0)
    ref, probes = torch.randn(50, 300) * 3, [torch.randn(50, 300) * 3 for _ in range(3)]

    def run(width, block_bytes):
        acc = OnlineKL(50, len(probes), "cpu", block_bytes)
        for v0, v1 in chunk_bounds(300, width):
            weights = acc.reference(0, 50, ref[:, v0:v1].clone())
            for n, p in enumerate(probes):
                acc.add(n, 0, 50, weights, p[:, v0:v1])
        return acc.result()

    whole, sliced = run(300, 1 << 21), run(7, 4)
    exact = (torch.log_softmax(ref.double(), -1).exp()
             * (torch.log_softmax(ref.double(), -1) - torch.stack([torch.log_softmax(p.double(), -1) for p in probes]))
             ).sum(-1)
    assert torch.allclose(sliced, whole, rtol=1e-12, atol=0.0)
    assert torch.allclose(whole, exact, rtol=1e-9, atol=0.0)


@pytest.mark.parametrize("budget", ["1MiB", "1GiB"])
def test_predicted_block_loads_equal_the_counted_ones_for_scoring_and_search(budget, tmp_path):
    """On a disk-offloaded model the cost estimate's block loads are the engine's own plan:
    equal to the onloads counted at accelerate's hooks and to the report's movement, for
    the scoring and for the search (budget 1: its single-removal call, exact). Under 1 MiB
    the probes run in several groups per batch and the search's kept reference holds one
    of the two batches."""
    calib = build_calibration(tiny_batch(batch=5, length=12))
    split = _disk_offloaded(tiny_model("llama", num_blocks=8, hidden_size=256), tmp_path / "offload")
    counts = _Counts(split)
    config = hl.LayerSwapConfig(num_to_remove=1, max_gap=2, batch_size=3, num_prompts=5, seq_len=12, progress=False)
    estimate = hl.estimate_cost(split, config, calibration=calib, max_memory=budget,
                                throughput=Throughput(1e9, 1e9, 1e9))
    report = hl.score_layers(split, calib, progress=False, max_gap=2, batch_size=3, max_memory=budget)
    scoring = sum(counts.onloads.values())
    counts.reset()
    chosen = hl.select_layers(report, 1, strategy="search", model=split, calibration=calib, batch_size=3,
                              max_memory=budget)
    search = sum(counts.onloads.values())
    plan = plan_engine(split, calib, swap_plans(8, 2, ("replacement", "interchange")),
                       EngineSettings(batch_size=3, max_memory=budget)).plan()
    groups = [len(b.probe_groups) for b in plan.batches]
    assert groups == ([8, 5] if budget == "1MiB" else [1, 1])
    assert plan.block_loads == 8 * sum(groups)  # every group streams every block (no kept reference)
    assert estimate.phases["scoring"]["block_loads"] == plan.block_loads == report.metadata["movement"]["block_onloads"]
    assert scoring == plan.block_loads
    assert estimate.phases["scoring"]["block_passes"] == plan.block_evaluations == report.metadata["block_evaluations"]
    assert len(chosen) == 1
    counted = report.selections[-1]["total_cost"]["block_loads"]
    assert estimate.phases["selection"]["block_loads"] == counted == search
    assert search == (18 if budget == "1MiB" else 16)
    block = offloaded_bytes(decoder_blocks(split)[2][0])
    assert estimate.phases["scoring"]["bytes_moved"] == block * plan.block_loads


def test_slot_major_passes_start_from_the_kept_reference(tmp_path):
    """The search's evaluator calls on an offloaded model: the first call streams the
    reference and keeps the streams entering every block; a later call runs no reference
    pass and moves only the blocks at or after each set's first removed one. The values are
    the uncached run's, bit for bit, and each call's plan predicts its loads exactly."""
    calib = build_calibration(tiny_batch(batch=5, length=12))
    split = _disk_offloaded(tiny_model("llama", num_blocks=8), tmp_path / "offload")
    plans = {i: removal_plan(8, [i]) for i in range(2, 7)}
    alone, alone_stats = plan_kl(split, calib, plans, batch_size=3)
    cache = ReferenceCache(1 << 30)
    stats = []
    for _ in range(2):
        predicted = plan_engine(split, calib, plans, EngineSettings(batch_size=3), cache).plan()
        values, st = plan_kl(split, calib, plans, batch_size=3, reference_cache=cache)
        assert predicted.block_loads == st["movement"]["block_onloads"]
        assert predicted.block_evaluations == st["block_evaluations"]
        assert predicted.reference_passes == st["reference_passes"]
        assert all(torch.equal(values[k], alone[k]) for k in plans)
        stats.append(st)
    first, second = stats
    assert alone_stats["movement"]["block_onloads"] == first["movement"]["block_onloads"] == 2 * 8
    assert first["reference_passes"] == 2 and second["reference_passes"] == 0
    assert second["movement"]["block_onloads_per_batch"] == [5, 5]  # blocks 3..7: set {2} runs from slot 2
    assert cache.hits == 2 and len(cache.entries) == 2


def test_block_prefetcher_reads_the_next_block_before_the_current_one_runs(tmp_path):
    """The prefetching onload, run with the CPU as its device (no stream: the same
    schedule, synchronous): each block's read of the next one is issued before the current
    block computes, every block is read once per pass, and the values are accelerate's
    own onload's."""
    calib = build_calibration(tiny_batch(batch=3, length=12))
    split = _disk_offloaded(tiny_model("llama", num_blocks=6), tmp_path / "offload")
    _, _, blocks = decoder_blocks(split)
    probes = make_probes(swap_plans(6, 1, ("replacement",)), 6)[1]
    plan = plan_pass(list(probes), 6, reference=True, offloaded=movable_blocks(blocks))
    inputs = capture_block_inputs(split, calib.input_ids, calib.attention_mask)
    results = []
    for prefetch in (False, True):
        finals, moved = {}, []
        loader = BlockPrefetcher(blocks, plan.onload_order) if prefetch else None
        handles = [blk.register_forward_pre_hook(lambda *_, b=b: loader.log.append(("run", b)) if loader else None)
                   for b, blk in enumerate(blocks)]
        with torch.no_grad():
            run_pass(plan, blocks, inputs, lambda k, s: finals.__setitem__(k, s.clone()), lambda b, n: moved.append(b),
                     loader=None if loader is None else loader.load)
        for h in handles:
            h.remove()
        results.append((finals, moved, loader))
    (plain, plain_moved, _), (fetched, fetched_moved, loader) = results
    assert loader.stream is None and loader.device == torch.device("cpu")
    assert plan.onload_order == list(range(6)) and plain_moved == fetched_moved == list(range(6))
    assert loader.reads == 6 and not loader.pending
    log = loader.log
    for b in range(5):  # block b+1 is read before block b first runs
        assert log.index(("read", b + 1)) < log.index(("run", b))
    assert log[:3] == [("read", 0), ("load", 0), ("read", 1)]
    assert all(torch.equal(plain[k], fetched[k]) for k in plain)
    assert {p.device.type for p in blocks[3].parameters()} == {"meta"}  # back on "meta" after the pass


def test_a_model_wholly_on_disk_is_estimated_as_streamed(tmp_path):
    """Every module on disk (one device in the map): the estimate counts its block loads and
    bytes moved as the run does, not 0 as for a model in memory."""
    calib = build_calibration(tiny_batch(batch=5, length=12))
    split = _all_on_disk(tiny_model("llama"), tmp_path / "offload")
    assert set(map(str, split.hf_device_map.values())) == {"disk"}
    config = hl.LayerSwapConfig(num_to_remove=1, batch_size=3, num_prompts=5, seq_len=12, progress=False)
    estimate = hl.estimate_cost(split, config, calibration=calib, throughput=Throughput(1e9, 1e9, 1e9))
    report = hl.score_layers(split, calib, progress=False, batch_size=3)
    L = report.num_blocks
    assert estimate.phases["scoring"]["block_loads"] == report.metadata["movement"]["block_onloads"] == 2 * L
    assert estimate.phases["scoring"]["bytes_moved"] == report.metadata["movement"]["bytes_moved"] > 0
