"""LayerSwapConfig: a dataclass whose fields carry their help, with nested sub-configs;
round trips (dict, JSON string, JSON file, a pruned checkpoint's config.json, transformers'
``update``), typed choices, unknown keys refused with the allowed ones, one clear error per
invalid value, and names added to the strategy, recovery and sparsity registries (accepted,
round-tripped and run by ``from_pretrained``)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import pickle
import re
import warnings
from dataclasses import fields, is_dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from arch_matrix import build
from conftest import tiny_batch, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.quantizers.auto import AutoQuantizationConfig

import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig, prune
from hf_layerswap.layerplan import num_blocks
from hf_layerswap.recovery import RECOVERY_METHODS, register_recovery_method
from hf_layerswap.recovery import RecoveryMethod
from hf_layerswap.selection import MODEL_STRATEGIES, STRATEGIES, register_strategy
from hf_layerswap.sparsity import ALLOCATORS, PRUNERS, register_allocator, register_pruner
from hf_layerswap.config import (
    CONFIG_VERSION,
    FLAT_KEYWORDS,
    AllocationName,
    HealConfig,
    ObjectiveName,
    ProtocolName,
    PrunerName,
    RecoveryConfig,
    RecoveryMethodName,
    SparsityConfig,
    config_keys,
)

CONFIGS = {
    "default": {},
    "scored": dict(num_to_remove=2, protocol="replacement", strategy="greedy", spacing=2, protect=[0, 5], max_gap=2),
    "search": dict(num_to_remove=3, objective="nll", max_evaluations=40, num_prompts=16, seq_len=64, batch_size=4, seed=7),
    "explicit": dict(layers=[1, -2], protect=[0]),
    "auto": dict(num_to_remove=1, protocol="auto", strategy="auto"),
    "recovery": dict(num_to_remove=2, recovery="fused", recovery_num_tokens=4096, recovery_epsilon=0.5),
    "sparsity": dict(layers=[2], sparsity=0.5, allocation="uniform", pruner="sparsegpt", sparsity_pattern="2:4"),
    "calibration file": dict(num_to_remove=1, calibration="/data/corpus/valid.txt"),
    "strategy options": dict(num_to_remove=2, strategy="beam", strategy_options={"width": 4, "include_greedy": False}),
    "score protocols": dict(num_to_remove=2, strategy="sleb", score_protocols=["interchange", "replacement"]),
}


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config(request):
    return LayerSwapConfig(**CONFIGS[request.param])


def test_to_dict_is_json_able_in_field_order(config):
    d = config.to_dict()
    assert list(d) == [f.name for f in fields(LayerSwapConfig) if f.name not in ("tokenizer", "progress")]
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
    cfg = LayerSwapConfig(num_to_remove=1, calibration={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                          tokenizer=object(), progress=False)
    d = cfg.to_dict()
    assert "tokenizer" not in d and "progress" not in d and d["calibration"] is None
    assert LayerSwapConfig(calibration="/home/alice/corpus/valid.txt").to_dict()["calibration"] == "valid.txt"
    assert "_protect_given" not in d
    assert cfg == LayerSwapConfig(num_to_remove=1)  # equality is over what gets serialized


def test_layerswap_config_serialization_and_contradictions():
    cfg = LayerSwapConfig(num_to_remove=2, calibration={"input_ids": torch.ones(1, 3, dtype=torch.long)}, tokenizer=object())
    d = cfg.to_dict()
    assert d["quant_method"] == "layerswap" and d["calibration"] is None and "tokenizer" not in d
    json.dumps(d)
    with pytest.raises(ValueError, match="contradictory"):
        LayerSwapConfig(num_to_remove=3, layers=[1, 2])
    with pytest.raises(ValueError, match="protocol='both'"):
        LayerSwapConfig(num_to_remove=1, protocol="both")


def test_save_pretrained_and_reload_re_read_the_same_config(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    cfg = LayerSwapConfig(num_to_remove=2, strategy="greedy", spacing=2, calibration=tiny_batch(), progress=False,
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


def test_an_unknown_key_is_an_error_naming_it_the_closest_key_and_the_allowed_ones(tmp_path):
    """A misspelt key used to be dropped with a warning, and a full score then removed nothing."""
    allowed = config_keys()
    assert allowed[:2] == ["num_to_remove", "layers"] and {"recovery_epsilon", "quant_method", "version"} <= set(allowed)
    expected = (f"LayerSwapConfig.from_dict: unknown keys ['num_to_remve'] ('num_to_remve': did you mean 'num_to_remove'?); "
                f"allowed {allowed}")
    typo = {"quant_method": "layerswap", "num_to_remve": 2}
    for read in (LayerSwapConfig.from_dict, AutoQuantizationConfig.from_dict):
        with pytest.raises(ValueError) as err:
            read(typo)
        assert str(err.value) == expected
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"unknown keys \['num_to_remve'\]"):
        prune(model, {"num_to_remve": 2})
    model.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"did you mean 'num_to_remove'\?"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=typo)
    with pytest.raises(ValueError) as err:  # no close match: the allowed keys only
        LayerSwapConfig.from_dict({"zzz": 1})
    assert str(err.value) == f"LayerSwapConfig.from_dict: unknown keys ['zzz']; allowed {allowed}"


def test_a_key_renamed_before_the_first_release_is_refused_with_its_new_name():
    """``num_layers`` became ``num_to_remove`` and the pruner's ``method`` became ``pruner``:
    the closest-match hint pointed ``num_layers`` at ``layers`` (explicit indices), a
    different meaning."""
    allowed = config_keys()
    with pytest.raises(TypeError) as err:
        LayerSwapConfig(num_layers=2)
    assert str(err.value) == (f"LayerSwapConfig got unexpected arguments: unknown keys ['num_layers'] "
                              f"('num_layers' is now 'num_to_remove'); allowed {allowed}")
    with pytest.raises(ValueError, match=r"'method' is now 'pruner'"):
        LayerSwapConfig.from_dict({"method": "wanda", "sparsity": 0.5})


def test_a_newer_format_version_warns_and_an_unknown_key_in_it_says_upgrade():
    newer = {**LayerSwapConfig(num_to_remove=2).to_dict(), "version": CONFIG_VERSION + 1}
    with pytest.warns(UserWarning) as record:
        cfg = LayerSwapConfig.from_dict(newer)
    assert str(record[0].message) == (f"LayerSwapConfig.from_dict: format version {CONFIG_VERSION + 1} read as version "
                                      f"{CONFIG_VERSION} (written by a newer hf_layerswap?)")
    assert cfg == LayerSwapConfig(num_to_remove=2)
    with pytest.raises(ValueError, match=rf"unknown keys \['draft_model'\].* \(format version {CONFIG_VERSION + 1} is "
                                         r"newer than this hf_layerswap's 1: upgrade hf_layerswap to read it\)"):
        LayerSwapConfig.from_dict({**newer, "draft_model": "x/y"})
    with warnings.catch_warnings():  # a config of this version reads silently
        warnings.simplefilter("error")
        LayerSwapConfig.from_dict(LayerSwapConfig(num_to_remove=2).to_dict())


def test_older_records_without_the_new_fields_still_read():
    old = {"quant_method": "layerswap", "num_to_remove": 2, "layers": None, "protocol": "interchange", "max_gap": 1,
           "spacing": 0, "protect": [0, -1], "calibration": None, "num_prompts": 64, "seq_len": 128, "batch_size": 8,
           "seed": 0, "recovery": None, "sparsity": None, "allocation": "pals", "pruner": "wanda",
           "sparsity_pattern": None, "progress": True, "strategy": "search", "objective": None, "max_evaluations": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LayerSwapConfig.from_dict(old) == LayerSwapConfig(num_to_remove=2)
    marker = {"quant_method": "layerswap", "recovery": "ghosted", "layers": [1, 3]}  # a ghosted checkpoint's marker
    assert LayerSwapConfig.from_dict(marker).recovery == RecoveryConfig("ghosted")


def test_unknown_constructor_argument_is_a_typo():
    with pytest.raises(TypeError, match=r"unexpected arguments: unknown keys \['num_to_remov'\] \('num_to_remov': did "
                                        r"you mean 'num_to_remove'\?\)"):
        LayerSwapConfig(num_to_remov=2)
    cfg = LayerSwapConfig(num_to_remove=2, recovery="fused")
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg


def test_sparsity_names_are_checked_against_the_registries():
    from hf_layerswap.sparsity import ALLOCATORS, PRUNERS

    with pytest.raises(ValueError) as err:
        LayerSwapConfig(layers=[1], sparsity=0.5, allocation="even")
    assert all(repr(name) in str(err.value) for name in ALLOCATORS)
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(layers=[1], sparsity=0.5, pruner="bogus")
    assert all(repr(name) in str(err.value) for name in PRUNERS)


def test_choices_with_a_registry_are_open_strings_checked_against_the_registry(extensions):
    """No closed Literal names the built-ins of a registry-backed choice: the annotation is
    ``str``, a registered name is a value (the config and the command line's choices), an
    unknown one is refused listing what is registered now."""
    from typing import get_type_hints

    from hf_layerswap.scoring.protocols import PROTOCOLS
    from hf_layerswap.selection.dispatch import selection_protocols
    from hf_layerswap.selection.objectives import OBJECTIVES

    assert {ProtocolName, ObjectiveName, RecoveryMethodName, AllocationName, PrunerName} == {str}
    registry_backed = [(kind, f.name) for kind in (LayerSwapConfig, RecoveryConfig, SparsityConfig)
                       for f in fields(kind) if "choices" in f.metadata and f.name != "recovery"]  # RecoveryConfig.method's
    assert {name for _, name in registry_backed} == {"protocol", "strategy", "objective", "method", "allocation", "pruner",
                                                     "score_protocols"}
    for kind, name in registry_backed:
        allowed = (list[str] | None,) if name == "score_protocols" else (str, str | None)
        assert get_type_hints(kind)[name] in allowed, (kind.__name__, name)
    choices = {a.dest: a.choices for a in _prune_parser()._actions}
    assert choices["protocol"] == list(selection_protocols()) and set(PROTOCOLS) < set(choices["protocol"])
    assert choices["objective"] == list(OBJECTIVES)
    for dest, name, registry in [("strategy", STRATEGY, STRATEGIES), ("recovery", REPAIR, RECOVERY_METHODS),
                                 ("allocation", ALLOCATOR, ALLOCATORS), ("pruner", PRUNER, PRUNERS)]:
        assert name in choices[dest] and set(choices[dest]) <= set(registry), dest
    cfg = LayerSwapConfig(**EXTENDED)
    assert (cfg.strategy, cfg.recovery.method, cfg.sparsity.allocation, cfg.sparsity.pruner) == (
        STRATEGY, REPAIR, ALLOCATOR, PRUNER)
    from hf_layerswap.recovery import METHODS as RECOVERY_NAMES

    assert set(choices["recovery"]) == set(RECOVERY_NAMES) - {"none"}  # "none" is spelt recovery=None here


def test_a_ridge_is_refused_for_a_repair_that_has_none():
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(recovery_epsilon=0\.1\): recovery='linearpatch' has no "
                                         r"ridge; allowed: None or 0\.0"):
        LayerSwapConfig(layers=[2], recovery="linearpatch", recovery_epsilon=0.1)
    assert LayerSwapConfig(layers=[2], recovery="linearpatch", recovery_epsilon=0).recovery.epsilon == 0
    assert LayerSwapConfig(layers=[2], recovery="linearpatch").recovery == RecoveryConfig("linearpatch")


def test_sub_configs_accept_a_dataclass_a_dict_or_the_flat_form():
    flat = LayerSwapConfig(num_to_remove=2, recovery="fused", recovery_epsilon=0.25)
    assert LayerSwapConfig(num_to_remove=2, recovery=RecoveryConfig("fused", epsilon=0.25)) == flat
    assert LayerSwapConfig(num_to_remove=2, recovery={"method": "fused", "epsilon": 0.25}) == flat
    assert flat.recovery == RecoveryConfig("fused", None, 0.25) and flat.recovery.epsilon == 0.25
    assert LayerSwapConfig(num_to_remove=2).recovery is None

    flat = LayerSwapConfig(layers=[1], sparsity=0.5, allocation="owl", pruner="magnitude")
    assert LayerSwapConfig(layers=[1], sparsity=SparsityConfig(0.5, "owl", "magnitude")) == flat
    assert LayerSwapConfig(layers=[1], sparsity={"sparsity": 0.5, "allocation": "owl", "pruner": "magnitude"}) == flat
    assert flat.sparsity == SparsityConfig(0.5, "owl", "magnitude", None) and flat.sparsity.allocation == "owl"
    assert LayerSwapConfig(layers=[1]).sparsity is None
    assert type(LayerSwapConfig(layers=[1], sparsity=0).sparsity.sparsity) is float
    # the flat keywords build the sub-configs; they are not attributes (one place for each value)
    assert not any(hasattr(flat, name) for name in FLAT_KEYWORDS)
    with pytest.warns(UserWarning, match=r"LayerSwapConfig: \['allocation'\] ignored: sparsity is None"):
        LayerSwapConfig(layers=[1], allocation="owl")


def test_a_dataclass_whose_fields_carry_their_help_with_nested_sub_configs():
    assert is_dataclass(LayerSwapConfig) and is_dataclass(RecoveryConfig) and is_dataclass(SparsityConfig)
    for kind in (LayerSwapConfig, RecoveryConfig, SparsityConfig):
        for f in fields(kind):
            assert f.metadata["help"].strip(), (kind.__name__, f.name)
    cfg = LayerSwapConfig(num_to_remove=2, recovery={"method": "ghosted", "num_tokens": 512}, sparsity=0.25)
    assert cfg.recovery == RecoveryConfig("ghosted", 512, None) and cfg.sparsity == SparsityConfig(0.25)
    d = cfg.to_dict()
    assert d["recovery"] == {"method": "ghosted", "num_tokens": 512, "epsilon": None}
    assert d["sparsity"] == {"sparsity": 0.25, "allocation": "pals", "pruner": "wanda", "pattern": None}
    assert json.loads(json.dumps(d)) == d and LayerSwapConfig.from_dict(d) == cfg
    assert not any(name.endswith("_config") for name in dir(cfg))  # no rebuilding properties


def _prune_parser():
    from hf_layerswap.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["prune"]


def test_the_command_line_help_is_the_fields_help():
    from hf_layerswap.cli.options import cli_settings, config_help

    by_flag = {flag: action for action in _prune_parser()._actions for flag in action.option_strings}
    # every field marked as a command-line setting has exactly one flag, whose help is the field's
    settings = cli_settings(LayerSwapConfig)
    assert settings == ["num_to_remove", "layers", "protocol", "max_gap", "spacing", "protect", "num_prompts",
                        "seq_len", "batch_size", "seed", "recovery", "sparsity", "strategy", "objective",
                        "max_evaluations", "score_protocols", "allocation", "pruner", "sparsity_pattern"]
    marked = [f.name for f in fields(LayerSwapConfig) if f.metadata.get("cli")]
    assert marked == settings[:-3]  # then the flat keywords of the marked sparsity fields
    for name in settings:
        flags = [flag for flag, action in by_flag.items() if action.dest == name]
        assert flags == ["--" + name.replace("_", "-")], name
        assert by_flag[flags[0]].help == config_help(name), name
    for name in marked:
        help_text = by_flag["--" + name.replace("_", "-")].help  # the field's help, then its registry's lines
        assert help_text.startswith(LayerSwapConfig.__dataclass_fields__[name].metadata["help"]) and help_text == config_help(name)
    assert config_help("recovery_epsilon") == RecoveryConfig.__dataclass_fields__["epsilon"].metadata["help"]
    assert config_help("pruner") == SparsityConfig.__dataclass_fields__["pruner"].metadata["help"]
    assert {"--num-layers", "--sparsity-method"}.isdisjoint(by_flag)


def test_prune_help_lists_each_strategys_and_repairs_line_from_its_registry_entry(capsys):
    """--strategy and --recovery name no built-in by hand: each registered entry's one line
    (its ``help``) follows the option's text, a strategy and a repair registered later too."""
    from conftest import prune_help
    from hf_layerswap.cli.options import config_help
    from hf_layerswap.selection.registry import strategy_entry

    assert config_help("strategy") == "how the set is chosen" + "".join(
        f"; {name}: {strategy_entry(name).help}" for name in sorted(STRATEGIES))
    assert config_help("recovery").startswith("repair the cut; ghosted: Ghosted Layers: one ridge operator per cut")
    register_strategy("test_listed", help="a test strategy's own line, 100% from its entry")(lambda report, n, **_: [1])

    class Listed(RecoveryMethod):
        """A test repair's own line."""

    register_recovery_method("test_listed_repair")(Listed)
    try:
        text = prune_help(capsys)
        for name in STRATEGIES:
            assert f"{name}: {' '.join(strategy_entry(name).help.split())}" in text, name
        for name, method in RECOVERY_METHODS.items():
            assert (f"{name}: {' '.join(method.help.split())}" in text) == method.fits, name  # "none" is no choice
        assert "test_listed: a test strategy's own line, 100% from its entry" in text  # its % kept as written
        assert "; test_listed_repair: A test repair's own line." in text
        choices = {a.dest: a.choices for a in _prune_parser()._actions}
        assert "test_listed" in choices["strategy"] and "test_listed_repair" in choices["recovery"]
    finally:
        from hf_layerswap.selection.registry import STRATEGY_ENTRIES, STRATEGY_OPTIONS

        for table in (STRATEGIES, STRATEGY_ENTRIES, STRATEGY_OPTIONS):
            table.pop("test_listed", None)
        RECOVERY_METHODS.pop("test_listed_repair", None)


def test_command_line_options_are_built_from_the_fields():
    from hf_layerswap.cli.options import add_config_options
    from hf_layerswap.selection.objectives import OBJECTIVES

    by_flag = {flag: action for action in _prune_parser()._actions for flag in action.option_strings}
    # types, defaults and choices come from the field: a minimum, a Literal, a registry, a list
    assert by_flag["--max-gap"].default == 1 and by_flag["--max-gap"].type.__name__ == "int >= 1"
    assert by_flag["--spacing"].default is None and by_flag["--spacing"].type.__name__ == "int >= 0"
    assert by_flag["--objective"].choices == list(OBJECTIVES) and {"removal_kl", "nll", "ghosted"} <= set(OBJECTIVES)
    assert by_flag["--strategy"].choices == sorted(STRATEGIES) and by_flag["--strategy"].default == "search"
    assert by_flag["--pruner"].choices == list(PRUNERS) and by_flag["--pruner"].default == "wanda"
    assert by_flag["--allocation"].choices == list(ALLOCATORS) and by_flag["--allocation"].default == "pals"
    assert by_flag["--recovery"].choices == [m for m in RECOVERY_METHODS if m != "none"]
    assert by_flag["--layers"].nargs == "+" and by_flag["--layers"].type is int
    assert by_flag["--protect"].nargs == "*"  # the verb's own override
    args = _prune_parser().parse_args(["m", "out", "--num-to-remove", "2", "--pruner", "magnitude", "--spacing", "0"])
    assert (args.num_to_remove, args.pruner, args.spacing, args.seq_len) == (2, "magnitude", 0, 128)
    parser = argparse.ArgumentParser()
    add_config_options(parser, ["method", "epsilon"], RecoveryConfig, types={"epsilon": float})
    assert vars(parser.parse_args(["--method", "fused", "--epsilon", "0.5"])) == {"method": "fused", "epsilon": 0.5}
    with pytest.raises(KeyError, match="'rank' is not a field of RecoveryConfig"):
        add_config_options(parser, ["rank"], RecoveryConfig)
    with pytest.raises(TypeError, match="config field 'calibration'"):
        add_config_options(parser, ["calibration"])


def test_transformers_update_sets_fields_and_validates_like_the_constructor():
    cfg = LayerSwapConfig(num_to_remove=2, recovery="ghosted")
    unused = cfg.update(num_to_remove=3, recovery_epsilon=0.5, not_ours=1)
    assert unused == {"not_ours": 1}
    assert cfg == LayerSwapConfig(num_to_remove=3, recovery="ghosted", recovery_epsilon=0.5)
    before = cfg.to_dict()
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(num_to_remove=0\): must be an int >= 1"):
        cfg.update(num_to_remove=0)
    assert cfg.to_dict() == before  # unchanged when refused
    again, unused = LayerSwapConfig.from_dict(before, return_unused_kwargs=True, seed=3, other=2)
    assert again.seed == 3 and unused == {"other": 2}
    # defaults that follow another field follow it after an update too, as in the constructor
    searched = LayerSwapConfig(num_to_remove=2)
    searched.update(strategy="greedy")
    assert searched.spacing == 1 == LayerSwapConfig(num_to_remove=2, strategy="greedy").spacing


def test_a_field_set_after_construction_is_normalised_by_validate():
    cfg = LayerSwapConfig(layers=[1])
    cfg.sparsity, cfg.recovery = 0.5, "fused"
    cfg.validate()
    assert cfg.sparsity == SparsityConfig(0.5) and cfg.recovery == RecoveryConfig("fused")


def test_validate_checks_a_field_changed_after_construction():
    cfg = LayerSwapConfig(num_to_remove=2)
    cfg.protocol = "both"
    with pytest.raises(ValueError, match=r"LayerSwapConfig\(protocol='both'\): allowed"):
        cfg.validate()


def test_a_config_is_not_changed_by_pruning_with_it(tmp_path):
    base = tiny_model("llama")
    cfg = LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=tiny_batch(), progress=False, batch_size=2)
    before = copy.deepcopy(cfg.to_dict())
    from hf_layerswap import prune_loaded_model

    prune_loaded_model(base, cfg)
    assert cfg.to_dict() == before


