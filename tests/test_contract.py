"""One contract for every registered method (PEFT's ``PeftCommonTester`` pattern).

Parametrised over every strategy, swap protocol, recovery method, allocator and pruner
the package registers (read from the registries, so a new built-in is covered without
editing this file): each runs end to end on a tiny random Llama through
``AutoModelForCausalLM.from_pretrained(..., quantization_config=LayerSwapConfig(...))``
(3 prompts of 16 tokens), its config round-trips (``to_dict``/``from_dict``, and the
record ``save_pretrained`` writes that ``from_pretrained`` reads back), the saved
checkpoint reloads to the same logits without pruning again, and the method appears in
the rendered model card.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import tiny_batch, tiny_model
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoModelForCausalLM

from hf_layerswap import LayerSwapConfig
from hf_layerswap.card import render_card
from hf_layerswap.layerplan import removal_plan
from hf_layerswap.plots import write_plots
from hf_layerswap.scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS, protocol_label, register_protocol, unregister_protocol
from hf_layerswap.scoring.rule import greedy_select
from hf_layerswap.recovery import RECOVERY_METHODS
from hf_layerswap.selection import STRATEGIES
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
    assert {"greedy", "auto", "search"} <= set(STRATEGY_NAMES)
    assert set(PROTOCOL_NAMES) >= {"replacement", "interchange"} and "ghosted" in RECOVERY_NAMES
    assert ALLOCATOR_NAMES and PRUNER_NAMES


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, _strategy_config(name))
    _config_round_trips(cfg, tmp_path)
    record = model.config.layerswap
    assert len(record["removed_layers"]) == 1 and model.config.num_hidden_layers == 5
    step = record["steps"][-1]
    assert step["strategy"] == name and step["removed_layers"] == record["removed_layers"]
    assert front["strategy"] == name and front["removed_layers"] == record["removed_layers"]


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_protocol_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(num_to_remove=1, strategy="greedy", protocol=name))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_report.protocols == (name,) or list(model.layerswap_report.protocols) == [name]
    assert front["protocol"] == name
    assert f"| {protocol_label(name)} s(i) |" in text  # its column of the layer-score table


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


@pytest.mark.parametrize("name", ALLOCATOR_NAMES)
def test_allocator_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], sparsity=0.5, allocation=name, pruner="magnitude"))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_sparsity_report.allocation == name and front["sparsity"]["allocation"] == name
    assert ALLOCATORS[name].label.replace("|", "\\|") in text  # a table cell
    assert 0.3 < front["sparsity"]["achieved_sparsity"] < 0.7


@pytest.mark.parametrize("name", PRUNER_NAMES)
def test_pruner_contract(name, tmp_path):
    cfg, model, front, text = _run(tmp_path, dict(layers=[2], sparsity=0.5, allocation="uniform", pruner=name))
    _config_round_trips(cfg, tmp_path)
    assert model.layerswap_sparsity_report.method == name and front["sparsity"]["method"] == name
    assert PRUNERS[name].label.replace("|", "\\|") in text  # a table cell
    assert front["sparsity"]["achieved_sparsity"] == pytest.approx(0.5, abs=0.02)


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
