"""Layer plans (``hf_layerswap.layerplan``): a layer index means the same block at every entry
point (negative indices from the end, numpy integers, any sequence), a model without a
decoder block list is refused by name, and a one-block model has nothing removable."""

from __future__ import annotations

import pytest
import torch
from arch_matrix import NUM_BLOCKS, build, prompts

import hf_layerswap as hl
from hf_layerswap import LayerSwapConfig, prune_loaded_model, remove_layers, score_layers, select_layers
from hf_layerswap.layerplan import num_blocks
from hf_layerswap.scoring import removal_kl


ONE_BLOCK = "a model with one block has nothing removable (at least one block must stay)"


def test_negative_indices_resolve_the_same_everywhere(matrix_llama, matrix_report):
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
    assert removal_kl(matrix_llama, batch, [-2, 1]) == removal_kl(matrix_llama, batch, [1, 4]) > 0
    # selection: protect=-1 is the last block, -2 the one before
    scores = matrix_report.layer_scores("interchange")
    spaced = dict(spacing=0)
    assert (select_layers(matrix_report, 4, protect=(0, -1), **spaced)
            == select_layers(matrix_report, 4, protect=(0, 5), **spaced))
    assert select_layers(matrix_report, 4, protect=(0, -1), **spaced) == [1, 2, 3, 4]
    lowest = min(range(1, NUM_BLOCKS), key=lambda i: scores[i])
    negative = lowest - NUM_BLOCKS
    chosen = select_layers(matrix_report, 1, protect=(0, negative), **spaced)
    assert chosen == select_layers(matrix_report, 1, protect=(0, lowest), **spaced) and chosen != [lowest]
    with pytest.raises(ValueError, match=r"protect entry -7 is out of range: allowed ints in -6..5"):
        select_layers(matrix_report, 1, protect=(-7,))


def test_numpy_integers_are_indices_everywhere(matrix_llama, matrix_report):
    import json

    np = pytest.importorskip("numpy")
    n = np.int64
    assert (select_layers(matrix_report, n(2), spacing=n(0), protect=[n(0), n(-1)])
            == select_layers(matrix_report, 2, spacing=0))
    batch = prompts()
    assert removal_kl(matrix_llama, batch, [n(1), n(3)]) == removal_kl(matrix_llama, batch, [1, 3])
    assert removal_kl(matrix_llama, batch, [np.array([1, 3]), [2]]) == removal_kl(matrix_llama, batch, [[1, 3], [2]])
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


def test_a_one_block_model_has_nothing_removable():
    from hf_layerswap.scoring.rule import check_budget

    model = build("llama", num_blocks=1)
    calls = [
        ("num_to_remove=1: ", lambda: hl.prune_loaded_model(model, hl.LayerSwapConfig(
            num_to_remove=1, calibration=prompts(), progress=False))),
        ("num_to_remove=1: ", lambda: check_budget(1, 1)),
        ("removing [0] would leave no block: ", lambda: hl.remove_layers(model, [0])),
        ("removing [0] would leave no block: ", lambda: hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[-1]))),
        ("the model has 1 block(s); swap tests need at least 2, and ",
         lambda: hl.score_layers(model, prompts(), progress=False)),
    ]
    for prefix, call in calls:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == prefix + ONE_BLOCK
        assert "1..0" not in str(err.value)
    assert num_blocks(model) == 1