INVALID = [
    (dict(num_to_remove=0), "LayerSwapConfig(num_to_remove=0): must be an int >= 1"),
    (dict(num_to_remove=1.5), "LayerSwapConfig(num_to_remove=1.5): must be an int >= 1"),
    (dict(layers="1,2"), "LayerSwapConfig(layers='1,2'): must be a list of 0-based block indices (ints)"),
    (dict(layers=[1, "x"]), "LayerSwapConfig(layers=[1, 'x']): entries ['x'] are not ints; indices are 0-based ints"),
    (dict(layers=[]), "LayerSwapConfig(layers=[]): give at least one block index, or use num_to_remove"),
    (dict(layers=[1, 1]), "duplicate layer indices [1] in [1, 1] (after resolving negative indices)"),
    (dict(layers=[1], num_to_remove=2), "LayerSwapConfig(num_to_remove=2, layers=[1]) is contradictory: layers names 1 blocks"),
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
    (dict(objective="ppl"), "LayerSwapConfig(objective='ppl'): allowed ["),  # the registered ones
    (dict(max_evaluations=0), "LayerSwapConfig(max_evaluations=0): must be an int >= 1"),
    # a repair-aware objective without its repair would save the unrepaired cut under the repaired value
    (dict(num_to_remove=2, objective="ghosted"),
     "LayerSwapConfig(objective='ghosted', recovery=None) is contradictory: the 'ghosted' objective scores each set "
     "after the 'ghosted' repair, but recovery=None saves the model without it; pass recovery='ghosted' too, or an "
     "objective that assumes no repair (['removal_kl', 'nll'])"),
    (dict(num_to_remove=2, objective="ghosted", recovery="fused"),
     "LayerSwapConfig(objective='ghosted', recovery='fused') is contradictory"),
    (dict(num_to_remove=1, recovery="magic"), "LayerSwapConfig(recovery='magic'): allowed [None, "),  # the registered ones
    (dict(recovery="ghosted"), "LayerSwapConfig(recovery='ghosted') needs num_to_remove or layers: nothing is removed"),
    (dict(num_to_remove=1, recovery={"method": "ghosted", "rank": 4}),
     "LayerSwapConfig(recovery={'method': 'ghosted', 'rank': 4}): unknown keys ['rank']; allowed ['method', "
     "'num_tokens', 'epsilon']"),
    (dict(num_to_remove=1, recovery="ghosted", recovery_num_tokens=0),
     "LayerSwapConfig(recovery_num_tokens=0): must be an int >= 1"),
    (dict(num_to_remove=1, recovery="ghosted", recovery_num_tokens=2.5),
     "LayerSwapConfig(recovery_num_tokens=2.5): must be an int >= 1"),
    (dict(num_to_remove=1, recovery="ghosted", recovery_epsilon=-1.0),
     "LayerSwapConfig(recovery_epsilon=-1.0): must be a float >= 0 or None"),
    # refused at construction, not after the weights load (inf) or as torch's raw LinAlgError (1e308)
    (dict(num_to_remove=1, recovery="ghosted", recovery_epsilon=math.inf),
     "LayerSwapConfig(recovery_epsilon=inf): must be a finite float >= 0 and at most 2**52 = 4.504e+15 (lambda = "
     "epsilon * trace(X^T X) / H; beyond 2**52 the data term is below float64 rounding of lambda"),
    (dict(num_to_remove=1, recovery="ghosted", recovery_epsilon=math.nan),
     "LayerSwapConfig(recovery_epsilon=nan): must be a float >= 0 or None"),
    (dict(num_to_remove=1, recovery={"method": "fused", "epsilon": 1e308}),
     "LayerSwapConfig(recovery_epsilon=1e+308): must be a finite float >= 0 and at most 2**52"),
    (dict(num_to_remove=1, recovery="ghosted", recovery_epsilon=2.0**52 + 2),
     "LayerSwapConfig(recovery_epsilon=4503599627370498.0): must be a finite float >= 0 and at most 2**52"),
    (dict(num_to_remove=1, quant_method="gptq"), "LayerSwapConfig(quant_method='gptq'): allowed ['layerswap']"),
    (dict(sparsity=1.0), "LayerSwapConfig(sparsity=1.0): must be a float in [0, 1)"),
    (dict(sparsity="half"), "LayerSwapConfig(sparsity='half'): must be a float in [0, 1)"),
    (dict(sparsity={"allocation": "owl"}),
     "LayerSwapConfig(sparsity={'allocation': 'owl'}): the target 'sparsity' (a float in [0, 1)) is missing"),
    (dict(sparsity={"sparsity": 0.5, "allocation": "owl"}, allocation="uniform"),
     "LayerSwapConfig: ['allocation'] given both in sparsity={'sparsity': 0.5, 'allocation': 'owl'} and as arguments"),
    (dict(sparsity=0.5, allocation="even"), "LayerSwapConfig: allocation='even': allowed ["),  # the registered ones
    (dict(sparsity=0.5, pruner="bogus"), "LayerSwapConfig(pruner='bogus'): allowed ["),  # the registered ones
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


# ----------------------------------------------------------------------------- registered names
#: Names the tests below register; none of them is a built-in.
STRATEGY, REPAIR, ALLOCATOR, PRUNER = "test_fixed_set", "test_noted_repair", "test_alternating", "test_first_columns"
#: What the registered strategy always returns (0-based blocks of the tiny 6-block model).
FIXED_SET = [1, 3]
#: Per-block sparsity the registered allocator gives the 4 blocks that remain.
ALTERNATING = [0.25, 0.75, 0.25, 0.75]


@contextlib.contextmanager
def registered_extensions():
    """Register a strategy, a recovery method, an allocator and a pruner; unregister them
    on exit (also when the body fails). Yields what each was called with."""
    calls = SimpleNamespace(strategy=[], repair=[], allocator=[], pruner=0)

    def fixed_set(report, num_to_remove, **context):
        calls.strategy.append((num_to_remove, list(context["protect"])))
        return list(FIXED_SET)

    class NotedRepair(RecoveryMethod):
        def apply(self, model, cuts, maps, host_modules):
            calls.repair.append([list(c["removed"]) for c in cuts])

        def record(self, fits):
            return {"note": "applied by the test method"}

    def alternating(inputs):
        calls.allocator.append(len(inputs.num_params))
        return [ALTERNATING[i % 4] for i in range(len(inputs.num_params))], None, {}

    def first_columns(weight, statistics, target, pattern, options):
        calls.pruner += 1
        out = weight.clone()
        out[:, : round(target * weight.shape[1])] = 0
        return out

    try:
        register_strategy(STRATEGY)(fixed_set)
        register_recovery_method(REPAIR)(NotedRepair)
        register_allocator(ALLOCATOR, label="alternating: a test rule")(alternating)
        register_pruner(PRUNER, label="first columns: a test rule")(first_columns)
        yield calls
    finally:
        from hf_layerswap.selection.registry import STRATEGY_ENTRIES, STRATEGY_OPTIONS

        for table in (STRATEGIES, STRATEGY_ENTRIES, STRATEGY_OPTIONS):
            table.pop(STRATEGY, None)
        MODEL_STRATEGIES.discard(STRATEGY)
        RECOVERY_METHODS.pop(REPAIR, None)
        ALLOCATORS.pop(ALLOCATOR, None)
        PRUNERS.pop(PRUNER, None)


@pytest.fixture
def extensions():
    with registered_extensions() as calls:
        yield calls


EXTENDED = dict(num_to_remove=2, strategy=STRATEGY, recovery=REPAIR, sparsity=0.5, allocation=ALLOCATOR, pruner=PRUNER)


def test_registered_names_are_accepted_and_round_trip(extensions, tmp_path):
    cfg = LayerSwapConfig(**EXTENDED)
    d = cfg.to_dict()
    assert (d["strategy"], d["recovery"]["method"], d["sparsity"]["allocation"], d["sparsity"]["pruner"]) == (
        STRATEGY, REPAIR, ALLOCATOR, PRUNER)
    assert cfg.recovery == RecoveryConfig(REPAIR)
    assert cfg.sparsity == SparsityConfig(0.5, ALLOCATOR, PRUNER)
    assert LayerSwapConfig(num_to_remove=2, strategy=STRATEGY, recovery=RecoveryConfig(REPAIR),
                           sparsity=SparsityConfig(0.5, ALLOCATOR, PRUNER)) == cfg
    assert LayerSwapConfig.from_dict(d) == cfg and LayerSwapConfig.from_dict(d).to_dict() == d
    assert LayerSwapConfig.from_dict(json.loads(cfg.to_json_string())) == cfg
    cfg.to_json_file(tmp_path / "config.json")
    assert LayerSwapConfig.from_json_file(tmp_path / "config.json") == cfg
    again = AutoQuantizationConfig.from_dict(d)
    assert isinstance(again, LayerSwapConfig) and again == cfg


def test_unknown_names_list_what_is_registered_now(extensions):
    from hf_layerswap.selection.objectives import OBJECTIVES

    repairs = [name for name, method in RECOVERY_METHODS.items() if method.fits]
    cases = [
        (dict(strategy="nope"), f"LayerSwapConfig(strategy='nope'): allowed {sorted(STRATEGIES)}"),
        # a value that is no name (a hand-edited config.json's list) is refused by name too, not a TypeError
        (dict(strategy=["sleb"]), f"LayerSwapConfig(strategy=['sleb']): allowed {sorted(STRATEGIES)}"),
        # a name one typo away is named (as every registry's lookup names the closest)
        (dict(strategy="slebb"), f"LayerSwapConfig(strategy='slebb'): allowed {sorted(STRATEGIES)} (did you mean 'sleb'?)"),
        (dict(sparsity=0.5, pruner="wandaa"), f"LayerSwapConfig(pruner='wandaa'): allowed {list(PRUNERS)} "
                                              "(did you mean 'wanda'?)"),
        (dict(num_to_remove=1, recovery="nope"), f"LayerSwapConfig(recovery='nope'): allowed {[None, *repairs]}"),
        (dict(sparsity=0.5, allocation="nope"), f"LayerSwapConfig: allocation='nope': allowed {list(ALLOCATORS)}"),
        (dict(sparsity=0.5, pruner="nope"), f"LayerSwapConfig(pruner='nope'): allowed {list(PRUNERS)}"),
        (dict(objective="nope"), f"LayerSwapConfig(objective='nope'): allowed {[*OBJECTIVES, None]}"),
    ]
    # the built-ins and the names just registered are among them, whatever else is registered
    assert {STRATEGY, "search", "greedy", "auto", "sleb"} <= set(STRATEGIES)
    assert repairs[-1] == REPAIR and {"ghosted", "fused", "linearpatch"} <= set(repairs)
    assert list(ALLOCATORS)[-1] == ALLOCATOR and {"uniform", "pals", "owl", "random", "gradient"} <= set(ALLOCATORS)
    assert list(PRUNERS)[-1] == PRUNER and {"wanda", "sparsegpt", "magnitude"} <= set(PRUNERS)
    assert {"removal_kl", "nll", "ghosted"} <= set(OBJECTIVES)
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            LayerSwapConfig(**kwargs)
        assert str(err.value) == message


def test_unregistered_names_are_refused_again():
    before = (dict(STRATEGIES), set(MODEL_STRATEGIES), dict(RECOVERY_METHODS), dict(ALLOCATORS), dict(PRUNERS))
    with registered_extensions():
        LayerSwapConfig(**EXTENDED)
    assert (dict(STRATEGIES), set(MODEL_STRATEGIES), dict(RECOVERY_METHODS), dict(ALLOCATORS), dict(PRUNERS)) == before
    for field, name in [("strategy", STRATEGY), ("recovery", REPAIR), ("allocation", ALLOCATOR), ("pruner", PRUNER)]:
        with pytest.raises(ValueError) as err:
            LayerSwapConfig(num_to_remove=2, sparsity=0.5, **{field: name})
        message = str(err.value)
        assert f"{field}={name!r}" in message and "allowed [" in message
        assert message.count(name) == 1  # named as the bad value, not among the allowed ones
    with pytest.raises(ValueError, match=rf"strategy='{STRATEGY}'\): allowed"):
        LayerSwapConfig.from_dict({"quant_method": "layerswap", "num_to_remove": 2, "strategy": STRATEGY})


def test_from_pretrained_runs_the_registered_strategy_repair_and_sparsity(extensions, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "base")
    cfg = LayerSwapConfig(**EXTENDED, calibration=tiny_batch(), progress=False, batch_size=2)
    with warnings.catch_warnings():  # 33 calibration tokens < hidden size: the rank warning of any fit
        warnings.filterwarnings("ignore", message="recovery fitted on")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)

    record = model.config.layerswap
    assert extensions.strategy == [(2, [0, -1])]  # called once, with the budget and the default protect
    assert record["removed_layers"] == FIXED_SET and record["kept_layers"] == [0, 2, 4, 5]
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    assert record["steps"][0]["strategy"] == STRATEGY
    assert record["steps"][0]["config"] == cfg.to_dict() and LayerSwapConfig.from_dict(record["steps"][0]["config"]) == cfg

    assert extensions.repair == [[[1], [3]]]  # one apply, both cuts
    assert record["recovery"]["method"] == REPAIR and record["recovery"]["note"] == "applied by the test method"
    assert model.layerswap_recovery_report.method == REPAIR

    report = model.layerswap_sparsity_report
    assert (report.allocation, report.method) == (ALLOCATOR, PRUNER) and extensions.allocator == [4]
    assert [b.target for b in report.blocks] == ALTERNATING
    assert extensions.pruner == sum(1 for _ in model.model.layers[0].modules() if isinstance(_, torch.nn.Linear)) * 4
    for block, target in zip(model.model.layers, ALTERNATING):
        for lin in (m for m in block.modules() if isinstance(m, torch.nn.Linear)):
            k = round(target * lin.in_features)
            assert bool((lin.weight[:, :k] == 0).all()) and bool((lin.weight[:, k:] != 0).all())
    assert model.config.layerswap_sparsity["allocation"] == ALLOCATOR


