"""Bad input: every case gets a clear error naming the value and what is allowed, and
nothing is changed or written; the cases that are not errors (negative indices, a
tokenizer without a pad token, an already pruned checkpoint, non-finite KL) behave the
same everywhere."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from arch_matrix import NUM_BLOCKS, build, prompts, single_thread, tiny_tokenizer
from hf_layerswap import (
    LayerSwapConfig,
    NonFiniteScoresError,
    SwapReport,
    build_calibration,
    prune_loaded_model,
    remove_layers,
    score_layers,
    select_layers,
)
from hf_layerswap.plan import apply_plan, decoder_blocks, decoder_config, num_blocks
from hf_layerswap.report import PairResult
from hf_layerswap.scoring import masked_kl, removal_kl

TEXTS = [
    "Layer removal keeps the kept blocks in order.",
    "A swap probe runs the model under a plan.",
    "The cache is indexed by the layer index.",
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def llama():
    """A shared 6-block model; tests that change a model build their own."""
    return build("llama")


@pytest.fixture(scope="module")
def report(llama):
    return score_layers(llama, prompts(), batch_size=2, progress=False)


def _snapshot(model) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "config": copy.deepcopy(model.config.to_dict()),
        "blocks": list(decoder_blocks(model)[2]),
        "layer_idx": [m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)],
    }


def _assert_unchanged(model, snap: dict) -> None:
    assert model.config.to_dict() == snap["config"]
    assert list(decoder_blocks(model)[2]) == snap["blocks"]
    assert [m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)] == snap["layer_idx"]
    state = model.state_dict()
    assert state.keys() == snap["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in snap["state"].items())


# --------------------------------------------------------------------------- indices

BAD_INDICES = [
    ([6], "layer index 6 is out of range for a model with 6 blocks: allowed 0..5 (or -6..-1 from the end)"),
    ([0, 99], "layer index 99 is out of range"),
    ([-7], "layer index -7 is out of range"),
    ([1, 1], "duplicate layer indices [1] in [1, 1]"),
    ([1, -5], "duplicate layer indices [1] in [1, -5] (after resolving negative indices)"),
    ([], "no layer indices given"),
    (list(range(NUM_BLOCKS)), "would leave no block: at most 5 of 6 can go"),
    ([-6, -5, -4, -3, -2, -1], "would leave no block"),
]


@pytest.mark.parametrize(("layers", "message"), BAD_INDICES, ids=[str(x[0]) for x in BAD_INDICES])
def test_bad_removal_indices_are_refused_and_change_nothing(layers, message):
    model = build("llama")
    snap = _snapshot(model)
    with pytest.raises(ValueError) as err:
        remove_layers(model, layers)
    assert message in str(err.value)
    _assert_unchanged(model, snap)
    if layers:  # the load-time path gives the same error (an empty list is refused by the config itself)
        with pytest.raises(ValueError) as err2:
            prune_loaded_model(model, LayerSwapConfig(layers=layers))
        assert str(err2.value) == str(err.value)
        _assert_unchanged(model, snap)


@pytest.mark.parametrize("layers", [[6], [1, 1], list(range(NUM_BLOCKS))])
def test_removal_kl_refuses_the_same_indices(llama, layers):
    with pytest.raises(ValueError, match=r"out of range|duplicate|no block"):
        removal_kl(llama, prompts(), layers)


@pytest.mark.parametrize("layers", [[True], [1.0], ["1"], 2, "12"])
def test_non_integer_indices_are_type_errors(llama, layers):
    with pytest.raises(TypeError, match=r"int"):
        remove_layers(llama, layers)


def test_negative_indices_resolve_the_same_everywhere(llama, report):
    # removal: -2 is block 4, in remove_layers and in the load-time config alike
    by_negative, by_positive, by_config = build("llama"), build("llama"), build("llama")
    remove_layers(by_negative, [-2, 1])
    remove_layers(by_positive, [1, 4])
    prune_loaded_model(by_config, LayerSwapConfig(layers=[-2, 1]))
    for model in (by_negative, by_config):
        assert model.config.layerswap["removed_layers"] == [1, 4]
        assert model.config.layerswap["steps"][0]["removed_layers"] == [1, 4]
        assert model.config.layerswap["kept_layers"] == [0, 2, 3, 5]
        reference = by_positive.state_dict()
        assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    # removal KL
    batch = prompts()
    assert removal_kl(llama, batch, [-2, 1]) == removal_kl(llama, batch, [1, 4]) > 0
    # selection: protect=-1 is the last block, -2 the one before
    scores = report.layer_scores("interchange")
    spaced = dict(spacing=0)
    assert select_layers(report, 4, protect=(0, -1), **spaced) == select_layers(report, 4, protect=(0, 5), **spaced)
    assert select_layers(report, 4, protect=(0, -1), **spaced) == [1, 2, 3, 4]
    lowest = min(range(1, NUM_BLOCKS), key=lambda i: scores[i])
    negative = lowest - NUM_BLOCKS
    chosen = select_layers(report, 1, protect=(0, negative), **spaced)
    assert chosen == select_layers(report, 1, protect=(0, lowest), **spaced) and chosen != [lowest]
    with pytest.raises(ValueError, match=r"protect entry -7 is out of range: allowed ints in -6..5"):
        select_layers(report, 1, protect=(-7,))


def test_unmeetable_budgets_name_the_rule(llama, report):
    with pytest.raises(ValueError) as err:
        select_layers(report, 3, spacing=1, protect=(0, -1))
    assert "cannot select 3 layers of 6 with spacing=1 and protect=[0, 5]: the rules allow at most 2" in str(err.value)
    for n in (0, NUM_BLOCKS):
        with pytest.raises(ValueError, match=rf"num_to_remove={n}: allowed 1..5 for a model with 6 blocks"):
            select_layers(report, n)
    with pytest.raises(ValueError, match=r"spacing=-1: must be an int >= 0"):
        select_layers(report, 1, spacing=-1)
    # at load time: refused before scoring (no report is left), the model is left as it was
    model = build("llama")
    snap = _snapshot(model)
    cfg = LayerSwapConfig(num_to_remove=3, calibration=prompts(), progress=False, batch_size=2, spacing=1)
    with pytest.raises(ValueError, match="cannot select 3 layers of 6"):
        prune_loaded_model(model, cfg)
    assert not hasattr(model, "layerswap_report")
    _assert_unchanged(model, snap)


# --------------------------------------------------------------------------- calibration


def test_empty_calibration_sets_are_refused(llama, tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"empty calibration set: list of 0 strings"):
        build_calibration([], tok)
    with pytest.raises(ValueError, match=r"empty calibration set: input_ids has 0 rows"):
        score_layers(llama, {"input_ids": torch.zeros(0, 5, dtype=torch.long),
                             "attention_mask": torch.zeros(0, 5, dtype=torch.long)}, progress=False)
    short = tmp_path / "short.txt"
    short.write_text("too short\n\nalso short\n")  # no paragraph reaches 50 characters
    with pytest.raises(ValueError, match=r"empty calibration set: file:short.txt \(0 paragraphs"):
        score_layers(llama, short, tokenizer=tok, progress=False)


def test_prompts_shorter_than_two_real_tokens_are_refused(llama):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"calibration prompt 1 \('a'\) has 1 token\(s\): every prompt needs at least 2"):
        build_calibration([TEXTS[0], "a"], tok)
    ids = torch.ones(3, 5, dtype=torch.long)
    one = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"calibration prompt 1 is 1 real token: every prompt needs at least 2"):
        score_layers(llama, {"input_ids": ids, "attention_mask": one}, progress=False)
    none = one.clone()
    none[2] = 0
    none[1, 1] = 1
    with pytest.raises(ValueError, match=r"calibration prompt 2 is all padding"):
        build_calibration({"input_ids": ids, "attention_mask": none})
    with pytest.raises(ValueError, match=r"seq_len=1: must be an int >= 2"):
        build_calibration(TEXTS, tok, seq_len=1)


def test_tokenizer_without_pad_token_is_handled(llama):
    with_pad, without_pad = tiny_tokenizer(pad_token=True), tiny_tokenizer(pad_token=False)
    assert without_pad.pad_token_id is None
    a = build_calibration(TEXTS, with_pad)
    b = build_calibration(TEXTS, without_pad)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert bool((a.attention_mask == 0).any())  # prompts of different length: there is padding
    assert torch.equal(a.input_ids * a.attention_mask, b.input_ids * b.attention_mask)
    assert a.content_hash == b.content_hash
    ra = score_layers(llama, a, batch_size=3, progress=False)
    rb = score_layers(llama, b, batch_size=3, progress=False)
    for pa, pb in zip(ra.pairs, rb.pairs):
        for field in ("replacement_ij", "replacement_ji", "interchange"):
            assert getattr(pa, field) == pytest.approx(getattr(pb, field), rel=1e-6, abs=1e-12)


def test_mismatched_input_ids_and_attention_mask_shapes(llama):
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids shape \(2, 5\) and attention_mask shape \(2, 4\) must be equal"):
        score_layers(llama, {"input_ids": ids, "attention_mask": torch.ones(2, 4, dtype=torch.long)}, progress=False)
    with pytest.raises(ValueError, match=r"input_ids shape \(5,\) and attention_mask shape \(5,\)"):
        build_calibration({"input_ids": ids[0], "attention_mask": torch.ones(5, dtype=torch.long)})
    with pytest.raises(ValueError, match="missing \\['attention_mask'\\]"):
        build_calibration({"input_ids": ids})
    with pytest.raises(ValueError, match=r"shape mismatch: ref \(2, 5, 7\), logits \(2, 5, 7\), mask \(2, 4\)"):
        masked_kl(torch.zeros(2, 5, 7), torch.zeros(2, 5, 7), torch.ones(2, 4))


# --------------------------------------------------------------------------- models and reports


def test_report_from_a_model_of_another_depth_is_refused(report):
    other = build("llama", num_blocks=4)
    with pytest.raises(ValueError, match=r"computed on a model with 6 blocks but this model has 4"):
        select_layers(report, 1, model=other)


def test_a_report_of_another_model_of_the_same_depth_is_refused_wherever_it_is_applied(report, tmp_path, capsys):
    """Same block count, other weights: the report's fingerprint differs. Selecting for the
    model, pruning with --report and publishing with the report all refuse it."""
    from hf_layerswap import save_for_hub
    from hf_layerswap.cli import main
    from hf_layerswap.hub import PushRefusedError

    other = build("llama")  # 6 blocks, like the scored model; then other weights
    with torch.no_grad():
        decoder_blocks(other)[2][3].mlp.down_proj.weight.mul_(0.5)
    assert num_blocks(other) == report.num_blocks
    message = "the report belongs to a different model: its fingerprint is"
    with pytest.raises(ValueError, match=message):
        select_layers(report, 1, model=other)
    with pytest.raises(ValueError, match=message):
        select_layers(report, 1, model=other, strategy="search", calibration=prompts())
    ckpt, out = tmp_path / "other", tmp_path / "out"
    other.save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    report.to_json(tmp_path / "report.json")
    capsys.readouterr()
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(tmp_path / "report.json"),
                 "--calibration", str(tmp_path / "report.json"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert message in capsys.readouterr().err
    pruned = remove_layers(copy.deepcopy(other), [2])
    with pytest.raises(PushRefusedError, match="the report does not belong to this model"):
        save_for_hub(pruned, tmp_path / "pub", report=report)
    assert not (tmp_path / "pub").exists()


def test_cli_prune_refuses_bad_input_and_writes_nothing(report, tmp_path, capsys, monkeypatch):
    from hf_layerswap.cli import main

    ckpt = tmp_path / "four"
    build("llama", num_blocks=4).save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    report.to_json(tmp_path / "six.json")
    (tmp_path / "calib.txt").write_text("\n\n".join(t + " " + t for t in TEXTS))  # paragraphs >= 50 chars
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(tmp_path / "six.json"),
                 "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert "computed on a model with 6 blocks but this model has 4" in capsys.readouterr().err
    code = main(["prune", str(ckpt), str(out), "--layers", "4"])
    assert code == 2 and not out.exists()
    assert "layer index 4 is out of range for a model with 4 blocks" in capsys.readouterr().err
    # a budget the rules cannot meet is refused before any scoring is spent on it
    def no_scoring(*args, **kwargs):
        raise AssertionError("scored although the budget was impossible")

    monkeypatch.setattr("hf_layerswap.pipeline.score_layers", no_scoring)
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "2", "--spacing", "1", "--calibration", str(tmp_path / "calib.txt"),
                 "--num-prompts", "2", "--seq-len", "32"])  # within the model's 64 positions (checked by the estimate)
    assert code == 2 and not out.exists()
    assert "cannot select 2 layers of 4 with spacing=1 and protect=[0, 3]: the rules allow at most 1" in capsys.readouterr().err
    # no output and no temporary folder left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "four", "six.json"]


def test_check_budget_counts_what_the_rules_allow():
    from hf_layerswap.rule import check_budget

    assert check_budget(2, 6) == 2  # blocks 1..4 unprotected, no two adjacent: {1, 3} or {2, 4}
    with pytest.raises(ValueError, match=r"cannot select 3 layers of 6 with spacing=1 and protect=\[0, 5\]: the rules allow at most 2"):
        check_budget(3, 6)
    assert check_budget(4, 6, spacing=0) == 4
    assert check_budget(np.int64(5), 6, spacing=0, protect=[]) == 5
    with pytest.raises(ValueError, match=r"cannot select 3 layers of 6 with spacing=2 and protect=\[\]: the rules allow at most 2"):
        check_budget(3, 6, spacing=2, protect=[])  # {0, 3} is the most
    with pytest.raises(ValueError, match=r"num_to_remove=6: allowed 1..5"):
        check_budget(6, 6, spacing=0, protect=[])


def test_models_without_a_decoder_block_list_are_refused():
    from transformers import BertConfig, BertLMHeadModel

    bert = BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, is_decoder=True)).eval()
    for model in (bert, torch.nn.Linear(4, 4)):
        name = type(model).__name__
        for call in (lambda: remove_layers(model, [0]), lambda: num_blocks(model),
                     lambda: score_layers(model, prompts(), progress=False)):
            with pytest.raises(ValueError, match=rf"{name} has no decoder block list: expected an nn.ModuleList named"):
                call()


CONTRADICTORY = [
    (dict(num_to_remove=2, layers=[1, 2, 3]), "LayerSwapConfig(num_to_remove=2, layers=[1, 2, 3]) is contradictory"),
    (dict(layers=[]), "LayerSwapConfig(layers=[])"),
    (dict(layers=3), "LayerSwapConfig(layers=3): must be a list of 0-based block indices"),
    (dict(num_to_remove=0), "LayerSwapConfig(num_to_remove=0): must be an int >= 1"),
    (dict(protocol="swap"), "LayerSwapConfig(protocol='swap'): allowed ['replacement', 'interchange', 'auto']"),
    (dict(recovery="ghosted"), "LayerSwapConfig(recovery='ghosted') needs num_to_remove or layers"),
    (dict(recovery="magic", num_to_remove=1), "LayerSwapConfig(recovery='magic'): allowed"),
    (dict(spacing=-1), "LayerSwapConfig(spacing=-1): must be an int >= 0"),
    (dict(max_gap=0), "LayerSwapConfig(max_gap=0): must be an int >= 1"),
    (dict(seq_len=1), "LayerSwapConfig(seq_len=1): must be an int >= 2"),
    (dict(sparsity=1.5), "LayerSwapConfig(sparsity=1.5): must be a float in [0, 1)"),
    (dict(sparsity=0.96, allocation="pals"), "LayerSwapConfig(allocation='pals'): sparsity=0.96 with delta=0.05 lets a "
     "block reach sparsity 1 (every weight zero); use delta < 1 - sparsity = 0.04 (the default delta here; choose "
     "allocation='uniform' or 'owl'"),
]


@pytest.mark.parametrize(("kwargs", "message"), CONTRADICTORY, ids=[m.split(":")[0] for _, m in CONTRADICTORY])
def test_contradictory_or_out_of_range_config_fields(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(**kwargs)
    assert message in str(err.value)


def test_unknown_config_argument_is_named():
    with pytest.raises(TypeError, match=r"unexpected arguments: unknown keys \['num_to_remov'\] \('num_to_remov': did "
                                        r"you mean 'num_to_remove'\?\); allowed \['num_to_remove', "):
        LayerSwapConfig(num_to_remov=2)


# --------------------------------------------------------------------------- already pruned


def test_already_pruned_checkpoint_reloads_as_is_and_prunes_again_with_both_steps(tmp_path):
    from transformers import AutoModelForCausalLM

    base = build("qwen3")  # sliding/full layer_types: the per-layer list must follow both steps
    base.save_pretrained(tmp_path / "base")
    batch = prompts()
    once = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=LayerSwapConfig(layers=[1, 3]), attn_implementation="eager"
    ).eval()
    assert num_blocks(once) == 4 and once.config.layerswap["kept_layers"] == [0, 2, 4, 5]
    once.save_pretrained(tmp_path / "once")
    assert "quantization_config" not in (tmp_path / "once" / "config.json").read_text()

    # reload (library imported, no config passed): a no-op, the same model
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "once", attn_implementation="eager").eval()
    assert num_blocks(again) == 4 and len(again.config.layerswap["steps"]) == 1
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, once(**batch).logits)

    # pruning it again with an explicit config: indices refer to the pruned model's blocks
    twice = AutoModelForCausalLM.from_pretrained(
        tmp_path / "once", quantization_config=LayerSwapConfig(layers=[1]), attn_implementation="eager"
    ).eval()
    record = twice.config.layerswap
    assert num_blocks(twice) == 3
    assert record["original_num_hidden_layers"] == NUM_BLOCKS
    assert record["removed_layers"] == [1, 2, 3] and record["kept_layers"] == [0, 4, 5]
    assert [s["removed_layers"] for s in record["steps"]] == [[1, 3], [1]]
    assert [s["removed_original_layers"] for s in record["steps"]] == [[1, 3], [2]]
    assert [s["num_blocks_before"] for s in record["steps"]] == [6, 4]
    base_types = decoder_config(base).layer_types
    assert decoder_config(twice).layer_types == [base_types[i] for i in (0, 4, 5)]
    with torch.no_grad(), apply_plan(base, [0, 4, 5]):
        expected = base(**batch, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(twice(**batch, use_cache=False).logits, expected, rtol=0, atol=1e-6)
    # both steps survive save -> reload
    twice.save_pretrained(tmp_path / "twice")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "twice")
    assert reloaded.config.layerswap == record


# --------------------------------------------------------------------------- non-finite KL


def test_masked_kl_keeps_inf_and_nan():
    ref = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    mask = torch.ones(2, 3, dtype=torch.long)
    logits = ref.clone()
    logits[0, 1, 2] = -math.inf  # the modified model gives a token the reference allows probability 0
    logits[1, 0, :] = math.nan
    kl = masked_kl(ref, logits, mask)
    assert math.isinf(kl[0].item()) and kl[0] > 0 and math.isnan(kl[1].item())


class _InjectNonFinite:
    """Make chosen probes of a real model end in NaN or -inf logits (what fp16 overflow on
    a boundary pair looks like). The probe is recognised by the plan the scoring engine
    passes to ``apply_plan``; the decoder output of that probe is replaced (NaN) or
    marked so that the output head gives token 0 a log-probability of -inf."""

    MARK = 1e30

    def __init__(self, model, plans: dict[tuple[int, ...], str], monkeypatch):
        import contextlib

        import hf_layerswap.scoring.engine as scoring

        self.plans = plans
        self.current = None
        self.injected: set[tuple[int, ...]] = set()
        real_apply_plan = scoring.apply_plan

        @contextlib.contextmanager
        def recording_apply_plan(model_, plan, **kwargs):
            with real_apply_plan(model_, plan, **kwargs):
                self.current = tuple(plan)
                try:
                    yield
                finally:
                    self.current = None

        monkeypatch.setattr(scoring, "apply_plan", recording_apply_plan)
        owner, _, _ = decoder_blocks(model)
        self.handles = [
            owner.register_forward_hook(self._decoder_hook),
            model.get_output_embeddings().register_forward_hook(self._head_hook),
        ]

    def _decoder_hook(self, module, args, output):
        kind = self.plans.get(self.current)
        if kind is None:
            return output
        self.injected.add(self.current)
        hidden = output.last_hidden_state.clone()
        if kind == "nan":
            hidden[:] = math.nan
        else:
            hidden[..., 0] = self.MARK
        output.last_hidden_state = hidden
        return output

    def _head_hook(self, module, args, output):
        marked = args[0][..., 0] == self.MARK
        if not bool(marked.any()):
            return output
        output = output.clone()
        output[..., 0] = torch.where(marked, -math.inf, output[..., 0])
        return output

    def remove(self):
        for h in self.handles:
            h.remove()


def test_non_finite_kl_is_kept_sorts_last_is_never_selected_and_round_trips(tmp_path, monkeypatch):
    model = build("llama")
    plans = {
        (0, 1, 3, 2, 4, 5): "nan",  # interchange 2<->3
        (0, 1, 2, 4, 3, 5): "nan",  # interchange 3<->4
        (0, 1, 3, 3, 4, 5): "inf",  # replacement 2<-3
        (0, 1, 2, 4, 4, 5): "inf",  # replacement 3<-4
    }
    injected = _InjectNonFinite(model, plans, monkeypatch)
    try:
        report = score_layers(model, prompts(), batch_size=2, progress=False)
    finally:
        injected.remove()
    assert injected.injected == set(plans)
    p23, p34 = report.pair(2, 3), report.pair(3, 4)
    assert math.isnan(p23.interchange) and math.isnan(p34.interchange)
    assert math.isinf(p23.replacement_ij) and math.isinf(p34.replacement_ij)
    assert math.isfinite(p23.replacement_ji) and math.isinf(p23.replacement)  # max keeps the inf
    assert p23.ratio is None
    inter, repl = report.layer_scores("interchange"), report.layer_scores("replacement")
    assert math.isnan(inter[3]) and math.isinf(repl[3])
    assert all(math.isfinite(inter[i]) and math.isfinite(repl[i]) for i in (0, 1, 2, 4, 5))
    for protocol in ("interchange", "replacement"):
        assert report.ranking(protocol)[-1] == 3
        assert select_layers(report, 5, protocol=protocol, spacing=0, protect=()) == [0, 1, 2, 4, 5]
        shown = "NaN" if protocol == "interchange" else "inf"  # the pairs' values: the layer's both partners
        with pytest.raises(NonFiniteScoresError, match=(
                rf"^cannot select 5 block\(s\) on finite {protocol} swap-KL scores: non-finite values: "
                rf"pair \(2, 3\) {protocol} = {shown}; pair \(3, 4\) {protocol} = {shown}; the values first broke at "
                r"calibration batch 0 \(0-based\)\. non-finite values are reported, never a basis for removal: load the "
                r"model in float32")) as err:
            select_layers(report, 5, protocol=protocol, spacing=0, protect=(0,))
        assert err.value.first_batch == 0 and list(err.value.nonfinite) == [f"pair (2, 3) {protocol}", f"pair (3, 4) {protocol}"]
    # JSON round trip keeps NaN and inf as such
    path = report.to_json(tmp_path / "report.json")
    back = SwapReport.from_json(path)
    assert back == report
    assert math.isnan(back.pair(2, 3).interchange) and math.isinf(back.pair(3, 4).replacement_ij)
    assert '"NaN"' in path.read_text() and '"Infinity"' in path.read_text()
    assert math.isnan(back.layer_scores("interchange")[3])


def test_non_finite_scores_sort_after_inf_and_never_enter_a_selection():
    pairs = [
        PairResult(0, 1, replacement_ij=0.1, replacement_ji=0.2, interchange=0.05),
        PairResult(1, 2, replacement_ij=math.inf, replacement_ji=0.3, interchange=math.inf),
        PairResult(2, 3, replacement_ij=math.nan, replacement_ji=0.4, interchange=math.nan),
    ]
    report = SwapReport(4, pairs)
    assert report.layer_scores("interchange") == pytest.approx([0.05, 0.05, math.inf, math.nan], nan_ok=True)
    assert report.ranking("interchange") == [0, 1, 2, 3]
    assert select_layers(report, 2, spacing=0, protect=()) == [0, 1]
    with pytest.raises(NonFiniteScoresError, match=r"^cannot select 3 block\(s\) on finite interchange swap-KL "
                       r"scores: non-finite values: pair \(1, 2\) interchange = inf; pair \(2, 3\) interchange = NaN\. "):
        select_layers(report, 3, spacing=0, protect=())


# --------------------------------------------------------------------------- adversarial inputs


def test_token_ids_outside_the_embedding_are_named(llama):
    batch = prompts()
    ids = batch["input_ids"].clone()
    ids[1, 3] = 128  # one past the tiny vocabulary
    message = (
        "calibration input_ids hold token id 128, but the model's input embedding has 128 rows: allowed ids 0..127 "
        "(is the tokenizer the model's own? padding positions count too)"
    )
    for call in (lambda c: score_layers(llama, c, progress=False), lambda c: removal_kl(llama, c, [1])):
        with pytest.raises(ValueError) as err:
            call({"input_ids": ids, "attention_mask": batch["attention_mask"]})
        assert str(err.value) == message
    padded = batch["input_ids"].clone()
    padded[1, -1] = -100  # a collator's label padding at a masked position is still embedded
    with pytest.raises(ValueError, match=r"^calibration input_ids hold token id -100, "):
        score_layers(llama, {"input_ids": padded, "attention_mask": batch["attention_mask"]}, progress=False)


def test_calibration_type_errors_name_the_offending_part():
    tok = tiny_tokenizer()
    batch = prompts()
    with pytest.raises(TypeError) as err:
        build_calibration({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].float()})
    assert str(err.value) == "attention_mask must be torch.long, torch.int32 or torch.bool, got torch.float32"
    with pytest.raises(TypeError) as err:
        build_calibration({"input_ids": batch["input_ids"].int(), "attention_mask": batch["attention_mask"]})
    assert str(err.value) == "input_ids must be torch.long, got torch.int32"
    with pytest.raises(TypeError) as err:
        build_calibration([TEXTS[0], 7, TEXTS[1]], tok)
    assert str(err.value) == (
        "calibration list entry 1 is int (7): a list calibration holds strings, one prompt each "
        "(token ids go in a mapping with input_ids and attention_mask tensors)"
    )
    with pytest.raises(ValueError, match=r"^num_prompts=True: must be an int >= 1$"):
        build_calibration(TEXTS, tok, num_prompts=True)
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})})
    with pytest.raises(ValueError) as err:
        build_calibration(splits, tok)
    assert str(err.value) == (
        "calibration mapping (DatasetDict with keys ['train']) is missing ['attention_mask', 'input_ids']; "
        "it needs input_ids and attention_mask"
    )


def test_protocols_given_as_one_string_is_refused_by_name(llama):
    with pytest.raises(ValueError) as err:
        score_layers(llama, prompts(), protocols="interchange", progress=False)
    assert str(err.value) == (
        "protocols='interchange': give a list, e.g. ['interchange'], a non-empty subset of ['replacement', 'interchange']"
    )


def test_protect_as_a_bare_int_is_refused(report):
    # protect=0 used to mean "protect nothing" (0 is falsy); protect=5 raised "'int' object is not iterable"
    for protect in (0, 5, "0"):
        with pytest.raises(ValueError) as err:
            select_layers(report, 1, protect=protect)
        assert str(err.value) == f"protect={protect!r}: must be a list of 0-based block indices, e.g. [0, -1] (or [] for none)"
    with pytest.raises(ValueError, match=r"^protect entry 1.0 is not an int: allowed ints in -6..5$"):
        select_layers(report, 1, protect=[1.0])


def test_numpy_integers_are_indices_everywhere(llama, report):
    import json

    np = pytest.importorskip("numpy")
    n = np.int64
    assert select_layers(report, n(2), spacing=n(0), protect=[n(0), n(-1)]) == select_layers(report, 2, spacing=0)
    batch = prompts()
    assert removal_kl(llama, batch, [n(1), n(3)]) == removal_kl(llama, batch, [1, 3])
    assert removal_kl(llama, batch, [np.array([1, 3]), [2]]) == removal_kl(llama, batch, [[1, 3], [2]])
    model = build("llama")
    remove_layers(model, np.array([1, -2]))
    assert model.config.layerswap["removed_layers"] == [1, 4]
    assert all(type(i) is int for i in model.config.layerswap["steps"][0]["removed_layers"])
    json.dumps(model.config.to_dict())  # plain ints: config.json can hold them
    cfg = LayerSwapConfig(layers=np.array([1, 3]), protect=np.array([0, -1]))
    assert cfg.layers == [1, 3] and cfg.protect == [0, -1] and all(type(i) is int for i in cfg.layers + cfg.protect)
    # still refused: booleans, floats and tensors
    for bad in ([np.True_], [n(1), 2.0], [torch.tensor(1)]):
        with pytest.raises(TypeError, match=r"is not an int; layer indices are 0-based ints"):
            remove_layers(build("llama"), bad)


def test_a_generator_of_indices_is_reported_as_given():
    with pytest.raises(ValueError) as err:
        remove_layers(build("llama"), (i for i in (2, 2)))
    assert str(err.value) == "duplicate layer indices [2] in [2, 2] (after resolving negative indices)"


@pytest.mark.parametrize(
    ("provenance", "kind", "message"),
    [
        ("by hand", TypeError, "provenance must be a dict of JSON-able facts, got str"),
        ({"removed_layers": [4]}, ValueError,
         "provenance keys ['removed_layers'] are computed by remove_layers and cannot be given"),
        ({"note": {1, 2}}, TypeError,
         "provenance must be JSON-able (it is saved in config.json): Object of type set is not JSON serializable"),
    ],
    ids=["str", "reserved", "not-json"],
)
def test_bad_provenance_is_refused_before_the_model_changes(provenance, kind, message):
    model = build("llama")
    snap = _snapshot(model)
    with pytest.raises(kind) as err:
        remove_layers(model, [1], provenance=provenance)
    assert str(err.value) == message
    _assert_unchanged(model, snap)
    assert getattr(model.config, "layerswap", None) is None


SPARSITY_CONFLICTS = [
    (dict(pruner="bogus"), "LayerSwapConfig(pruner='bogus'): allowed ['wanda', 'sparsegpt', 'magnitude']"),
    (dict(allocation="even"), "LayerSwapConfig: allocation='even': allowed ['uniform', 'pals', 'owl', 'random', 'gradient']"),
    (dict(sparsity_pattern="2-4"), "LayerSwapConfig: pattern='2-4': allowed None (unstructured) or 'N:M' such as '2:4'"),
    (dict(sparsity_pattern="2:4"),  # the default allocation is pals
     "LayerSwapConfig: pattern='2:4' gives every block sparsity 0.5; use allocation='uniform' (got 'pals')"),
    (dict(sparsity_pattern="1:4", allocation="uniform"),
     "LayerSwapConfig: pattern='1:4' fixes the sparsity at 0.25, but sparsity=0.5"),
]


@pytest.mark.parametrize(("kwargs", "message"), SPARSITY_CONFLICTS, ids=[m.split(":")[1] if m.startswith("LayerSwapConfig:") else m.split("(")[1].split(")")[0] for _, m in SPARSITY_CONFLICTS])
def test_sparsity_settings_are_checked_with_the_config_not_after_removal(kwargs, message):
    # these used to pass the config and fail in sparsify, after the blocks were removed
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(layers=[1], sparsity=0.5, **kwargs)
    assert str(err.value) == message
    with pytest.warns(UserWarning, match=r"\['pruner'\] ignored: sparsity is None"):  # not used without sparsity
        assert LayerSwapConfig(layers=[1], pruner="bogus").sparsity is None


def test_tokenized_batch_encoding_needs_no_tokenizer_at_load_time():
    # a BatchEncoding is a Mapping but not a dict: the loader used to look for a tokenizer
    from transformers import BatchEncoding

    batch = prompts()
    by_dict, by_encoding = build("llama"), build("llama")
    prune_loaded_model(by_dict, LayerSwapConfig(num_to_remove=1, calibration=dict(batch), progress=False, batch_size=2))
    prune_loaded_model(by_encoding, LayerSwapConfig(num_to_remove=1, calibration=BatchEncoding(batch), progress=False,
                                                    batch_size=2))
    assert by_encoding.config.layerswap["removed_layers"] == by_dict.config.layerswap["removed_layers"]
    assert by_encoding.layerswap_report.pairs == by_dict.layerswap_report.pairs


def _edited_report(tmp_path, report, edit):
    import json

    data = report.to_dict()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_truncated_or_hand_edited_report_files_name_the_file(report, tmp_path):
    good = report.to_json(tmp_path / "good.json").read_text()
    cases = {
        "truncated": good[: good.index('": "', len(good) // 2) + 4],  # cut just inside a string value
        "empty": "",
        "a list": "[]",
    }
    expected = {
        "truncated": "is not a valid SwapReport JSON file: Unterminated string starting at",
        "empty": "is not a valid SwapReport JSON file: Expecting value: line 1 column 1 (char 0)",
        "a list": "is not a valid SwapReport JSON file: not a SwapReport dict: got list",
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            SwapReport.from_json(path)
        assert str(err.value).startswith(f"{path} {expected[name]}")
    edits = [
        (lambda d: d.pop("pairs"), "SwapReport dict is missing ['pairs']"),
        (lambda d: d["pairs"][0].update(interchange="nan"),
         "value 'nan' is not a number: allowed a JSON number, null, 'NaN', 'Infinity' or '-Infinity'"),
        (lambda d: d["pairs"].append(d["pairs"][0]), "pairs [(0, 1)] occur more than once: each pair (i, j) has one result"),
        (lambda d: d["pairs"][0].pop("i"),
         "TypeError: PairResult.__init__() missing 1 required positional argument: 'i'"),
    ]
    for edit, message in edits:
        path = _edited_report(tmp_path, report, edit)
        with pytest.raises(ValueError) as err:
            SwapReport.from_json(path)
        assert str(err.value) == f"{path} is not a valid SwapReport JSON file: {message}"


def test_cli_refuses_bad_report_files_and_a_folder_as_report_output(report, tmp_path, capsys):
    from hf_layerswap.cli import main

    ckpt = tmp_path / "six"
    build("llama").save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    (tmp_path / "calib.txt").write_text("\n\n".join(t + " " + t for t in TEXTS))
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(bad),
                 "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert f"error: {bad} is not a valid SwapReport JSON file: not a SwapReport dict: got list" in capsys.readouterr().err
    # push: the sidecar is read before anything else happens (no network: the endpoint is a closed port)
    code = main(["push", str(ckpt), "me/six", "--report", str(bad), "--endpoint", "http://127.0.0.1:9"])
    assert code == 2
    assert f"{bad} is not a valid SwapReport JSON file" in capsys.readouterr().err
    (tmp_path / "ev.json").write_text('{"base": ')
    code = main(["push", str(ckpt), "me/six", "--evaluation", str(tmp_path / "ev.json"), "--endpoint", "http://127.0.0.1:9"])
    assert code == 2
    assert f"error: {tmp_path / 'ev.json'} is not valid JSON: Expecting value" in capsys.readouterr().err
    # score -o FOLDER: refused before the model loads (it used to fail after scoring, with a traceback)
    folder = tmp_path / "reports"
    folder.mkdir()
    code = main(["score", str(ckpt), "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2", "-o", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "loading" not in err
    assert f"error: --output {folder} is a folder; give the report's file path, e.g. {folder / 'layerswap_report.json'}" in err
    assert list(folder.iterdir()) == []


def test_text_calibration_on_a_checkpoint_without_tokenizer_says_to_pass_one(tmp_path):
    from transformers import AutoModelForCausalLM

    build("llama").save_pretrained(tmp_path / "weights-only")
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path / "weights-only",
                                             quantization_config=LayerSwapConfig(num_to_remove=1, progress=False))
    message = str(err.value)
    assert message.startswith("text calibration needs a tokenizer and none could be loaded from the checkpoint "
                              "'weights-only' (it has no tokenizer files): ")
    assert "pass tokenizer= (LayerSwapConfig(tokenizer=...) or prune(..., tokenizer=...)" in message
    assert str(tmp_path) not in message
