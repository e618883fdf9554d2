"""One contract for every registered method (PEFT's ``PeftCommonTester`` pattern).

Parametrised over every strategy, swap protocol, set objective, recovery method, healing
method, allocator and pruner the package registers (read from the registries, so a new
built-in is covered without editing this file): each runs end to end on a tiny random Llama
through ``AutoModelForCausalLM.from_pretrained(..., quantization_config=LayerSwapConfig(...))``
(3 prompts of 16 tokens), its config round-trips (``to_dict``/``from_dict``, and the
record ``save_pretrained`` writes that ``from_pretrained`` reads back), the saved
checkpoint reloads to the same logits without pruning again, and the method appears in
the rendered model card. Each entry's estimate (``estimate_cost``) is checked against the
block and head passes forward hooks count in the real prune of a tiny 8-block Llama: equal
where the estimate says it is exact, at most it where it says it is an upper bound.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from conftest import counted_prune, tiny_batch, tiny_model
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig
from hf_layerswap.card import render_card
from hf_layerswap.cost import Throughput
from hf_layerswap.healing.methods import HEAL_METHODS
from hf_layerswap.layerplan import removal_plan
from hf_layerswap.plots import write_plots
from hf_layerswap.scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS, protocol_label, register_protocol, unregister_protocol
from hf_layerswap.scoring.rule import greedy_select
from hf_layerswap.recovery import RECOVERY_METHODS
from hf_layerswap.selection import STRATEGIES
from hf_layerswap.selection.registry import STRATEGY_ENTRIES
from hf_layerswap.selection.objectives import OBJECTIVES, objective_entry
from hf_layerswap.sparsity import ALLOCATORS, PRUNERS

PACKAGE = "hf_layerswap."


def _built_in(registry: dict, code) -> list[str]:
    """The names registered by the package itself (a test's own registrations are not built-ins)."""
    return [name for name, entry in registry.items() if code(entry).__module__.startswith(PACKAGE)]


STRATEGY_NAMES = _built_in(STRATEGIES, lambda fn: fn)
PROTOCOL_NAMES = _built_in(SWAP_PROTOCOLS, lambda entry: entry.plans)
RECOVERY_NAMES = _built_in(RECOVERY_METHODS, type)
ALLOCATOR_NAMES = _built_in(ALLOCATORS, lambda entry: entry.allocate)
PRUNER_NAMES = _built_in(PRUNERS, lambda entry: entry.prune)
HEAL_NAMES = _built_in(HEAL_METHODS, lambda cls: cls)
OBJECTIVE_NAMES = [name for name in OBJECTIVES if objective_entry(name).score.__module__.startswith(PACKAGE)
                   and (name not in RECOVERY_METHODS or name in RECOVERY_NAMES)]

#: The estimate's model: a tiny 8-block Llama, 7 prompts of 16 tokens (one padded), batches of 4.
ESTIMATE_MODEL = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2)
FIXED = Throughput(1e9, 2e9, 1e9, source="fixed for the test")


def _heal_config(method: str) -> hl.HealConfig:
    """A healing the estimate counts exactly: 3 steps of 2 prompts x 16 tokens, a rate given (no
    probe), evaluations every 4 steps (the early stop cannot fire)."""
    return hl.HealConfig(method=method, max_tokens=96, seq_len=16, batch_size=2, eval_every=4, heldout_prompts=2,
                         learning_rate=1e-3)