# -------------------------------------- contradictory and out-of-range fields


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


CONTRADICTORY += [
    (dict(num_to_remove=1, strategy="greedy", max_evaluations=5),
     "LayerSwapConfig(strategy='greedy', max_evaluations=5): strategy 'greedy' takes no max_evaluations; it applies "
     "to ['search']"),
    (dict(num_to_remove=1, strategy="greedy", objective="nll"),
     "LayerSwapConfig(strategy='greedy', objective='nll'): strategy 'greedy' minimises no objective; objective "
     "applies to ['beam', 'search']"),
    (dict(num_to_remove=1, strategy="auto", objective="removal_kl"), "strategy 'auto' minimises no objective"),
    (dict(num_to_remove=True), "LayerSwapConfig(num_to_remove=True): must be an int >= 1"),
    (dict(num_to_remove=2.0), "LayerSwapConfig(num_to_remove=2.0): must be an int >= 1"),
]


def test_strategy_options_follow_the_registry_entry_not_the_name(monkeypatch):
    from hf_layerswap.selection import registry

    entry = registry.STRATEGY_ENTRIES["greedy"]
    monkeypatch.setitem(registry.STRATEGY_ENTRIES, "greedy", replace(entry, takes_objective=True))
    assert LayerSwapConfig(num_to_remove=1, strategy="greedy", objective="nll").objective == "nll"
    assert LayerSwapConfig(num_to_remove=1, strategy="search", objective="nll", max_evaluations=5).max_evaluations == 5


