"""One pipeline behind every entry point: the same cut made through
``from_pretrained(..., quantization_config=LayerSwapConfig(...))`` + ``save_for_hub``,
``hf-layerswap prune`` and ``hf-layerswap demo`` writes the same ``config.json`` and the
same model card, byte for byte apart from wall-clock timings."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hf_layerswap as hl
from hf_layerswap.cli import main
from hf_layerswap.pipeline import PruneResult, prune
from hf_layerswap.layerplan import num_blocks
from hf_layerswap.scoring.report import PruneProvenance

#: The only run-dependent values in the written files: wall-clock seconds. In config.json
#: they are the ``seconds`` of each search cost record (``cost``, ``total_cost``); in the
#: card, the scoring's "Wall time" row.
# what a run spends, which differs between the paths where the demo's final search takes the set
# values its comparison search measured (``reused``) rather than scoring them again
TIMING_KEYS = ("seconds", "reused", "forward_passes", "block_passes", "head_passes", "reference_passes")
CARD_TIMINGS = (re.compile(r"(\| Wall time \| )[0-9.]+ s( \|)"),
                re.compile(r"(candidate sets)(?:, [0-9]+ of them valued by an earlier search[^,]*, with no pass)?, "
                           r"[0-9]+( forward passes)"))

NUM_PROMPTS, SEQ_LEN, BATCH = 4, 24, 2

# the tiny sources are small on purpose (a repair asks for 65,536 tokens): their shortfall is not under test here
pytestmark = pytest.mark.filterwarnings("ignore::hf_layerswap.calibration.CalibrationShortfallWarning")


def _tiny_checkpoint(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = tiny_config("qwen3")
    config.max_position_embeddings = 512  # the matched perplexity contract's window
    model = AutoModelForCausalLM.from_config(config).eval()
    vocab = {f"w{i}": i for i in range(model.config.vocab_size - 1)}
    vocab["[UNK]"] = model.config.vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    model.save_pretrained(path)
    return path


def _text_file(path, n=6, offset=0):
    paragraphs = [" ".join(f"w{(7 * p + 3 * k + offset) % 120}" for k in range(30)) for p in range(n)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def _without_timings(x):
    if isinstance(x, dict):
        return {k: (0 if k in TIMING_KEYS else _without_timings(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def _config_json(folder) -> str:
    return json.dumps(_without_timings(json.loads((folder / "config.json").read_text())), indent=2)


def _card(folder) -> str:
    text = (folder / "README.md").read_text()
    for pattern in CARD_TIMINGS:
        text = pattern.sub(r"\g<1>0\g<2>", text)
    return text


def _assert_same_files(reference, *others):
    for other in others:
        assert _config_json(other) == _config_json(reference), other.name
        assert _card(other) == _card(reference), other.name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    base = _tiny_checkpoint(root / "base")
    calib = _text_file(root / "calib.txt")
    held_out = _text_file(root / "held_out.txt", n=4, offset=5)
    return root, base, calib, held_out


def _plugin(base, out, *, evaluation_text=None, **fields):
    """The cut through from_pretrained's quantizer plugin, saved with save_for_hub."""
    cfg = hl.LayerSwapConfig(num_prompts=NUM_PROMPTS, seq_len=SEQ_LEN, batch_size=BATCH, **fields)
    tokenizer = AutoTokenizer.from_pretrained(base)
    evaluation = None
    if evaluation_text is not None:  # what the demo measures: the base model, then the pruned one
        dense = AutoModelForCausalLM.from_pretrained(base)
        evaluation = {"base": hl.evaluate_perplexity(dense, str(evaluation_text), tokenizer=tokenizer)}
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg)
    if evaluation is not None:
        evaluation["pruned"] = hl.evaluate_perplexity(model, str(evaluation_text), tokenizer=tokenizer)
    hl.save_for_hub(model, out, tokenizer=tokenizer, report=getattr(model, "layerswap_report", None),
                    evaluation=evaluation)
    return model


def _budget_flags(calib):
    return ["--calibration", str(calib), "--num-prompts", str(NUM_PROMPTS), "--seq-len", str(SEQ_LEN),
            "--batch-size", str(BATCH)]


