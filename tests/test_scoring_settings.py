"""The scoring engine's settings record and the swap-protocol registry.

:class:`EngineSettings` is the one place the engine's settings are checked and
normalised; the verbs build it from their keyword arguments. The protocol registry decides
which probes a pair gets: an unknown name is refused with the registered ones listed, and a
protocol registered here (removal of the pair, or of each block alone) is scored by
``score_layers`` to exactly the joint removal KL of the same sets.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from arch_matrix import prompts
from conftest import tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.layerplan import interchange_plan, removal_plan, replacement_plan
from hf_layerswap.scoring.protocols import (
    SWAP_PROTOCOLS,
    check_protocols,
    get_protocol,
    probe_kinds,
    protocol_of,
    register_protocol,
    unregister_protocol,
)
from hf_layerswap.scoring.report import PairResult, SwapReport
from hf_layerswap.scoring import AdaptiveBudget, plan_kl, removal_kl, score_layers, swap_plans
from hf_layerswap.scoring import engine as scoring_engine
from hf_layerswap.scoring.engine import run_plans
from hf_layerswap.scoring.settings import DEFAULT_MAX_MEMORY, EngineSettings
from hf_layerswap.scoring.kl import chunk_bounds, kl_rows, OnlineKL, row_blocks
from hf_layerswap.scoring.settings import device_batch_size, device_memory_budget, kl_block_bytes
from hf_layerswap.scoring.settings import MemoryBudget, resolve_memory

BUILT_IN = "['replacement', 'interchange']"


# ---------------------------------------------------------------- settings
def test_settings_defaults_are_the_verbs_defaults():
    s = EngineSettings()
    assert (s.batch_size, s.prefix_reuse, s.stream_logits, s.kl_chunk, s.vocab_chunk) == (None, "shared", True, None, None)
    assert s.max_memory == "auto" and s.dtype is None and s.checkpoint_path is None
    assert s.distributed is None and s.progress is False and s.desc == "swap-KL"


def test_settings_normalise_their_values():
    assert EngineSettings(prefix_reuse=False).prefix_reuse == "none"
    assert EngineSettings(prefix_reuse="start").prefix_reuse == "start"
    assert EngineSettings(max_memory="2GiB").max_memory == 2 * 2**30
    assert EngineSettings(max_memory="1.5GB").max_memory == 1_500_000_000
    assert EngineSettings(dtype="bf16").dtype is torch.bfloat16
    assert EngineSettings(dtype="torch.float16").dtype is torch.float16
    assert EngineSettings(batch_size="auto").batch_size == "auto"
    # equal settings given two ways are one value
    assert EngineSettings(prefix_reuse=True, max_memory=None) == EngineSettings(prefix_reuse="shared", max_memory="auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineSettings().batch_size = 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch_size=0: must be an int >= 1 or 'auto'"),
        (dict(batch_size=True), "batch_size=True: must be an int >= 1 or 'auto'"),
        (dict(batch_size="max"), "batch_size='max': must be an int >= 1 or 'auto'"),
        (dict(kl_chunk=0), "kl_chunk=0: must be an int >= 1"),
        (dict(vocab_chunk=2.5), "vocab_chunk=2.5: must be an int >= 1"),
        (dict(max_memory="lots"), "max_memory='lots': give bytes (int), a string such as '1.5GB' or '800MiB', or 'auto'"),
        (dict(max_memory=1024), "max_memory=1024 is 1024 bytes: at least 1 MiB is needed"),
        (dict(prefix_reuse="yes"), "prefix_reuse='yes': allowed True/'shared'"),
        (dict(dtype="int8"), "dtype='int8': allowed None (the model's dtype), torch.bfloat16, torch.float16, torch.float32"),
        (dict(dtype=torch.int8), "dtype=torch.int8: allowed None"),
        (dict(distributed="yes"), "distributed='yes': allowed None (partition the probes when launched with several processes)"),
        (dict(checkpoint_path=3), "checkpoint_path=3: give a folder path (str or os.PathLike) or None"),
    ],
)
def test_settings_refuse_bad_values_by_name(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        EngineSettings(**kwargs)


def test_autocast_dtype_against_the_models_dtype():
    assert EngineSettings().autocast_dtype(torch.float32) is None
    assert EngineSettings(dtype="bf16").autocast_dtype(torch.float32) is torch.bfloat16
    assert EngineSettings(dtype=torch.bfloat16).autocast_dtype(torch.bfloat16) is None  # already the model's dtype
    with pytest.raises(ValueError, match=r"^dtype=float32 asked for a torch.bfloat16 model: autocast cannot raise"):
        EngineSettings(dtype="float32").autocast_dtype(torch.bfloat16)


def test_every_verb_checks_its_settings_in_the_one_place():
    model = tiny_model("llama", num_blocks=4)
    calib = hl.build_calibration(tiny_batch(), num_prompts=3)
    message = "^" + re.escape("batch_size=0: must be an int >= 1 or 'auto'") + "$"
    with pytest.raises(ValueError, match=message):
        plan_kl(model, calib, {"x": interchange_plan(4, 1, 2)}, batch_size=0)
    with pytest.raises(ValueError, match=message):
        score_layers(model, tiny_batch(), num_prompts=3, batch_size=0, progress=False)
    with pytest.raises(ValueError, match=message):
        removal_kl(model, tiny_batch(), [1], num_prompts=3, batch_size=0)


def test_run_plans_with_a_settings_object_equals_plan_kl():
    model = tiny_model("llama", num_blocks=4)
    calib = hl.build_calibration(tiny_batch(), num_prompts=3)
    plans = {"a": interchange_plan(4, 1, 2), "b": replacement_plan(4, 2, 1), "c": removal_plan(4, [3])}
    kw = dict(batch_size=2, prefix_reuse="start", max_memory="64MiB")
    values, stats = plan_kl(model, calib, plans, **kw)
    again, stats2 = run_plans(model, calib, plans, EngineSettings(**kw))
    assert all(torch.equal(values[k], again[k]) for k in plans)
    assert stats["batch_size"] == stats2["batch_size"] == 2 and stats2["prefix_reuse"] == "start"
    assert stats2["max_memory"] == 64 * 2**20 and stats2["block_evaluations"] == stats["block_evaluations"]


# ---------------------------------------------------------------- sized by the device
GiB = 2**30


def _available(monkeypatch, nbytes):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=nbytes))


def test_budget_from_the_cpus_available_memory(monkeypatch):
    _available(monkeypatch, 20 * GiB)  # 25 % is 5 GiB: the 1 GiB cap
    assert device_memory_budget("cpu") == (
        GiB, "auto: 25% of 20 GiB free on cpu, cap 1 GiB, rounded down to a power of two: 1 GiB")
    _available(monkeypatch, 3 * GiB)  # 0.75 GiB -> 512 MiB
    assert device_memory_budget("cpu")[0] == GiB // 2
    _available(monkeypatch, 100 * 2**20)  # 25 MiB -> the 64 MiB floor
    assert device_memory_budget("cpu")[0] == 64 * 2**20
    assert device_batch_size("cpu") == 8 and device_batch_size("cuda:0") == "auto"


def test_budget_from_an_accelerators_free_memory(monkeypatch):
    free = {"free": 100 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["free"], 141 * GiB))
    assert device_memory_budget("cuda:0") == (
        8 * GiB, "auto: 50% of 100 GiB free on cuda:0, cap 8 GiB, rounded down to a power of two: 8 GiB")
    free["free"] = 5 * GiB  # 2.5 GiB -> 2 GiB
    assert device_memory_budget(torch.device("cuda", 1))[0] == 2 * GiB

    def unreadable(device=None):
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "mem_get_info", unreadable)
    assert device_memory_budget("cuda:0") == (
        DEFAULT_MAX_MEMORY, "auto: the free memory of cuda:0 could not be read; 1 GiB")


def test_budget_of_a_model_split_over_two_gpus_is_the_least_of_what_each_has_left(monkeypatch):
    """A model split over two GPUs by a device map: the "auto" budget is read from both
    (each holds the working memory of a pass in turn), not from the first only, and a
    load's max_memory bounds each by what it leaves after the weights held there. The two
    GPUs are simulated: accelerate's hooks name them and mem_get_info answers for each."""
    from accelerate.hooks import AlignDevicesHook

    from hf_layerswap.utils.devices import model_devices

    free = {0: 40 * GiB, 1: 6 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[torch.device(device).index], 80 * GiB))
    model = tiny_model("llama", num_blocks=4)
    for module, gpu in ((model.model.embed_tokens, 0), (model.model.layers[0], 0), (model.model.layers[3], 1),
                        (model.model.norm, 1), (model.lm_head, 1)):
        module._hf_hook = AlignDevicesHook(execution_device=gpu)  # the hook's word only: nothing moved
    assert model_devices(model) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    # cuda:0 alone would give 8 GiB (half of 40 GiB, capped); cuda:1 has 6 GiB left: 3 GiB -> 2 GiB
    assert resolve_memory("auto", model) == MemoryBudget(2 * GiB, (
        "auto: 50% of 6 GiB free on cuda:1, cap 8 GiB, rounded down to a power of two: 2 GiB "
        "(the least of 8 GiB on cuda:0, 2 GiB on cuda:1)"))
    assert resolve_memory("3GiB", model) == MemoryBudget(3 * GiB, "given")  # a given budget stays as given
    # loaded under max_memory={0: "3GiB", 1: "20GiB"}: cuda:0 may take 3 GiB (no weights held there in
    # this simulation): 1.5 GiB -> 1 GiB, below cuda:1's 2 GiB
    model.layerswap_max_memory = {0: "3GiB", 1: "20GiB"}
    budget = resolve_memory(None, model)
    assert budget.bytes == GiB
    assert budget.source.startswith("auto: 50% of 3 GiB left on cuda:0 by max_memory (3 GiB less 0 GiB of weights)")