def test_integral_numbers_are_counts():
    np = pytest.importorskip("numpy")
    config = LayerSwapConfig(num_to_remove=np.int64(2), seq_len=np.int32(64), seed=np.int64(3), recovery="ghosted",
                             recovery_num_tokens=np.int64(512))
    assert (config.num_to_remove, config.seq_len, config.seed, config.recovery.num_tokens) == (2, 64, 3, 512)
    assert all(type(v) is int for v in (config.num_to_remove, config.seq_len, config.seed, config.recovery.num_tokens))
    assert json.loads(json.dumps(config.to_dict()))["num_to_remove"] == 2
    assert type(HealConfig(max_tokens=np.int64(1000)).max_tokens) is int


@pytest.mark.parametrize(("kwargs", "message"), CONTRADICTORY, ids=[m.split(":")[0] for _, m in CONTRADICTORY])
def test_contradictory_or_out_of_range_config_fields(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(**kwargs)
    assert message in str(err.value)


def test_unknown_config_argument_is_named():
    with pytest.raises(TypeError, match=r"unexpected arguments: unknown keys \['num_to_remov'\] \('num_to_remov': did "
                                        r"you mean 'num_to_remove'\?\); allowed \['num_to_remove', "):
        LayerSwapConfig(num_to_remov=2)


SPARSITY_CONFLICTS = [
    (dict(pruner="bogus"), f"LayerSwapConfig(pruner='bogus'): allowed {list(PRUNERS)}"),  # the registered ones
    (dict(allocation="even"), f"LayerSwapConfig: allocation='even': allowed {list(ALLOCATORS)}"),
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


@pytest.mark.parametrize(("layers", "protect", "clash"), [([0], [0], [0]), ([2, -1], [1, -1], [-1]), ([1, 3], [3], [3])])
def test_layers_that_are_also_protected_are_contradictory(layers, protect, clash):
    with pytest.raises(ValueError) as err:
        hl.LayerSwapConfig(layers=layers, protect=protect)
    assert str(err.value) == (f"LayerSwapConfig(layers={layers}, protect={protect}) is contradictory: block(s) {clash} "
                              "would be removed and protected; drop them from layers or from protect")


def test_a_protected_block_named_from_the_other_end_is_caught_with_the_model():
    model = build("llama")  # 6 blocks: -1 is block 5
    config = hl.LayerSwapConfig(layers=[5], protect=[-1])
    with pytest.raises(ValueError, match=re.escape("layers=[5], protect=[-1]) is contradictory: block(s) [5]")):
        hl.prune_loaded_model(model, config)
    assert num_blocks(model) == 6
    # explicit layers without an explicit protect are taken as given (block 0 included), and the
    # hidden flag never reaches the serialized config
    hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[0, 5]))
    assert num_blocks(model) == 4 and model.config.layerswap["removed_layers"] == [0, 5]
    assert "_protect_given" not in hl.LayerSwapConfig(layers=[0]).to_dict()
    assert hl.LayerSwapConfig().protect == [0, -1]