def test_search_cut_is_written_identically_by_plugin_cli_and_demo(setup, capsys):
    root, base, calib, held_out = setup
    model = _plugin(base, root / "plugin", calibration=str(calib), num_to_remove=2, max_evaluations=12)
    _plugin(base, root / "plugin-eval", evaluation_text=held_out, calibration=str(calib), num_to_remove=2,
            max_evaluations=12)
    assert main(["prune", str(base), str(root / "cli"), "--num-to-remove", "2", "--max-evaluations", "12",
                 *_budget_flags(calib)]) == 0
    # the demo's own perplexity default reads 1,000 words; the plugin's contract reads 5,000
    assert main(["demo", "--model", str(base), "--output", str(root / "demo"), "--eval-max-words", "5000",
                 "--budgets", "1", "--final-num-to-remove", "2",
                 "--max-evaluations", "12", "--eval-text", str(held_out), *_budget_flags(calib)]) == 0
    out = capsys.readouterr().out
    removed = model.config.layerswap["removed_layers"]
    assert f"removed layers {removed} (0-based)" in out and f"final: removed {removed} (strategy search" in out
    _assert_same_files(root / "plugin", root / "cli")
    _assert_same_files(root / "plugin-eval", root / "demo")
    step = json.loads((root / "cli" / "config.json").read_text())["layerswap"]["steps"][0]
    assert PruneProvenance.from_dict(step).config == hl.LayerSwapConfig(
        num_to_remove=2, max_evaluations=12, calibration="calib.txt", num_prompts=NUM_PROMPTS, seq_len=SEQ_LEN,
        batch_size=BATCH).to_dict()
    assert step["strategy"] == "search" and step["decision"]["selected"] == removed


def test_greedy_cut_scores_one_protocol_and_records_its_spacing_on_every_path(setup):
    """``--strategy greedy --protocol interchange --spacing 2``: the CLI used to score both
    protocols and to write no selection config, so its card recomputed the protocol sets
    with spacing 1."""
    root, base, calib, _ = setup
    model = _plugin(base, root / "g-plugin", calibration=str(calib), num_to_remove=2, strategy="greedy",
                    protocol="interchange", spacing=2)
    assert main(["prune", str(base), str(root / "g-cli"), "--num-to-remove", "2", "--strategy", "greedy",
                 "--protocol", "interchange", "--spacing", "2", *_budget_flags(calib)]) == 0
    _assert_same_files(root / "g-plugin", root / "g-cli")
    saved = hl.SwapReport.from_json(root / "g-cli" / "layerswap_report.json")
    assert saved.protocols == ("interchange",)
    removed = model.config.layerswap["removed_layers"]
    assert removed == hl.select_layers(saved, 2, protocol="interchange", spacing=2)
    assert abs(removed[0] - removed[1]) > 2
    card = _card(root / "g-cli")
    assert "spacing=2, protect=[0, -1]" in card and "spacing=1" not in card


def test_auto_cut_matches_between_plugin_cli_and_demo(setup, capsys):
    root, base, calib, held_out = setup
    _plugin(base, root / "a-plugin", calibration=str(calib), num_to_remove=1, strategy="auto", protocol="auto")
    _plugin(base, root / "a-plugin-eval", evaluation_text=held_out, calibration=str(calib), num_to_remove=1,
            strategy="auto", protocol="auto")
    assert main(["prune", str(base), str(root / "a-cli"), "--num-to-remove", "1", "--strategy", "auto",
                 "--protocol", "auto", *_budget_flags(calib)]) == 0
    assert main(["demo", "--model", str(base), "--output", str(root / "a-demo"), "--eval-max-words", "5000",
                 "--budgets", "1", "--final-num-to-remove",
                 "1", "--final-strategy", "greedy", "--final-protocol", "auto", "--eval-text", str(held_out),
                 *_budget_flags(calib)]) == 0
    capsys.readouterr()
    _assert_same_files(root / "a-plugin", root / "a-cli")
    _assert_same_files(root / "a-plugin-eval", root / "a-demo")


def test_prune_reuses_a_given_report_and_calibration(setup):
    """A precomputed report and prompts are used as given: nothing is scored again, and the
    result equals the pipeline's own scoring."""
    _, base, _, _ = setup
    batch = hl.build_calibration({"input_ids": torch.arange(1, 25).reshape(3, 8) % 120,
                                  "attention_mask": torch.ones(3, 8, dtype=torch.long)})
    cfg = hl.LayerSwapConfig(num_to_remove=2, strategy="greedy", calibration=batch, progress=False)
    scored = prune(AutoModelForCausalLM.from_pretrained(base), cfg)
    assert isinstance(scored, PruneResult) and scored.report.protocols == ("interchange",)
    model = AutoModelForCausalLM.from_pretrained(base)
    report = hl.score_layers(model, batch, progress=False)
    calls = []
    original = hl.steps.score_layers
    hl.steps.score_layers = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        given = prune(model, cfg, report=report, calibration=batch)
    finally:
        hl.steps.score_layers = original
    assert calls == [] and given.report is report and model.layerswap_report is report
    assert given.removed == scored.removed == hl.select_layers(report, 2)
    assert given.calibration is batch and given.provenance.calibration == batch.spec()
    assert model.config.layerswap["steps"][0]["selection"] == given.provenance.selection


