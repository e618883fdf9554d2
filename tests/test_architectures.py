"""The architecture matrix: on every family of ``tests/arch_matrix.py``, scoring restores the
model exactly, removal keeps the model and its config consistent (layer_idx, per-layer
lists, index fields, KV caches, plain reload, parameter count), a block keeps its own
attention type when a plan moves it, and what cannot be mapped is refused by name."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from arch_matrix import (
    CHECKS,
    FAMILIES,
    FAMILY_BY_NAME,
    NUM_BLOCKS,
    REFUSED,
    REMOVAL_SETS,
    block_signature,
    build,
    check_block_list,
    prompts,
    single_thread,
    support_table,
)
from hf_layerswap import remove_layers, score_layers
from hf_layerswap.layerplan import apply_plan, decoder_blocks, decoder_config

FAMILY_IDS = [f.name for f in FAMILIES]
CASES = [(f.name, s) for f in FAMILIES for s in REMOVAL_SETS]
CASE_IDS = [f"{f}-{s}" for f, s in CASES]

#: Index-valued fields after removal, computed by hand from the builders in arch_matrix:
#: qwen2 max_window_layers=2 (blocks 0-1 full); qwen3 max_window_layers=3; qwen3_moe
#: sparse blocks {1, 5} (decoder_sparse_step=2, block 3 forced dense by mlp_only_layers).
EXPECTED_INDEX_FIELDS = {
    ("qwen2", "noncontiguous"): {"max_window_layers": 1},  # kept 0,2,4,5: only 0 < 2
    ("qwen2", "contiguous"): {"max_window_layers": 2},  # kept 0,1,4,5
    ("qwen3", "noncontiguous"): {"max_window_layers": 2},  # 0, 2 < 3
    ("qwen3", "contiguous"): {"max_window_layers": 2},  # 0, 1 < 3
    # kept 0,2,4,5 -> only old 5 sparse -> new 3; dense: 0,1,2
    ("qwen3_moe", "noncontiguous"): {"mlp_only_layers": [0, 1, 2], "decoder_sparse_step": 1},
    # kept 0,1,4,5 -> old 1, 5 sparse -> new 1, 3; dense: 0, 2
    ("qwen3_moe", "contiguous"): {"mlp_only_layers": [0, 2], "decoder_sparse_step": 1},
}

NEW_TOKENS = 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _layer_idx_by_position(model) -> list[list[int]]:
    _, _, blocks = decoder_blocks(model)
    return [
        [m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)] for block in blocks
    ]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _per_layer_lists(cfg, num_blocks: int) -> dict[str, list]:
    """Every list/tuple config field with one entry per block."""
    return {
        k: list(v)
        for k, v in vars(cfg).items()
        if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == num_blocks
    }


def _num_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@functools.lru_cache(maxsize=None)
def _pruned(name: str, set_name: str):
    """(base model, pruned model, kept indices) for one matrix case; built once per session."""
    fam = FAMILY_BY_NAME[name]
    base = build(fam)
    pruned = build(fam)
    remove_layers(pruned, list(REMOVAL_SETS[set_name]))
    kept = [i for i in range(NUM_BLOCKS) if i not in REMOVAL_SETS[set_name]]
    return base, pruned, kept


# --------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_scoring_restores_model_exactly(name):
    fam = FAMILY_BY_NAME[name]
    model = build(fam)
    assert check_block_list(model, fam)
    batch = prompts()
    before_state = _state(model)
    before_idx = _layer_idx_by_position(model)
    before_cfg = copy.deepcopy(model.config.to_dict())
    blocks_before = decoder_blocks(model)[2]
    with torch.no_grad():
        logits_before = model(**batch).logits
    report = score_layers(model, batch, protocols=("replacement", "interchange"), max_gap=2, batch_size=1, progress=False)
    assert report.num_blocks == NUM_BLOCKS
    assert len(report.pairs) == 2 * NUM_BLOCKS - 3  # gaps 1 and 2
    for pair in report.pairs:  # every probe ran and changed the output
        assert pair.interchange > 0 and pair.replacement_ij > 0 and pair.replacement_ji > 0
    assert decoder_blocks(model)[2] is blocks_before
    assert _layer_idx_by_position(model) == before_idx == [[i] * len(before_idx[i]) for i in range(NUM_BLOCKS)]
    assert model.config.to_dict() == before_cfg
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    for key, value in before_state.items():
        assert torch.equal(after_state[key], value), key
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, logits_before)


# --------------------------------------------------------------------------- removal


@pytest.mark.parametrize(("name", "set_name"), CASES, ids=CASE_IDS)
def test_removal_keeps_model_and_config_consistent(name, set_name):
    fam = FAMILY_BY_NAME[name]
    base, pruned, kept = _pruned(name, set_name)
    removed = list(REMOVAL_SETS[set_name])
    _, _, base_blocks = decoder_blocks(base)
    _, _, blocks = decoder_blocks(pruned)
    cfg, base_cfg = decoder_config(pruned), decoder_config(base)

    # blocks: the kept ones, in order, with their own weights and construction settings
    assert len(blocks) == len(kept) == cfg.num_hidden_layers
    for new, old in enumerate(kept):
        assert block_signature(blocks[new]) == block_signature(base_blocks[old])
        for (k1, v1), (k2, v2) in zip(blocks[new].state_dict().items(), base_blocks[old].state_dict().items()):
            assert k1 == k2 and torch.equal(v1, v2), (new, old, k1)
    # layer_idx contiguous 0..L'-1 on every submodule that has one
    idx = _layer_idx_by_position(pruned)
    assert all(len(v) > 0 for v in idx)
    assert idx == [[pos] * len(v) for pos, v in enumerate(idx)]

    # every per-layer list filtered by kept index (fields named in the table, and any other)
    base_lists = _per_layer_lists(base_cfg, NUM_BLOCKS)
    assert set(fam.per_layer_fields) <= set(base_lists)
    for field, old_values in base_lists.items():
        assert list(getattr(cfg, field)) == [old_values[i] for i in kept], field
    # index-valued fields remapped (hand-computed values)
    for field, value in EXPECTED_INDEX_FIELDS.get((name, set_name), {}).items():
        assert getattr(cfg, field) == value, field
    assert set(fam.index_fields) == set(EXPECTED_INDEX_FIELDS.get((name, set_name), {}))

    # the pruned config describes the kept blocks: a model built from it has the same blocks
    fresh = type(pruned)(copy.deepcopy(pruned.config)).eval()
    fresh_blocks = decoder_blocks(fresh)[2]
    assert [block_signature(b) for b in fresh_blocks] == [block_signature(b) for b in blocks]

    # parameter count = base minus the removed blocks
    removed_params = sum(_num_params(base_blocks[i]) for i in removed)
    assert removed_params > 0
    assert _num_params(pruned) == _num_params(base) - removed_params

    # provenance
    record = pruned.config.layerswap
    assert record["removed_layers"] == removed and record["kept_layers"] == kept
    assert record["original_num_hidden_layers"] == NUM_BLOCKS and len(record["steps"]) == 1


def _greedy(model, batch, **kwargs):
    out = model.generate(
        **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize(("name", "set_name"), CASES, ids=CASE_IDS)
def test_generate_dynamic_static_and_no_cache_agree(name, set_name):
    _, pruned, _ = _pruned(name, set_name)
    batch = prompts(pad_last=0)  # 10 tokens > sliding window 4: the window matters
    seq_dyn, scores_dyn = _greedy(pruned, batch)
    seq_static, scores_static = _greedy(pruned, batch, cache_implementation="static")
    seq_none, scores_none = _greedy(pruned, batch, use_cache=False)
    assert seq_dyn.shape == (2, 10 + NEW_TOKENS)
    assert torch.equal(seq_dyn, seq_none) and torch.equal(seq_static, seq_none)
    torch.testing.assert_close(scores_dyn, scores_none, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores_static, scores_none, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- plain reload

_RELOAD_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_layerswap" or name.startswith("hf_layerswap."):
                raise ImportError("the reload check must not import hf_layerswap")
            return None

    sys.meta_path.insert(0, _Block())
    import torch, transformers
    torch.set_num_threads(int(sys.argv[2]))
    manifest = json.load(open(sys.argv[1]))
    results = {}
    for case, item in manifest.items():
        cls = getattr(transformers, item["architecture"])
        model, info = cls.from_pretrained(item["dir"], output_loading_info=True, attn_implementation="eager")
        model.eval()
        batch = torch.load(item["inputs"])
        with torch.no_grad():
            logits = model(**batch).logits
        torch.save(logits, item["logits_out"])
        results[case] = {
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "config": json.loads(model.config.to_json_string(use_diff=False)),
            "class": type(model).__name__,
        }
    results["_imported_hf_layerswap"] = any(m.startswith("hf_layerswap") for m in sys.modules)
    json.dump(results, open(sys.argv[3], "w"))
    """
)


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Save every pruned matrix model, reload them all in one subprocess that never imports
    hf_layerswap (plain transformers), and return per-case (expected, reloaded) logits."""
    root = tmp_path_factory.mktemp("reload")
    manifest, expected = {}, {}
    batch = prompts()
    torch.save(batch, root / "inputs.pt")
    for name, set_name in CASES:
        _, pruned, _ = _pruned(name, set_name)
        case = f"{name}-{set_name}"
        pruned.save_pretrained(root / case)
        with torch.no_grad():
            expected[case] = (pruned(**batch).logits, json.loads(pruned.config.to_json_string(use_diff=False)))
        manifest[case] = {
            "architecture": pruned.config.architectures[0],
            "dir": str(root / case),
            "inputs": str(root / "inputs.pt"),
            "logits_out": str(root / f"{case}.logits.pt"),
        }
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / "reload.py").write_text(_RELOAD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(root / "reload.py"), str(root / "manifest.json"), str(torch.get_num_threads()),
         str(root / "results.json")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((root / "results.json").read_text())
    assert results.pop("_imported_hf_layerswap") is False
    return {
        case: (expected[case], results[case], torch.load(manifest[case]["logits_out"])) for case in manifest
    }


_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "architectures"}


def _stable(config_dict: dict) -> dict:
    return {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}


@pytest.mark.parametrize(("name", "set_name"), CASES, ids=CASE_IDS)
def test_plain_transformers_reload_gives_identical_logits(reloaded, name, set_name):
    (logits, config), result, reloaded_logits = reloaded[f"{name}-{set_name}"]
    info = result["loading_info"]
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    assert torch.equal(reloaded_logits, logits)
    assert _stable(result["config"]) == _stable(config)
    text = result["config"].get("text_config", result["config"])
    assert text.get("num_hidden_layers", text.get("n_layer")) == NUM_BLOCKS - len(REMOVAL_SETS[set_name])
    assert "quantization_config" not in result["config"]
    assert result["config"]["layerswap"]["removed_layers"] == list(REMOVAL_SETS[set_name])


# --------------------------------------------------------------------------- plans


def _model_for_plan(fam, base, plan):
    """A model *built* to run ``plan``: slot s holds a copy of block plan[s]'s weights and
    the per-layer config entries of that block (layer_types, no_rope_layers, MoE kind)."""
    cfg = copy.deepcopy(base.config)
    text = cfg.get_text_config(decoder=True)
    for field in fam.per_layer_fields:
        setattr(text, field, [getattr(decoder_config(base), field)[p] for p in plan])
    base_blocks = decoder_blocks(base)[2]
    if "mlp_only_layers" in fam.index_fields:
        dense = [not type(b.mlp).__name__.lower().endswith("sparsemoeblock") for b in base_blocks]
        assert sum(dense) not in (0, len(dense))  # the family mixes both kinds
        text.mlp_only_layers = [s for s, p in enumerate(plan) if dense[p]]
        text.decoder_sparse_step = 1
    model = type(base)(cfg).eval()
    prefix = fam.block_list + "."
    source = base.state_dict()
    state = {}
    for key in model.state_dict():
        if key.startswith(prefix):
            slot, rest = key[len(prefix) :].split(".", 1)
            state[key] = source[f"{prefix}{plan[int(slot)]}.{rest}"]
        else:
            state[key] = source[key]
    model.load_state_dict(state, strict=True)
    return model


PLANS = {"interchange_1_2": [0, 2, 1, 3, 4, 5], "replacement_1_from_2": [0, 2, 2, 3, 4, 5]}


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", FAMILY_IDS)
def test_block_keeps_its_attention_type_under_a_plan(name, plan_name):
    fam = FAMILY_BY_NAME[name]
    plan = PLANS[plan_name]
    base = build(fam)
    batch = prompts()
    with torch.no_grad():
        with apply_plan(base, plan):
            under_plan = base(**batch, use_cache=False).logits
        built = _model_for_plan(fam, base, plan)(**batch, use_cache=False).logits
        identity = base(**batch, use_cache=False).logits
    torch.testing.assert_close(under_plan, built, rtol=0, atol=1e-6)
    assert not torch.allclose(under_plan, identity, atol=1e-4)  # the plan changed something
    if fam.per_layer_fields and plan_name == "interchange_1_2":
        # control: the same permuted weights with the per-layer lists left in place differ,
        # so the check above can tell a block that kept its type from one that did not
        wrong_cfg = copy.deepcopy(base.config)
        wrong = type(base)(wrong_cfg).eval()
        wrong.load_state_dict(_model_for_plan(fam, base, plan).state_dict())
        with torch.no_grad():
            assert not torch.allclose(wrong(**batch, use_cache=False).logits, under_plan, atol=1e-4)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("refused", REFUSED, ids=[r.name for r in REFUSED])
def test_unmappable_families_are_refused_by_name(refused):
    model = build(refused)
    before_state = _state(model)
    before_cfg = copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError) as err:
        remove_layers(model, [1, 3])
    for word in refused.error_names:
        assert word in str(err.value)
    assert model.config.to_dict() == before_cfg
    assert len(decoder_blocks(model)[2]) == NUM_BLOCKS
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())


def test_unknown_per_layer_list_is_refused_by_name():
    model = build("llama")
    cfg = decoder_config(model)
    cfg.layer_head_scales = [1.0] * NUM_BLOCKS  # a per-layer list surgery does not know
    with pytest.raises(ValueError, match="layer_head_scales"):
        remove_layers(model, [2])
    assert len(decoder_blocks(model)[2]) == NUM_BLOCKS and cfg.num_hidden_layers == NUM_BLOCKS


def test_support_table_lists_what_these_tests_run():
    module = sys.modules[__name__]
    for function, _ in CHECKS:
        marks = getattr(getattr(module, function), "pytestmark", [])
        params = [m.args for m in marks if m.name == "parametrize" and m.args[0] in ("name", ("name", "set_name"))]
        covered = {v if isinstance(v, str) else v[0] for args in params for v in args[1]}
        assert covered == set(FAMILY_IDS), function
    table = support_table().splitlines()
    assert len(table) == 2 + len(FAMILIES) + len(REFUSED)
    for fam, row in zip(FAMILIES, table[2:]):
        assert row.startswith(f"| {fam.label} |") and row.count("| yes ") == len(CHECKS)