def test_cpu_budget_is_what_max_memory_leaves_after_the_weights(tmp_path, monkeypatch):
    """A model loaded under max_memory={"cpu": ...}: the working memory on the CPU is what
    that limit leaves after the weights, not a share of the machine's available memory."""
    from conftest import tiny_checkpoint

    from hf_layerswap.models import load_model

    _available(monkeypatch, 64 * GiB)  # 25% of it would be the 1 GiB cap
    tiny_checkpoint(tmp_path / "base", tiny_model("llama", num_blocks=4))
    probe, _ = load_model(tmp_path / "base")
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*probe.parameters(), *probe.buffers())}.values())
    model, _ = load_model(tmp_path / "base", max_memory={"cpu": weights + GiB})
    assert model.layerswap_max_memory == {"cpu": weights + GiB}
    report = score_layers(model, tiny_batch(batch=4, length=12), num_prompts=4, progress=False)
    # 1 GiB left after the weights: 25% of it, 256 MiB
    assert report.metadata["max_memory"] == GiB // 4
    assert report.metadata["max_memory_source"].startswith("auto: 25% of 1 GiB left on cpu by max_memory (")
    assert score_layers(probe, tiny_batch(batch=4, length=12), num_prompts=4, progress=False).metadata["max_memory"] == GiB