@pytest.mark.parametrize("name", ["calibration", "perplexity_text", "eval_tasks_path"])
def test_heal_config_refuses_an_empty_path(name):
    extra = {"eval_tasks": ["t"]} if name == "eval_tasks_path" else {}
    with pytest.raises(ValueError, match=rf"HealConfig\({name}=''\): must be a non-empty path or None"):
        HealConfig(**{name: ""}, **extra)


def test_a_recovery_method_that_serves_as_a_search_objective_is_accepted_as_objective():
    """objective= reads the live objectives: a recovery method registered with
    search_objective=True is accepted (it was refused by a closed Literal), needs its repair
    as recovery, and is offered by prune --objective."""
    from hf_layerswap.cli import build_parser
    from hf_layerswap.recovery import METHODS
    from hf_layerswap.selection.objectives import OBJECTIVES

    class AsObjective(RecoveryMethod):
        search_objective = True

    before = list(OBJECTIVES)
    register_recovery_method("test_objective_repair")(AsObjective)
    try:
        assert OBJECTIVES[-1] == "test_objective_repair" and METHODS[-1] == "test_objective_repair"
        cfg = LayerSwapConfig(num_to_remove=1, objective="test_objective_repair", recovery="test_objective_repair")
        assert (cfg.objective, cfg.recovery.method) == ("test_objective_repair", "test_objective_repair")
        assert LayerSwapConfig.from_dict(cfg.to_dict()) == cfg
        with pytest.raises(ValueError, match=r"objective='test_objective_repair', recovery=None\) is contradictory.*"
                                             r"objective that assumes no repair \(\['removal_kl', 'nll'\]\)"):
            LayerSwapConfig(num_to_remove=1, objective="test_objective_repair")
        prune_verb = build_parser()._subparsers._group_actions[0].choices["prune"]
        choices = {a.dest: a.choices for a in prune_verb._actions}
        assert choices["objective"] == [*before, "test_objective_repair"]
    finally:
        RECOVERY_METHODS.pop("test_objective_repair", None)
    assert list(OBJECTIVES) == before
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(num_to_remove=1, objective="test_objective_repair")
    assert str(err.value) == f"LayerSwapConfig(objective='test_objective_repair'): allowed {[*before, None]}"