def _estimate_matches_the_count(fields: dict, exact: bool | None):
    """``estimate_cost`` of ``LayerSwapConfig(**fields)`` against the passes hooks count in the
    real prune: equal when the estimate says exact, else at most it; ``exact``: what the
    estimate must say, the entry's ``estimate_exact`` (``None``: the estimate says which)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (7, 16))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    calib = {"input_ids": ids, "attention_mask": mask}
    config = LayerSwapConfig(**fields, batch_size=4, progress=False)
    estimate = hl.estimate_cost(copy.deepcopy(ESTIMATE_MODEL), config, calibration=calib, throughput=FIXED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks, heads = counted_prune(ESTIMATE_MODEL, config, calib)
    if exact is not None:
        assert estimate.exact == exact, estimate.lines()
    if estimate.exact:
        assert (estimate.block_passes, estimate.head_passes) == (blocks, heads)
    else:
        assert blocks <= estimate.block_passes and heads <= estimate.head_passes
    return estimate


def _strategy_config(name: str) -> dict:
    protocol = "auto" if name == "auto" else "interchange"  # auto is the greedy rule's choice between protocols
    return dict(num_to_remove=1, strategy=name, protocol=protocol)


def _run(tmp_path, fields: dict):
    """Prune through from_pretrained, save, reload; returns (config, model, reloaded, card front matter, card text)."""
    tiny_model("llama").save_pretrained(tmp_path / "base")
    batch = tiny_batch(length=16)
    cfg = LayerSwapConfig(**fields, calibration=batch, progress=False, batch_size=2)
    with warnings.catch_warnings():  # 3 prompts are fewer than asked for, and fewer tokens than the hidden size
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)
    model.save_pretrained(tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)
    assert reloaded.config.num_hidden_layers == model.config.num_hidden_layers  # not pruned twice
    card = render_card(model, report=getattr(model, "layerswap_report", None),
                       sparsity_report=getattr(model, "layerswap_sparsity_report", None), plots=[])
    text = str(card)
    return cfg, model, ModelCard(text).data.to_dict()["layerswap"], text


def _config_round_trips(cfg: LayerSwapConfig, tmp_path) -> None:
    assert LayerSwapConfig.from_dict(cfg.to_dict()) == cfg
    assert LayerSwapConfig.from_dict(json.loads(cfg.to_json_string())) == cfg
    saved = json.loads((tmp_path / "pruned" / "config.json").read_text())["layerswap"]["steps"][-1]["config"]
    assert saved == cfg.to_dict()
    again = AutoConfig.from_pretrained(tmp_path / "pruned").layerswap["steps"][-1]["config"]
    assert LayerSwapConfig.from_dict(again) == cfg


def test_every_registry_is_covered():
    from hf_layerswap.utils.registry import Registry

    assert {"greedy", "auto", "search"} <= set(STRATEGY_NAMES)
    assert set(PROTOCOL_NAMES) >= {"replacement", "interchange"} and "ghosted" in RECOVERY_NAMES
    assert ALLOCATOR_NAMES and PRUNER_NAMES
    assert set(HEAL_NAMES) == {"lora", "adjacent", "last_k"} and set(OBJECTIVE_NAMES) == {"removal_kl", "nll", "ghosted"}
    covered = {"selection strategy", "swap protocol", "set objective", "recovery method", "healing method",
               "allocator", "pruning method"}
    assert covered == set(Registry.ALL)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, _strategy_config(name))
    _config_round_trips(cfg, tmp_path)
    record = model.config.layerswap
    assert len(record["removed_layers"]) == 1 and model.config.num_hidden_layers == 5
    step = record["steps"][-1]
    assert step["strategy"] == name and step["removed_layers"] == record["removed_layers"]
    assert front["strategy"] == name and front["removed_layers"] == record["removed_layers"]
    _estimate_matches_the_count(_strategy_config(name), STRATEGY_ENTRIES[name].estimate_exact)


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_protocol_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(num_to_remove=1, strategy="greedy", protocol=name))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_report.protocols == (name,) or list(model.layerswap_report.protocols) == [name]
    assert front["protocol"] == name
    assert f"| {protocol_label(name)} s(i) |" in text  # its column of the layer-score table
    assert SWAP_PROTOCOLS[name].estimate_exact
    _estimate_matches_the_count(dict(num_to_remove=1, strategy="greedy", protocol=name), True)


@pytest.mark.parametrize("name", RECOVERY_NAMES)
def test_recovery_method_contract(name, tmp_path):
    method = RECOVERY_METHODS[name]
    repair = dict(recovery=name) if method.fits else {}  # plain removal is the config's recovery=None
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], **repair))
    _config_round_trips(cfg, tmp_path)
    assert model.config.layerswap["removed_layers"] == [2]
    if method.fits:
        assert model.config.layerswap["recovery"]["method"] == name and front["recovery"] == name
        assert method.card_row(model.config.layerswap["recovery"], lambda b: ", ".join(map(str, b)) or "none") in text
    else:
        assert "recovery" not in front and "recovery" not in model.config.layerswap
    _estimate_matches_the_count(dict(layers=[3, 5], **repair), method.estimate_exact)


@pytest.mark.parametrize("name", ALLOCATOR_NAMES)
def test_allocator_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], sparsity=0.5, allocation=name, pruner="magnitude"))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_sparsity_report.allocation == name and front["sparsity"]["allocation"] == name
    assert ALLOCATORS[name].label.replace("|", "\\|") in text  # a table cell
    assert 0.3 < front["sparsity"]["achieved_sparsity"] < 0.7
    _estimate_matches_the_count(dict(layers=[2], sparsity=0.5, allocation=name, pruner="magnitude"),
                                ALLOCATORS[name].estimate_exact)


@pytest.mark.parametrize("name", PRUNER_NAMES)
def test_pruner_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], sparsity=0.5, allocation="uniform", pruner=name))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_sparsity_report.method == name and front["sparsity"]["method"] == name
    assert PRUNERS[name].label.replace("|", "\\|") in text  # a table cell
    assert front["sparsity"]["achieved_sparsity"] == pytest.approx(0.5, abs=0.02)
    _estimate_matches_the_count(dict(layers=[2], sparsity=0.5, allocation="uniform", pruner=name),
                                PRUNERS[name].estimate_exact)


@pytest.mark.parametrize("name", HEAL_NAMES)
def test_heal_method_contract(name, tmp_path):
    healing = hl.HealConfig(method=name, max_tokens=32, seq_len=16, batch_size=2, heldout_prompts=1,
                            learning_rate=1e-3)
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], heal=healing))
    _config_round_trips(cfg, tmp_path)
    record = model.config.layerswap
    assert record["removed_layers"] == [2] and record["healing"][-1]["method"] == name
    assert HEAL_METHODS[name].describe in text  # the card's Method row, in the entry's words
    _estimate_matches_the_count(dict(layers=[3, 5], heal=_heal_config(name)), HEAL_METHODS[name].estimate_exact)


@pytest.mark.parametrize("name", OBJECTIVE_NAMES)
def test_objective_contract(name, tmp_path):
    repair = dict(recovery=name) if name in RECOVERY_METHODS else {}
    fields = dict(num_to_remove=1, strategy="search", objective=name, **repair)
    cfg, model, front, text = _run(tmp_path, fields)
    _config_round_trips(cfg, tmp_path)
    decision = model.config.layerswap["steps"][-1]["decision"]
    assert decision["objective"] == name and len(model.config.layerswap["removed_layers"]) == 1
    _estimate_matches_the_count(dict(fields, num_to_remove=2), objective_entry(name).estimate_exact)


@pytest.mark.parametrize("strategy", ["greedy", "search"])
def test_a_registered_protocol_is_scored_selected_and_drawn(strategy, tmp_path):
    """A protocol added with one decorator: the pipeline scores it next to the paper's two for
    every strategy, the greedy rule selects on it, and the card and plots name it by its label."""

    @register_protocol("skip_both_for_test", label="skip-both (test)")
    def skip_both(num_blocks, i, j):
        return {"skip_both_for_test": removal_plan(num_blocks, [i, j])}

    try:
        cfg, model, front, text = _run(tmp_path, dict(num_to_remove=1, strategy=strategy, protocol="skip_both_for_test"))
        report = model.layerswap_report
        assert "skip_both_for_test" in report.protocols
        assert "| skip-both (test) s(i) |" in text
        if strategy == "greedy":
            assert list(report.protocols) == ["skip_both_for_test"] and front["protocol"] == "skip_both_for_test"
            assert model.config.layerswap["removed_layers"] == greedy_select(
                report.layer_scores("skip_both_for_test"), 1, spacing=1, protect=(0, -1))
        else:
            assert set(PROTOCOLS) < set(report.protocols)
        written = write_plots(report, tmp_path / "plots", removed=model.config.layerswap["removed_layers"])
        assert written["layer_scores"].stat().st_size > 0
    finally:
        unregister_protocol("skip_both_for_test")