def test_prune_refuses_a_report_without_the_protocol_it_reads(setup):
    _, base, _, _ = setup
    model = AutoModelForCausalLM.from_pretrained(base)
    batch = {"input_ids": torch.arange(1, 17).reshape(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    report = hl.score_layers(model, batch, protocols=["replacement"], progress=False)
    cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", protocol="interchange", calibration=batch)
    with pytest.raises(ValueError) as err:
        prune(model, cfg, report=report)
    assert str(err.value) == ("the report scored ['replacement'] but strategy='greedy' with protocol='interchange' "
                              "reads ['interchange']: score those protocols or choose another strategy")
    assert getattr(model.config, "layerswap", None) is None


def test_prune_refuses_a_report_without_the_protocols_score_protocols_asks_for(setup):
    # sleb reads no swap-KL score, but score_protocols asks for the replacement tables: a given
    # report without them would publish a card without the tables the config asked for
    _, base, _, _ = setup
    model = AutoModelForCausalLM.from_pretrained(base)
    batch = {"input_ids": torch.arange(1, 17).reshape(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    report = hl.score_layers(model, batch, protocols=["interchange"], progress=False)
    cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="sleb", score_protocols=["replacement", "interchange"],
                             calibration=batch)
    with pytest.raises(ValueError) as err:
        prune(model, cfg, report=report)
    assert str(err.value) == ("the report scored ['interchange'] but score_protocols=['replacement', 'interchange'] "
                              "asks for ['replacement']: give a report that scored them, or drop score_protocols")
    assert getattr(model.config, "layerswap", None) is None
    asked = hl.LayerSwapConfig(num_to_remove=1, strategy="sleb", score_protocols=["interchange"], calibration=batch)
    assert prune(model, asked, report=report).report is report  # the report holds what is asked for


def test_repair_and_sparsity_cut_is_the_same_through_the_cli(setup):
    """``prune --recovery fused --sparsity 0.5``: the CLI used to have neither."""
    root, base, calib, _ = setup
    model = _plugin(base, root / "r-plugin", calibration=str(calib), layers=[2, 3], recovery="fused", sparsity=0.5,
                    allocation="uniform")
    assert main(["prune", str(base), str(root / "r-cli"), "--layers", "2", "3", "--recovery", "fused",
                 "--sparsity", "0.5", "--allocation", "uniform", *_budget_flags(calib)]) == 0
    _assert_same_files(root / "r-plugin", root / "r-cli")
    record = model.config.layerswap
    assert record["removed_layers"] == [2, 3] and record["recovery"]["method"] == "fused"
    assert (root / "r-cli" / "layerswap_sparsity.json").is_file()
    assert json.loads((root / "r-cli" / "config.json").read_text())["layerswap_sparsity"]["target_sparsity"] == 0.5


# ------------------------------------------- non-finite scores: prune refuses


def test_prune_refuses_and_leaves_the_model_as_it_was(overflow):
    model, calibration, _ = overflow
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(hl.NonFiniteScoresError, match=r"^cannot select 1 block\(s\) on finite interchange"):
            hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, calibration=calibration, progress=False))
    assert num_blocks(model) == 6 and getattr(model.config, "layerswap", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_search_cap_below_its_first_sweep_is_refused_before_the_scoring():
    """max_evaluations below one set per removable block: prune refuses it before a forward
    pass (it stopped the search after the scoring), and estimate_cost refuses it too."""
    model = tiny_model("llama", num_blocks=12)
    calls = []
    for block in model.model.layers:
        block.register_forward_hook(lambda *_: calls.append(1))
    config = hl.LayerSwapConfig(num_to_remove=3, strategy="search", max_evaluations=5, progress=False)
    ids = torch.arange(1, 33).reshape(4, 8) % 100
    calibration = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    message = r"max_evaluations=5: at least 10 \(one per removable block\)"  # blocks 0 and 11 protected
    with pytest.raises(ValueError, match=message):
        prune(model, config, calibration=calibration)
    assert calls == []
    with pytest.raises(ValueError, match=message):
        hl.estimate_cost(model.config, config)


def test_prune_warns_before_any_forward_for_a_step_the_budget_cannot_slice():
    """A sparsification whose cached block inputs and outputs exceed the one budget, and a
    repair whose float64 moments exceed it on a CPU, each warn MemoryBudgetWarning naming the
    step, its need and the budget before the scoring's first forward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_layerswap.scoring.settings import MemoryBudgetWarning

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 512, (16, 64), generator=torch.Generator().manual_seed(0))
    calib = hl.CalibrationSet(ids, torch.ones_like(ids), "random tokens")
    # 16 prompts x 64 tokens x 256 x 4 bytes, in and out: 2 MiB of cached streams, beyond 1 MiB
    for config, step in ((dict(sparsity=0.5), "the sparsification"), (dict(recovery="ghosted"), "the ghosted repair")):
        cfg = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", num_prompts=16, seq_len=64, progress=False,
                                 **config)
        forwards = []
        handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", MemoryBudgetWarning)
                with pytest.raises(MemoryBudgetWarning, match=rf"{step}.* needs [\d,.]+ MiB beyond the weights, more "
                                                              r"than max_memory=1\.0 MiB"):
                    hl.prune(model, cfg, calibration=calib, max_memory="1MiB")
        finally:
            handle.remove()
        assert forwards == [] and len(model.model.layers) == 4