def test_device_sized_defaults_keep_the_cpu_results_and_are_recorded(monkeypatch):
    _available(monkeypatch, 16 * GiB)
    model = tiny_model("llama", num_blocks=5)
    batch = tiny_batch(batch=10, length=16)
    fixed = score_layers(model, batch, num_prompts=10, progress=False, max_memory=GiB, batch_size=8)
    auto = score_layers(model, batch, num_prompts=10, progress=False)
    assert [p.to_dict() for p in auto.pairs] == [p.to_dict() for p in fixed.pairs]  # bit for bit
    meta = auto.metadata
    assert (meta["max_memory"], meta["batch_size"], meta["kl_block_bytes"], meta["device"]) == (GiB, 8, 2**21, "cpu")
    assert meta["max_memory_source"] == "auto: 25% of 16 GiB free on cpu, cap 1 GiB, rounded down to a power of two: 1 GiB"
    assert fixed.metadata["max_memory_source"] == "given"
    # a budget derived from 3 GiB available: half the budget, the same values
    _available(monkeypatch, 3 * GiB)
    smaller = score_layers(model, batch, num_prompts=10, progress=False)
    assert smaller.metadata["max_memory"] == GiB // 2
    assert [p.to_dict() for p in smaller.pairs] == [p.to_dict() for p in fixed.pairs]