def test_a_registered_strategy_gets_the_spacing_default_of_its_entry():
    from hf_layerswap.selection.registry import STRATEGY_ENTRIES, STRATEGY_OPTIONS

    register_strategy("test_spaced", spacing=2)(lambda report, n, **_: [1])
    try:
        assert LayerSwapConfig(num_to_remove=1, strategy="test_spaced").spacing == 2
        assert LayerSwapConfig(num_to_remove=1, strategy="test_spaced", spacing=0).spacing == 0
    finally:
        for table in (STRATEGIES, STRATEGY_ENTRIES, STRATEGY_OPTIONS):
            table.pop("test_spaced", None)
    assert [LayerSwapConfig(num_to_remove=1, strategy=s).spacing for s in ("greedy", "auto", "search", "sleb")] == [
        1, 1, 0, 0]


BAD_STRATEGY_OPTIONS = [
    (dict(strategy="beam", strategy_options={"widht": 4}),
     "LayerSwapConfig(strategy='beam', strategy_options={'widht': 4}): strategy='beam' has no option 'widht': its "
     "options are width, seed_size, include_greedy (did you mean 'width'?)"),
    (dict(strategy="beam", strategy_options={"width": 0}),
     "LayerSwapConfig(strategy='beam', strategy_options={'width': 0}): width=0: must be an int >= 1"),
    (dict(strategy="beam", strategy_options={"include_greedy": "yes"}),
     "LayerSwapConfig(strategy='beam', strategy_options={'include_greedy': 'yes'}): include_greedy='yes': must be True "
     "or False"),
    (dict(strategy="sleb", strategy_options={"width": 2}),
     "LayerSwapConfig(strategy='sleb', strategy_options={'width': 2}): strategy='sleb' has no option 'width': it takes "
     "none"),
    # greedy with protocol='auto' runs the auto strategy: its options are checked
    (dict(strategy="greedy", protocol="auto", strategy_options={"width": 2}),
     "LayerSwapConfig(strategy='auto', strategy_options={'width': 2}): strategy='auto' has no option 'width': it takes "
     "none"),
    (dict(strategy="search", strategy_options=[("max_rounds", 2)]),
     "LayerSwapConfig(strategy='search', strategy_options=[('max_rounds', 2)]): must be a dict of the strategy's "
     "options (str keys) or None"),
    (dict(strategy="beam", strategy_options={"width": 2}, num_to_remove=None, layers=[1]),
     "LayerSwapConfig(strategy='beam', strategy_options={'width': 2}): explicit layers are removed without a strategy; "
     "drop strategy_options or layers"),
    # a field that sets an option: both only with one value
    (dict(strategy="search", max_evaluations=20, strategy_options={"max_evaluations": 30}),
     "LayerSwapConfig(strategy='search', strategy_options={'max_evaluations': 30}) is contradictory: "
     "max_evaluations=20 is set by the config's field 'max_evaluations' and max_evaluations=30 by strategy_options; "
     "give it once"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_STRATEGY_OPTIONS, ids=[m.split(": ")[1][:40] for _, m in BAD_STRATEGY_OPTIONS])
def test_strategy_options_are_checked_against_the_strategy_that_runs(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(**{"num_to_remove": 2, **kwargs})
    assert str(err.value) == message


def test_strategy_options_reach_select_layers_once_with_the_fields_that_set_options():
    from hf_layerswap.selection.beam import BeamOptions
    from hf_layerswap.selection.registry import strategy_entry

    typed = LayerSwapConfig(num_to_remove=2, strategy="beam", strategy_options=BeamOptions(width=5))
    assert typed.strategy_options == {"width": 5, "seed_size": 12, "include_greedy": True}  # kept as its dict
    assert typed.selection_options() == {"width": 5, "seed_size": 12, "include_greedy": True}
    same = LayerSwapConfig(num_to_remove=2, max_evaluations=30, strategy_options={"max_evaluations": 30, "max_rounds": 1},
                           progress=False)
    assert same.selection_options() == {"max_evaluations": 30, "max_rounds": 1, "objective": "removal_kl",
                                        "progress": False}
    alone = LayerSwapConfig(num_to_remove=2, strategy_options={"max_evaluations": 3})
    assert alone.max_evaluations is None and alone.selection_options()["max_evaluations"] == 3
    # the search's own check reads the option as it reads the field: below the single-removal sweep
    with pytest.raises(ValueError, match=r"max_evaluations=3: at least 6 \(one per removable block\)"):
        strategy_entry("search").check_config(alone, 8)
    # a changed strategy re-checks the options against the new one
    with pytest.raises(ValueError, match="strategy='greedy' has no option 'width', 'seed_size', 'include_greedy': it "
                                         "takes none"):
        typed.update(strategy="greedy")
    assert typed.strategy == "beam"


def test_score_protocols_default_to_what_the_strategy_reads():
    assert LayerSwapConfig(num_to_remove=2, strategy="sleb").scored_protocols() == []
    assert LayerSwapConfig(num_to_remove=2, strategy="block_influence").scored_protocols() == []
    assert LayerSwapConfig(num_to_remove=2, strategy="greedy").scored_protocols() == ["interchange"]
    assert LayerSwapConfig(num_to_remove=2).scored_protocols() == ["replacement", "interchange"]
    assert LayerSwapConfig(strategy="sleb").scored_protocols() == ["replacement", "interchange"]  # scoring only
    assert LayerSwapConfig(layers=[1]).scored_protocols() == []
    asked = LayerSwapConfig(num_to_remove=2, strategy="sleb", score_protocols=("interchange",))
    assert asked.score_protocols == ["interchange"] and asked.scored_protocols() == ["interchange"]
    wider = LayerSwapConfig(num_to_remove=2, strategy="greedy", score_protocols=["interchange", "replacement"])
    assert wider.scored_protocols() == ["interchange", "replacement"]


BAD_SCORE_PROTOCOLS = [
    (dict(num_to_remove=2, strategy="greedy", score_protocols=["replacement"]),
     "LayerSwapConfig(score_protocols=['replacement']): strategy='greedy' with protocol='interchange' reads "
     "['interchange']; add them, or leave score_protocols=None (the protocols the strategy reads)"),
    (dict(num_to_remove=2, score_protocols=["interchange", "interchange"]),
     "LayerSwapConfig(score_protocols=['interchange', 'interchange']): allowed a list without repeats of "
     "['replacement', 'interchange']"),
    (dict(num_to_remove=2, strategy="sleb", score_protocols=[["interchange"]]),  # e.g. a hand-edited config.json
     "LayerSwapConfig(score_protocols=[['interchange']]): allowed a list without repeats of "
     "['replacement', 'interchange']"),
    (dict(num_to_remove=2, score_protocols="interchange"),
     "LayerSwapConfig(score_protocols='interchange'): must be a list of protocols from ['replacement', 'interchange'] "
     "or None"),
    (dict(layers=[1], score_protocols=["interchange"]),
     "LayerSwapConfig(score_protocols=['interchange']): explicit layers are removed without scoring; drop "
     "score_protocols or layers"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SCORE_PROTOCOLS, ids=[m.split(": ")[1][:30] for _, m in BAD_SCORE_PROTOCOLS])
def test_bad_score_protocols_are_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        LayerSwapConfig(**kwargs)
    assert str(err.value) == message


def test_strategy_options_reach_the_run_record_through_from_pretrained(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    cfg = LayerSwapConfig(num_to_remove=2, strategy="beam", strategy_options={"width": 1, "seed_size": 2},
                          calibration=tiny_batch(), progress=False, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)
    model.save_pretrained(tmp_path / "pruned")
    saved = json.loads((tmp_path / "pruned" / "config.json").read_text())["layerswap"]
    assert saved["steps"][0]["config"]["strategy_options"] == {"width": 1, "seed_size": 2}
    assert LayerSwapConfig.from_dict(saved["steps"][0]["config"]) == cfg
    select = next(e for e in saved["recipe"] if e["step"] == "select")
    assert select["options"] == {"width": 1, "seed_size": 2, "include_greedy": True}
    assert select["selection"].endswith("; options width=1, seed_size=2")
    # the options reached the beam: two seeds and one beam score fewer sets than its defaults (4 seeds, 3 beams)
    default = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=replace_options(cfg, None))
    calls = saved["steps"][0]["decision"]["cost"]["evaluator_calls"]
    assert calls < default.config.layerswap["steps"][0]["decision"]["cost"]["evaluator_calls"]


def replace_options(cfg: LayerSwapConfig, options) -> LayerSwapConfig:
    """``cfg`` with other ``strategy_options`` (its runtime fields kept)."""
    return LayerSwapConfig(**{**cfg.to_dict(), "strategy_options": options, "calibration": cfg.calibration,
                              "progress": cfg.progress})
