"""LayerSwapConfig: round trips (dict, JSON string, JSON file, a pruned checkpoint's
config.json), typed choices, sub-configs, tolerance of newer keys, and one clear error per
invalid value."""

from __future__ import annotations

import copy
import json
import warnings
from typing import get_args

import pytest
import torch
from conftest import tiny_batch, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.quantizers.auto import AutoQuantizationConfig

from hf_layerswap import LayerSwapConfig
from hf_layerswap.integration import (
    CONFIG_VERSION,
    AllocationName,
    ObjectiveName,
    ProtocolName,
    PrunerName,
    RecoveryConfig,
    RecoveryMethod,
    SparsityConfig,
)

CONFIGS = {
    "default": {},
    "scored": dict(num_layers=2, protocol="replacement", strategy="greedy", spacing=2, protect=[0, 5], max_gap=2),
    "search": dict(num_layers=3, objective="nll", max_evaluations=40, num_prompts=16, seq_len=64, batch_size=4, seed=7),
    "explicit": dict(layers=[1, -2], protect=[0]),
    "auto": dict(num_layers=1, protocol="auto", strategy="auto"),
    "recovery": dict(num_layers=2, recovery="fused", recovery_num_tokens=4096, recovery_epsilon=0.5),
    "sparsity": dict(layers=[2], sparsity=0.5, allocation="uniform", method="sparsegpt", sparsity_pattern="2:4"),
    "calibration file": dict(num_layers=1, calibration="/data/corpus/valid.txt"),
}


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config(request):
    return LayerSwapConfig(**CONFIGS[request.param])


def test_to_dict_is_json_able_in_field_order(config):
    d = config.to_dict()
    assert list(d) == list(LayerSwapConfig.FIELDS)
    assert d["quant_method"] == "layerswap" and d["version"] == CONFIG_VERSION
    assert json.loads(json.dumps(d)) == d


def test_from_dict_round_trip(config):
    again = LayerSwapConfig.from_dict(config.to_dict())
    assert again == config and again.to_dict() == config.to_dict()
    assert LayerSwapConfig.from_dict(again.to_dict()).to_dict() == config.to_dict()


def test_to_json_string_round_trip(config):
    text = config.to_json_string()
    assert text.endswith("\n") and json.loads(text) == config.to_dict()
    assert LayerSwapConfig.from_dict(json.loads(text)) == config


def test_to_json_file_round_trip(config, tmp_path):
    path = tmp_path / "layerswap_config.json"
    config.to_json_file(path)
    assert LayerSwapConfig.from_json_file(path) == config


def test_transformers_reads_it_back_through_its_registry(config):
    again = AutoQuantizationConfig.from_dict(config.to_dict())
    assert isinstance(again, LayerSwapConfig) and again == config


