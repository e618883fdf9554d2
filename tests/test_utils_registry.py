"""One kind of registry entry with typed options (hf_layerswap/registry.py): the base, and
each registry's use of it (options checked by their dataclass, unknown names and options
refused with the closest, the command line's help and the docs read the same metadata)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.cli import build_parser
from hf_layerswap.healing.methods import HEAL_METHODS, LastKOptions, LoraOptions, get_heal_method
from hf_layerswap.scoring.protocols import get_protocol
from hf_layerswap.recovery import RECOVERY_METHODS, get_recovery_method, search_objectives
from hf_layerswap.utils.registry import (
    NoOptions, Options, Registry, RegistryEntry, import_package_modules, option, option_rows, options_subset, options_table,
    untyped_options,
)
from hf_layerswap.scoring.report import PairResult, SwapReport
from hf_layerswap.selection.objectives import OBJECTIVES, SET_OBJECTIVES, objective_entry
from hf_layerswap.sparsity import ALLOCATORS, PRUNERS, SparsifyOptions, get_pruner


@dataclass(frozen=True)
class _Toy(Options):
    rank: int = option(4, help="a rank", ge=1, what="the toy rank")
    scale: float | None = option(None, help="a scale", gt=0.0, le=2.0)
    mode: str = option("a", help="a mode", choices=("a", "b"))
    flag: bool = option(False, help="a flag")


@pytest.mark.parametrize("values, message", [
    ({"rank": 0}, "rank=0: must be an int >= 1 (the toy rank)"),
    ({"rank": True}, "rank=True: must be an int >= 1 (the toy rank)"),
    ({"rank": 2.0}, "rank=2.0: must be an int >= 1 (the toy rank)"),
    ({"scale": 0.0}, "scale=0.0: must be a finite number > 0 and <= 2 or None"),
    ({"scale": float("nan")}, "scale=nan: must be a finite number > 0 and <= 2 or None"),
    ({"mode": "c"}, "mode='c': must be one of ['a', 'b']"),
    ({"flag": 1}, "flag=1: must be True or False"),
    ({"rank": None}, "rank=None: must be an int >= 1 (the toy rank)"),
    ({"rnak": 2}, "method='toy' has no option 'rnak': its options are rank, scale, mode, flag (did you mean 'rank'?)"),
])
def test_options_refuse_a_bad_value_naming_the_field_value_and_what_is_allowed(values, message):
    with pytest.raises(ValueError) as err:
        _Toy.from_mapping(values, owner="method='toy'")
    assert str(err.value) == message


def test_options_convert_a_dict_and_keep_the_defaults():
    toy = _Toy.from_mapping({"rank": 8, "scale": 1, "flag": True})
    assert (toy.rank, toy.scale, toy.mode, toy.flag) == (8, 1, "a", True)
    assert _Toy.from_mapping(None) == _Toy() and _Toy.from_mapping(toy) is toy
    assert toy.to_dict() == {"rank": 8, "scale": 1, "mode": "a", "flag": True}
    with pytest.raises(ValueError, match=r"^method='none' has no option 'rank': it takes none$"):
        NoOptions.from_mapping({"rank": 1}, owner="method='none'")
    assert [r["allowed"] for r in option_rows(_Toy)] == [
        "an int >= 1", "a finite number > 0 and <= 2 or None", "one of ['a', 'b']", "True or False"]
    assert _Toy.describe().startswith("rank (an int >= 1, default 4): a rank; scale (")


def test_untyped_and_subset_options():
    loose = untyped_options("LooseOptions", ("depth",))
    assert loose.from_mapping({"depth": "anything"}).depth == "anything"
    with pytest.raises(ValueError, match="has no option 'width': its options are depth"):
        loose.from_mapping({"width": 1})
    owl = options_subset(SparsifyOptions, ("owl_m",), "OwlOptions")
    assert owl().owl_m == SparsifyOptions().owl_m == 5.0
    with pytest.raises(ValueError, match=r"^owl_m=-1: must be a finite number > 0$"):
        owl(owl_m=-1)
    with pytest.raises(ValueError, match=r"\['nope'\] are no fields of SparsifyOptions"):
        options_subset(SparsifyOptions, ("nope",), "Nope")
    with pytest.raises(TypeError, match=r"^_Bare\.depth: an option field needs help"):
        option_rows(_Bare)


@dataclass(frozen=True)
class _Bare(Options):
    depth: int = 2  # no help: refused by the tables


def test_a_registry_refuses_a_second_entry_and_names_the_closest_unknown_name():
    registry = Registry("test thing", "thing")
    try:
        registry.add("alpha", 1)
        with pytest.raises(ValueError, match=r"^test thing 'alpha' is already registered \(registered: \['alpha'\]\)$"):
            registry.add("alpha", 2)
        with pytest.raises(ValueError, match="must be a non-empty string"):
            registry.add("", 3)
        names = registry.names
        registry.add("beta", 2)
        assert list(names) == ["alpha", "beta"] and registry.lookup("beta") == 2
        with pytest.raises(ValueError) as err:
            registry.lookup("alpah")
        assert str(err.value) == "thing='alpah': allowed ['alpha', 'beta'] (did you mean 'alpha'?)"
        with pytest.raises(ValueError) as err:
            registry.lookup(7)
        assert str(err.value) == "thing=7: allowed ['alpha', 'beta']"
    finally:
        Registry.ALL.pop("test thing")


def test_a_package_imports_every_module_of_its_own_so_each_registers(tmp_path, monkeypatch):
    """A module dropped into a registry package registers its entries with no import to add."""
    package = tmp_path / "dropin_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from hf_layerswap.utils.registry import Registry, import_package_modules\n"
        "THINGS = Registry('drop-in thing', 'thing')\n"
        "IMPORTED = import_package_modules(__name__, __path__)\n")
    for name in ("zeta", "alpha"):  # written in this order, imported sorted
        (package / f"{name}.py").write_text(f"from . import THINGS\nTHINGS.add({name!r}, {name!r})\n")
    (package / "sub" / "__init__.py").write_text("from .. import THINGS\nTHINGS.add('sub', 'sub')\n")
    (package / "notes.txt").write_text("not a module")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("dropin_pkg")
        assert module.IMPORTED == ("dropin_pkg.alpha", "dropin_pkg.sub", "dropin_pkg.zeta")
        assert list(module.THINGS) == ["alpha", "sub", "zeta"]
        assert import_package_modules("dropin_pkg", module.__path__) == module.IMPORTED  # run once: not again
        assert list(module.THINGS) == ["alpha", "sub", "zeta"]
        (package / "broken.py").write_text("raise ImportError('broken on purpose')\n")
        with pytest.raises(ImportError, match="broken on purpose"):  # never skipped
            import_package_modules("dropin_pkg", module.__path__)
    finally:
        Registry.ALL.pop("drop-in thing", None)
        for name in [n for n in sys.modules if n == "dropin_pkg" or n.startswith("dropin_pkg.")]:
            del sys.modules[name]


@pytest.mark.parametrize("lookup, argument, kind, built_ins, close", [
    (lambda: get_heal_method("lorra"), "method='lorra'", "healing method", ["adjacent", "last_k", "lora"], "lora"),
    (lambda: get_recovery_method("ghosteed"), "method='ghosteed'", "recovery method",
     ["none", "ghosted", "fused", "linearpatch"], "ghosted"),
    (lambda: get_pruner("wandaa"), "pruner='wandaa'", "pruning method", ["wanda", "sparsegpt", "magnitude"], "wanda"),
    (lambda: get_protocol("interchang"), "protocol='interchang'", "swap protocol", ["replacement", "interchange"],
     "interchange"),
    (lambda: objective_entry("nl"), "objective='nl'", None, ["removal_kl", "nll", "ghosted"], "nll"),
])
def test_each_registry_names_the_closest_registered_name(lookup, argument, kind, built_ins, close):
    """The message lists every name registered now (the built-ins among them) and the closest."""
    allowed = list(OBJECTIVES) if kind is None else Registry.ALL[kind].allowed()
    assert set(built_ins) <= set(allowed)
    with pytest.raises(ValueError) as err:
        lookup()
    assert str(err.value) == f"{argument}: allowed {allowed} (did you mean {close!r}?)"


def test_healing_options_are_typed_and_a_dict_still_works():
    assert HEAL_METHODS["lora"].option_class is LoraOptions and HEAL_METHODS["last_k"].option_class is LastKOptions
    assert HEAL_METHODS["adjacent"].option_class is NoOptions
    cfg = hl.HealConfig(method="lora", options=LoraOptions(lora_r=8))
    assert cfg.options == {"lora_r": 8, "lora_alpha": None}
    assert cfg == hl.HealConfig(method="lora", options={"lora_r": 8, "lora_alpha": None})
    assert hl.LayerSwapConfig.from_dict(hl.LayerSwapConfig(layers=[1], heal=cfg).to_dict()).heal == cfg
    assert LoraOptions(lora_r=8).alpha == 16 and LoraOptions(lora_r=8, lora_alpha=4).alpha == 4
    with pytest.raises(ValueError) as err:
        hl.HealConfig(method="lora", options={"lora_rank": 8})
    assert str(err.value) == ("HealConfig(options={'lora_rank': 8}): method='lora' has no option 'lora_rank': "
                              "its options are lora_r, lora_alpha (did you mean 'lora_r'?)")
    with pytest.raises(ValueError, match=r"^HealConfig\(options=\{'k': 0\}\): k=0: must be an int >= 1$"):
        hl.HealConfig(method="last_k", options={"k": 0})


def test_a_lora_alpha_given_reaches_peft():
    student = tiny_model("llama", num_blocks=4)
    trained = get_heal_method("lora").prepare(student, {"lora_r": 2, "lora_alpha": 3})
    layer = trained.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.r["default"] == 2 and layer.scaling["default"] == pytest.approx(3 / 2)
    default = get_heal_method("lora").prepare(tiny_model("llama", num_blocks=4), {"lora_r": 2})
    assert default.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 2.0


def test_a_repair_without_a_ridge_bounds_its_epsilon_to_zero():
    linearpatch, ghosted = RECOVERY_METHODS["linearpatch"], RECOVERY_METHODS["ghosted"]
    assert linearpatch.option_class.names() == ("num_tokens", "epsilon") == ghosted.option_class.names()
    with pytest.raises(ValueError, match=r"^epsilon=0\.5: must be 0 or None$"):
        linearpatch.parse_options({"epsilon": 0.5})
    assert ghosted.parse_options({"epsilon": 0.5}).epsilon == 0.5
    assert RECOVERY_METHODS["none"].option_class is NoOptions
    with pytest.raises(ValueError, match=r"^method='ghosted' has no option 'rank': its options are num_tokens, epsilon$"):
        ghosted.parse_options({"rank": 4}, owner="method='ghosted'")


def test_sparsify_refuses_an_option_value_out_of_its_bounds_before_any_forward_pass():
    """owl_m <= 0 and a negative SparseGPT dampening were taken as given (every weight an
    outlier; a Hessian made indefinite); their typed options refuse them up front."""
    model = tiny_model("llama", num_blocks=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^owl_m=0\.0: must be a finite number > 0$"):
        hl.sparsify(model, tiny_batch(), sparsity=0.5, allocation="owl", pruner="magnitude", owl_m=0.0)
    with pytest.raises(ValueError, match=r"^percdamp=-0\.1: must be a finite number >= 0$"):
        hl.sparsify(model, tiny_batch(), sparsity=0.5, allocation="uniform", pruner="sparsegpt", percdamp=-0.1)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert ALLOCATORS["owl"].option_class.names() == ("owl_m", "owl_lambda")
    assert PRUNERS["sparsegpt"].option_class.names() == ("blocksize", "percdamp")
    assert PRUNERS["wanda"].option_class.names() == ()


def test_select_layers_refuses_a_typed_strategy_option_out_of_bounds_before_running():
    report = SwapReport(6, [PairResult(i, i + 1, 0.1, 0.1, 0.1 * (i + 1)) for i in range(5)])
    with pytest.raises(ValueError, match=r"^max_rounds=-1: must be an int >= 0$"):
        hl.select_layers(report, 1, strategy="search", max_rounds=-1)
    with pytest.raises(ValueError, match=r"^width=0: must be an int >= 1$"):
        hl.select_layers(report, 1, strategy="beam", width=0)
    with pytest.raises(TypeError, match="does not take the option"):
        hl.select_layers(report, 1, strategy="beam", widht=2)


def test_prune_help_lists_every_healing_methods_options():
    prune = build_parser()._subparsers._group_actions[0].choices["prune"]
    text = " ".join(prune.format_help().split())
    for name, cls in HEAL_METHODS.items():
        assert f"{name}: {' '.join(cls.option_class.describe().split())}" in text
    assert "last_k: k (an int >= 1, default 3):" in text
    assert "lora: lora_r (an int >= 1, default 16): the LoRA rank of every adapter" in text


def test_every_entry_of_every_registry_carries_help_options_and_an_estimate():
    kinds = {"swap protocol", "selection strategy", "set objective", "recovery method", "healing method", "allocator",
             "pruning method"}
    assert kinds <= set(Registry.ALL)
    assert list(OBJECTIVES) == [*SET_OBJECTIVES, *search_objectives()] and "ghosted" in search_objectives()
    for kind in kinds:
        for name, entry in Registry.ALL[kind].items():
            assert isinstance(entry, RegistryEntry) or issubclass(entry, RegistryEntry), (kind, name)
            assert isinstance(entry.help, str) and entry.help, (kind, name)
            assert issubclass(entry.option_class, Options), (kind, name)
            option_rows(entry.option_class)  # every option carries its help
            assert entry.estimate is not None, (kind, name)
        assert options_table(Registry.ALL[kind]).count("\n") >= len(Registry.ALL[kind]) + 1


def test_prune_refuses_a_bad_heal_option_naming_the_closest_before_the_model_loads(tmp_path, capsys):
    from conftest import tiny_checkpoint

    from hf_layerswap.cli import main

    tiny_checkpoint(tmp_path / "model")
    capsys.readouterr()  # the save's progress bars
    out = tmp_path / "out"
    for given, message in (("kk=2", "method='last_k' has no option 'kk': its options are k (did you mean 'k'?)"),
                           ("k=0", "k=0: must be an int >= 1")):
        assert main(["prune", str(tmp_path / "model"), str(out), "--layers", "2", "--heal", "last_k",
                     "--heal-option", given]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        key, value = given.split("=")
        assert err == [f"error: HealConfig(options={{{key!r}: {value}}}): {message}"]
        assert not out.exists()


def test_options_read_key_value_text_as_each_fields_type():
    assert _Toy.parse_text(["rank=3", "scale=0.5", "mode=b", "flag=true"]) == {
        "rank": 3, "scale": 0.5, "mode": "b", "flag": True}
    assert _Toy.parse_text(["scale=None", "flag=False"]) == {"scale": None, "flag": False}
    assert _Toy.parse_text([]) == {}


@pytest.mark.parametrize("items, message", [
    (["rank"], "'rank': give KEY=VALUE, e.g. rank=..."),
    (["=3"], "'=3': give KEY=VALUE, e.g. rank=..."),
    (["rank=3.5"], "rank='3.5': must be an int >= 1 (the toy rank)"),
    (["rank=0"], "rank=0: must be an int >= 1 (the toy rank)"),
    (["rank=none"], "rank='none': must be an int >= 1 (the toy rank)"),
    (["scale=wide"], "scale='wide': must be a finite number > 0 and <= 2 or None"),
    (["scale=inf"], "scale=inf: must be a finite number > 0 and <= 2 or None"),
    (["flag=yes"], "flag='yes': must be True or False"),
    (["mode=c"], "mode='c': must be one of ['a', 'b']"),
    (["rnak=2"], "method='toy' has no option 'rnak': its options are rank, scale, mode, flag (did you mean 'rank'?)"),
    (["rank=2", "rank=3"], "rank is given twice (rank=2 and rank=3): give it once"),
    (["flag=true", "flag=true"], "flag is given twice (flag=True and flag=True): give it once"),
])
def test_options_refuse_key_value_text_naming_the_key_the_value_and_what_is_allowed(items, message):
    with pytest.raises(ValueError) as err:
        _Toy.parse_text(items, owner="method='toy'")
    assert str(err.value) == message