def test_accelerator_sized_kl_row_blocks_give_the_same_values(monkeypatch):
    # on an accelerator the KL runs on large row blocks (max_memory / 16): per-row values do
    # not depend on the block, so whole-vocabulary and sliced KLs equal the cache-sized ones
    model = tiny_model("llama", num_blocks=4)
    calib = hl.build_calibration(tiny_batch(batch=6, length=16), num_prompts=6)
    plans = swap_plans(4, 2)
    for vocab_chunk in (None, 40):
        small, stats = plan_kl(model, calib, plans, vocab_chunk=vocab_chunk)
        assert stats["kl_block_bytes"] == 2**21
        monkeypatch.setattr(scoring_engine, "kl_block_bytes", lambda device, budget: GiB)
        large, stats = plan_kl(model, calib, plans, vocab_chunk=vocab_chunk)
        monkeypatch.undo()
        assert stats["kl_block_bytes"] == GiB
        assert all(torch.equal(small[k], large[k]) for k in plans)
    ref = torch.log_softmax(torch.randn(300, 5000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    logits = torch.randn(300, 5000, generator=torch.Generator().manual_seed(1)) * 3
    blocks = row_blocks(300, 5000)  # 104 rows of 5000 fp32 per 2 MiB
    assert blocks[:2] == [(0, 104), (104, 208)] and row_blocks(300, 5000, GiB) == [(0, 300)]
    assert torch.equal(torch.cat([kl_rows(ref[a:b], logits[a:b]) for a, b in blocks]), kl_rows(ref, logits))


def test_online_kl_over_vocabulary_slices_equals_the_float64_kl():
    """One pass over slices (the reference's running maximum rising from slice to slice, rows in
    two position blocks, row blocks of 64 bytes) gives KL(p || q) of the whole vocabulary computed
    in float64 at once, to float64 rounding; with equal logits exactly 0. The whole vocabulary as
    one slice (what the engine does when it fits) is the same arithmetic: equal to float64 rounding."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 1000, generator=gen) * 4 + torch.linspace(0, 12, 1000)  # maxima in the last slices
    probes = [ref + 0.3 * torch.randn(7, 1000, generator=gen), ref.clone(), torch.randn(7, 1000, generator=gen)]
    lp = torch.log_softmax(ref.double(), -1)
    truth = torch.stack([(lp.exp() * (lp - torch.log_softmax(q.double(), -1))).sum(-1) for q in probes])
    results = []
    for width, block_bytes in ((128, 64), (1000, 64), (1000, 1 << 21)):
        acc = OnlineKL(7, len(probes), "cpu", block_bytes=block_bytes)
        for v0, v1 in chunk_bounds(1000, width):
            for a, b in ((0, 4), (4, 7)):
                weights = acc.reference(a, b, ref[a:b, v0:v1])
                for n, q in enumerate(probes):
                    acc.add(n, a, b, weights, q[a:b, v0:v1])
        got = acc.result()
        assert got.shape == (3, 7) and got.dtype == torch.float64
        assert torch.allclose(got[[0, 2]], truth[[0, 2]], rtol=1e-12, atol=0)
        assert bool((truth[0] > 1e-3).all()) and float(got[1].abs().max()) < 1e-13
        results.append(got)
    assert torch.allclose(results[0], results[1], rtol=2e-12, atol=0)  # both within 1e-12 of the truth
    assert torch.equal(results[1], results[2])  # row blocks do not change a row's sums


def test_kl_block_bytes_by_device_kind():
    assert kl_block_bytes("cpu", 8 * GiB) == 2**21
    assert kl_block_bytes(torch.device("cuda", 0), 8 * GiB) == GiB // 2
    # never above budget / 16: the float64 temporaries of a row block (4 x its fp32 bytes) stay within the budget
    assert kl_block_bytes("cuda:0", 16 * 2**20) == 2**20
    assert kl_block_bytes("cpu", 16 * 2**20) == 2**20 and kl_block_bytes("cpu", 32 * 2**20) == 2**21


# ---------------------------------------------------------------- protocol registry
def test_built_in_protocols_and_their_probes():
    assert list(SWAP_PROTOCOLS) == ["replacement", "interchange"]
    assert probe_kinds() == ("replacement_ij", "replacement_ji", "interchange")
    assert protocol_of("replacement_ji") == "replacement" and protocol_of("interchange") == "interchange"
    assert protocol_of("skip") is None
    assert get_protocol("replacement").pair_plans(4, 1, 2) == {
        "replacement_ij": [0, 2, 2, 3],
        "replacement_ji": [0, 1, 1, 3],
    }
    # per pair, protocols in registration order whatever order they were asked in
    assert list(swap_plans(3, 1, ("interchange", "replacement"))) == [
        ("replacement_ij", 0, 1), ("replacement_ji", 0, 1), ("interchange", 0, 1),
        ("replacement_ij", 1, 2), ("replacement_ji", 1, 2), ("interchange", 1, 2),
    ]


def test_unknown_protocols_are_refused_with_the_registered_ones():
    model = tiny_model("llama", num_blocks=4)
    with pytest.raises(ValueError, match=re.escape(f"protocols=('skip',): allowed a non-empty subset of {BUILT_IN}")):
        score_layers(model, tiny_batch(), num_prompts=3, protocols=["skip"], progress=False)
    with pytest.raises(ValueError, match=re.escape(f"protocols=(): allowed a non-empty subset of {BUILT_IN}")):
        check_protocols([])
    with pytest.raises(ValueError, match=re.escape(f"protocols=('interchange', 'swap'): allowed a non-empty subset of {BUILT_IN}")):
        swap_plans(4, 1, ["interchange", "swap", "interchange"])
    with pytest.raises(ValueError, match=re.escape(f"protocol='skip': allowed {BUILT_IN}")):
        get_protocol("skip")
    with pytest.raises(ValueError, match=re.escape(f"AdaptiveBudget protocol='skip': allowed {BUILT_IN}")):
        AdaptiveBudget(1, protocol="skip")
    with pytest.raises(ValueError, match=re.escape(f"protocol 'skip' is not one of {BUILT_IN}")):
        SwapReport(4, [], protocols=("skip",))
    pair = PairResult(0, 1, interchange=0.5)
    with pytest.raises(ValueError, match=re.escape(f"protocol='skip': allowed {BUILT_IN[:-1]}, 'replacement_ij', 'replacement_ji']")):
        pair.value("skip")


@pytest.mark.parametrize(
    "name, probes, message",
    [
        ("interchange", None, "protocol name or probe 'interchange' is already registered"),
        ("mine", ("replacement_ij",), "protocol name or probe 'replacement_ij' is already registered"),
        ("Skip", None, "protocol name or probe 'Skip': must match [a-z][a-z0-9_]*"),
        ("skip_se", None, "protocol name or probe 'skip_se': must match"),
        ("mine", ("i",), "protocol name or probe 'i': must match"),
        ("mine", (), "protocol 'mine': probes=[] must be distinct and at least one"),
        ("mine", ("a", "a"), "protocol 'mine': probes=['a', 'a'] must be distinct"),
    ],
)
def test_register_refuses_clashing_or_malformed_names(name, probes, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        register_protocol(name, probes=probes)
    assert list(SWAP_PROTOCOLS) == ["replacement", "interchange"]


def test_built_ins_cannot_be_unregistered():
    with pytest.raises(ValueError, match="^protocol 'interchange' is built in and cannot be unregistered$"):
        unregister_protocol("interchange")
    with pytest.raises(ValueError, match=re.escape(f"protocol='skip': allowed {BUILT_IN}")):
        unregister_protocol("skip")


@pytest.fixture
def skip_protocols():
    """Two protocols built from the removal plan: the pair removed together (one probe)
    and each block removed alone (two probes: the pair's value is the larger)."""

    @register_protocol("skip_both")
    def skip_both(num_blocks, i, j):
        return {"skip_both": removal_plan(num_blocks, [i, j])}

    @register_protocol("skip_each", probes=("skip_i", "skip_j"))
    def skip_each(num_blocks, i, j):
        return {"skip_i": removal_plan(num_blocks, [i]), "skip_j": removal_plan(num_blocks, [j])}

    try:
        yield
    finally:
        unregister_protocol("skip_both")
        unregister_protocol("skip_each")
    assert list(SWAP_PROTOCOLS) == ["replacement", "interchange"]


def test_a_registered_protocol_is_scored_as_the_removal_kl_of_its_sets(skip_protocols):
    model = tiny_model("llama", num_blocks=5)
    batch = tiny_batch()
    report = score_layers(model, batch, num_prompts=3, protocols=["skip_both", "skip_each"], max_gap=2, progress=False)
    assert report.protocols == ("skip_both", "skip_each") and len(report.pairs) == 4 + 3
    pairs = [(p.i, p.j) for p in report.pairs]
    both = removal_kl(model, batch, [[i, j] for i, j in pairs], num_prompts=3)
    alone = removal_kl(model, batch, [[k] for k in range(5)], num_prompts=3)
    assert all(x > 0 for x in both + alone)
    for p, expected in zip(report.pairs, both):
        assert p.value("skip_both") == expected  # the same plan through the same engine: bit for bit
        assert p.value("skip_each") == max(alone[p.i], alone[p.j])
        assert (p.value("skip_i"), p.value("skip_j")) == (alone[p.i], alone[p.j])
        assert p.interchange is None and p.replacement is None and p.extra["skip_both_se"] > 0
    # s(k) = min over the pairs holding k; with both neighbours' single removals the larger counts
    scores = report.layer_scores("skip_both")
    assert scores[0] == min(both[pairs.index((0, 1))], both[pairs.index((0, 2))])
    assert scores[4] == min(both[pairs.index((3, 4))], both[pairs.index((2, 4))])
    assert report.layer_scores("skip_each")[1] == min(max(alone[1], alone[k]) for k in (0, 2, 3))
    # flat JSON fields, like the built-ins', and an exact round trip while registered
    row = report.to_dict()["pairs"][0]
    assert row["skip_both"] == both[0] and row["skip_i"] == alone[0] and row["interchange"] is None
    assert SwapReport.from_json(report.to_json()) == report
    assert report.summary_dict()["skip_both_layer_scores"] == scores
    with pytest.raises(ValueError, match=re.escape("protocol 'interchange' was not scored in this report")):
        report.layer_scores("interchange")


def test_a_registered_protocol_leaves_the_built_in_values_unchanged(skip_protocols):
    model = tiny_model("llama", num_blocks=4)
    alone = score_layers(model, tiny_batch(), num_prompts=3, protocols=["interchange"], progress=False)
    mixed = score_layers(model, tiny_batch(), num_prompts=3, protocols=["interchange", "skip_both"], progress=False)
    assert [p.interchange for p in mixed.pairs] == [p.interchange for p in alone.pairs]
    assert [p.interchange_se for p in mixed.pairs] == [p.interchange_se for p in alone.pairs]
    assert mixed.layer_scores("interchange") == alone.layer_scores("interchange")
    assert all(math.isfinite(p.value("skip_both")) for p in mixed.pairs)


def test_a_protocol_must_return_the_probes_it_declares():
    @register_protocol("broken")
    def broken(num_blocks, i, j):
        return {"other": removal_plan(num_blocks, [i])}

    try:
        with pytest.raises(ValueError, match=re.escape("protocol 'broken' returned plans for ['other']; it declares probes ['broken']")):
            swap_plans(4, 1, ["broken"])
    finally:
        unregister_protocol("broken")
    with pytest.raises(ValueError, match=re.escape(f"allowed a non-empty subset of {BUILT_IN}")):
        swap_plans(4, 1, ["broken"])


def test_a_registered_protocol_is_selectable_everywhere(skip_protocols):
    """select_layers, LayerSwapConfig and the command line accept a registered protocol,
    and the greedy rule on it picks from its own scores."""
    from hf_layerswap.cli import build_parser
    from hf_layerswap.config import LayerSwapConfig
    from hf_layerswap.scoring.rule import greedy_select
    from hf_layerswap.selection import select_layers

    model = tiny_model("llama", num_blocks=6)
    report = score_layers(model, tiny_batch(), num_prompts=3, protocols=["skip_both"], progress=False)
    chosen = select_layers(report, 2, protocol="skip_both")
    assert chosen == greedy_select(report.layer_scores("skip_both"), 2, spacing=1, protect=(0, -1))
    assert LayerSwapConfig(num_to_remove=2, protocol="skip_both", strategy="greedy").protocol == "skip_both"
    args = build_parser().parse_args(["prune", "m", "out", "--num-to-remove", "2", "--strategy", "greedy",
                                      "--protocol", "skip_both"])
    assert args.protocol == "skip_both"
    assert build_parser().parse_args(["score", "m", "--protocols", "skip_both"]).protocols == ["skip_both"]
    with pytest.raises(ValueError, match=re.escape("protocol='nope': allowed ['replacement', 'interchange', "
                                                   "'skip_both', 'skip_each', 'auto']")):
        select_layers(report, 2, protocol="nope")


# ---------------------------------------------- protocols given as one string


def test_protocols_given_as_one_string_is_refused_by_name(matrix_llama):
    with pytest.raises(ValueError) as err:
        score_layers(matrix_llama, prompts(), protocols="interchange", progress=False)
    assert str(err.value) == (
        "protocols='interchange': give a list, e.g. ['interchange'], a non-empty subset of ['replacement', 'interchange']"
    )