def test_runtime_fields_are_never_serialized():
    cfg = LayerSwapConfig(num_layers=1, calibration={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                          tokenizer=object(), progress=False)
    d = cfg.to_dict()
    assert "tokenizer" not in d and "progress" not in d and d["calibration"] is None
    assert LayerSwapConfig(calibration="/home/alice/corpus/valid.txt").to_dict()["calibration"] == "valid.txt"
    assert "_protect_given" not in d
    assert cfg == LayerSwapConfig(num_layers=1)  # equality is over what gets serialized


def test_save_pretrained_and_reload_re_read_the_same_config(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    cfg = LayerSwapConfig(num_layers=2, strategy="greedy", spacing=2, calibration=tiny_batch(), progress=False,
                          batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)
    model.save_pretrained(tmp_path / "pruned")
    saved = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert "quantization_config" not in saved
    recorded = saved["layerswap"]["steps"][0]["config"]
    assert recorded == cfg.to_dict() and LayerSwapConfig.from_dict(recorded) == cfg
    reloaded = AutoConfig.from_pretrained(tmp_path / "pruned").layerswap["steps"][0]["config"]
    assert LayerSwapConfig.from_dict(reloaded) == cfg
    # the recorded config reproduces the cut on the base checkpoint
    replay = LayerSwapConfig(**{**reloaded, "calibration": tiny_batch(), "progress": False})
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=replay)
    assert again.config.layerswap["removed_layers"] == model.config.layerswap["removed_layers"]


def test_unknown_keys_of_a_newer_version_warn_and_are_dropped():
    newer = {**LayerSwapConfig(num_layers=2).to_dict(), "version": CONFIG_VERSION + 1, "draft_model": "x/y"}
    with pytest.warns(UserWarning) as record:
        cfg = LayerSwapConfig.from_dict(newer)
    message = str(record[0].message)
    assert message == (f"LayerSwapConfig.from_dict: ignoring unknown keys ['draft_model']; format version "
                       f"{CONFIG_VERSION + 1} read as version {CONFIG_VERSION} (written by a newer hf_layerswap?)")
    assert cfg == LayerSwapConfig(num_layers=2)
    with pytest.warns(UserWarning, match=r"ignoring unknown keys \['future'\] \(written by a newer"):
        AutoQuantizationConfig.from_dict({"quant_method": "layerswap", "future": 1})
    with warnings.catch_warnings():  # a config of this version reads silently
        warnings.simplefilter("error")
        LayerSwapConfig.from_dict(LayerSwapConfig(num_layers=2).to_dict())


def test_older_records_without_the_new_fields_still_read():
    old = {"quant_method": "layerswap", "num_layers": 2, "layers": None, "protocol": "interchange", "max_gap": 1,
           "spacing": 0, "protect": [0, -1], "calibration": None, "num_prompts": 64, "seq_len": 128, "batch_size": 8,
           "seed": 0, "recovery": None, "sparsity": None, "allocation": "pals", "method": "wanda",
           "sparsity_pattern": None, "progress": True, "strategy": "search", "objective": None, "max_evaluations": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LayerSwapConfig.from_dict(old) == LayerSwapConfig(num_layers=2)
    marker = {"quant_method": "layerswap", "recovery": "ghosted", "layers": [1, 3]}  # a ghosted checkpoint's marker
    assert LayerSwapConfig.from_dict(marker).recovery_config == RecoveryConfig("ghosted")


def test_unknown_constructor_argument_is_a_typo_not_a_newer_key():
    with pytest.raises(TypeError, match=r"unexpected arguments \['num_layer'\]"):
        LayerSwapConfig(num_layer=2)


def test_sparsity_names_are_checked_against_the_registries():
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS

    with pytest.raises(ValueError) as err:
        LayerSwapConfig(layers=[1], sparsity=0.5, allocation="even")
    assert all(repr(name) in str(err.value) for name in ALLOCATORS)
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(layers=[1], sparsity=0.5, method="bogus")
    assert all(repr(name) in str(err.value) for name in PRUNERS)


def test_choices_are_the_librarys_own():
    from hf_layerswap.report import PROTOCOLS
    from hf_layerswap.search import OBJECTIVES
    from hf_layerswap.sparsity.allocators import ALLOCATIONS
    from hf_layerswap.sparsity.pruners import METHODS

    assert get_args(ProtocolName) == PROTOCOLS + ("auto",)
    assert get_args(ObjectiveName) == OBJECTIVES
    assert get_args(AllocationName) == ALLOCATIONS
    assert get_args(PrunerName) == METHODS
    assert get_args(RecoveryMethod) == ("ghosted", "fused")


def test_sub_configs_accept_a_dataclass_a_dict_or_the_flat_form():
    flat = LayerSwapConfig(num_layers=2, recovery="fused", recovery_epsilon=0.25)
    assert LayerSwapConfig(num_layers=2, recovery=RecoveryConfig("fused", epsilon=0.25)) == flat
    assert LayerSwapConfig(num_layers=2, recovery={"method": "fused", "epsilon": 0.25}) == flat
    assert flat.recovery == "fused" and flat.recovery_config == RecoveryConfig("fused", None, 0.25)
    assert LayerSwapConfig(num_layers=2).recovery_config is None

    flat = LayerSwapConfig(layers=[1], sparsity=0.5, allocation="owl", method="magnitude")
    assert LayerSwapConfig(layers=[1], sparsity=SparsityConfig(0.5, "owl", "magnitude")) == flat
    assert LayerSwapConfig(layers=[1], sparsity={"sparsity": 0.5, "allocation": "owl", "method": "magnitude"}) == flat
    assert flat.sparsity == 0.5 and flat.sparsity_config == SparsityConfig(0.5, "owl", "magnitude", None)
    assert LayerSwapConfig(layers=[1]).sparsity_config is None


def test_validate_checks_a_field_changed_after_construction():
    cfg = LayerSwapConfig(num_layers=2)
    cfg.protocol = "both"
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(protocol='both'\): allowed"):
        cfg.validate()


def test_a_config_is_not_changed_by_pruning_with_it(tmp_path):
    base = tiny_model("llama")
    cfg = LayerSwapConfig(num_layers=1, strategy="greedy", calibration=tiny_batch(), progress=False, batch_size=2)
    before = copy.deepcopy(cfg.to_dict())
    from hf_layerswap import prune_loaded_model

    prune_loaded_model(base, cfg)
    assert cfg.to_dict() == before


INVALID = [
    (dict(num_layers=0), "LayerSwapConfig(num_layers=0): must be an int >= 1"),
    (dict(num_layers=1.5), "LayerSwapConfig(num_layers=1.5): must be an int >= 1"),
    (dict(layers="1,2"), "LayerSwapConfig(layers='1,2'): must be a list of 0-based block indices (ints)"),
    (dict(layers=[1, "x"]), "LayerSwapConfig(layers=[1, 'x']): entries ['x'] are not ints; indices are 0-based ints"),
    (dict(layers=[]), "LayerSwapConfig(layers=[]): give at least one block index, or use num_layers"),
    (dict(layers=[1, 1]), "duplicate layer indices [1] in [1, 1] (after resolving negative indices)"),
    (dict(layers=[1], num_layers=2), "LayerSwapConfig(num_layers=2, layers=[1]) is contradictory: layers names 1 blocks"),
    (dict(layers=[0], protect=[0]), "LayerSwapConfig(layers=[0], protect=[0]) is contradictory: block(s) [0] would be "
                                    "removed and protected; drop them from layers or from protect"),
    (dict(protocol="both"), "LayerSwapConfig(protocol='both'): allowed ['replacement', 'interchange', 'auto']"),
    (dict(max_gap=0), "LayerSwapConfig(max_gap=0): must be an int >= 1"),
    (dict(spacing=-1), "LayerSwapConfig(spacing=-1): must be an int >= 0"),
    (dict(protect=0), "LayerSwapConfig(protect=0): must be a list of 0-based block indices (ints)"),
    (dict(num_prompts=0), "LayerSwapConfig(num_prompts=0): must be an int >= 1"),
    (dict(seq_len=1), "LayerSwapConfig(seq_len=1): must be an int >= 2"),
    (dict(batch_size=0), "LayerSwapConfig(batch_size=0): must be an int >= 1"),
    (dict(seed="0"), "LayerSwapConfig(seed='0'): must be an int"),
    (dict(strategy="random-walk"), "LayerSwapConfig(strategy='random-walk'): allowed ["),
    (dict(objective="ppl"), "LayerSwapConfig(objective='ppl'): allowed ['removal_kl', 'nll', 'ghosted', None]"),
    (dict(max_evaluations=0), "LayerSwapConfig(max_evaluations=0): must be an int >= 1"),
    (dict(num_layers=1, recovery="magic"), "LayerSwapConfig(recovery='magic'): allowed [None, 'ghosted', 'fused']"),
    (dict(recovery="ghosted"), "LayerSwapConfig(recovery='ghosted') needs num_layers or layers: nothing is removed"),
    (dict(num_layers=1, recovery={"method": "ghosted", "rank": 4}),
     "LayerSwapConfig(recovery={'method': 'ghosted', 'rank': 4}): unknown keys ['rank']; allowed ['method', "
     "'num_tokens', 'epsilon']"),
    (dict(num_layers=1, recovery="ghosted", recovery_num_tokens=0),
     "LayerSwapConfig(recovery_num_tokens=0): must be an int >= 1"),
    (dict(num_layers=1, recovery="ghosted", recovery_num_tokens=2.5),
     "LayerSwapConfig(recovery_num_tokens=2.5): must be an int >= 1"),
    (dict(num_layers=1, recovery="ghosted", recovery_epsilon=-1.0),
     "LayerSwapConfig(recovery_epsilon=-1.0): must be a float >= 0 or None"),
    (dict(sparsity=1.0), "LayerSwapConfig(sparsity=1.0): must be a float in [0, 1)"),
    (dict(sparsity="half"), "LayerSwapConfig(sparsity='half'): must be a float in [0, 1)"),
    (dict(sparsity={"allocation": "owl"}),
     "LayerSwapConfig(sparsity={'allocation': 'owl'}): the target 'sparsity' (a float in [0, 1)) is missing"),
    (dict(sparsity={"sparsity": 0.5, "allocation": "owl"}, allocation="uniform"),
     "LayerSwapConfig: ['allocation'] given both in sparsity={'sparsity': 0.5, 'allocation': 'owl'} and as arguments"),
    (dict(sparsity=0.5, allocation="even"), "LayerSwapConfig: allocation='even': allowed ["),  # the registered ones
    (dict(sparsity=0.5, method="bogus"), "LayerSwapConfig: method='bogus': allowed ['wanda', 'sparsegpt', 'magnitude']"),
    (dict(sparsity=0.5, sparsity_pattern="2-4"),
     "LayerSwapConfig: pattern='2-4': allowed None (unstructured) or 'N:M' such as '2:4'"),
    (dict(version=0), f"LayerSwapConfig(version=0): allowed 1..{CONFIG_VERSION}"),
    (dict(version=CONFIG_VERSION + 1), f"LayerSwapConfig(version={CONFIG_VERSION + 1}): allowed 1..{CONFIG_VERSION}"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m.split(":")[0][:60] + str(i) for i, (_, m) in
                                                             enumerate(INVALID)])
def test_every_invalid_value_raises_naming_it_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(("kwargs", "message"), INVALID[:12], ids=[str(i) for i in range(12)])
def test_from_dict_validates_like_the_constructor(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig.from_dict({"quant_method": "layerswap", **kwargs})
    assert str(err.value).startswith(message)
