"""Input a hostile or careless user gives: private paths that must not be published, paths
that do not exist, files that are not text, models that are not causal LMs, budgets and
configs that cannot be met, reports of another model, interrupted saves, and what the
command line prints and exits with. Each test fails on the defect it names."""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_matrix import build, prompts, single_thread, tiny_tokenizer
from test_hub import TOKEN, hub  # noqa: F401 (hub: the loopback Hub fixture)

import hf_layerswap as hl
from hf_layerswap.evaluation import perplexity_from_ids

PARAGRAPHS = [
    "Layer removal keeps the kept blocks in order, and the cache is renumbered after the cut.",
    "A swap probe runs the model under a temporary plan and restores the original plan exactly.",
    "Interchange swaps two neighbouring blocks; replacement runs one block twice in a row here.",
    "The calibration prompts are real prose, split at blank lines and truncated to a budget.",
    "Perplexity is measured in sliding windows, and only the new tokens of a window are scored.",
    "A model card records the removed blocks, the scores of both protocols and the contract.",
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _write_text(path: Path, paragraphs=PARAGRAPHS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- 1. local paths


def _fetch_every_file(hub, repo_id: str, out: Path) -> Path:  # noqa: F811 (hub: the fixture's server)
    """Download every file of ``repo_id`` through the stand-in, in a fresh process (the
    download helpers read the endpoint when huggingface_hub is imported)."""
    script = "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], local_dir=sys.argv[2])"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(out.parent / "hf_home"), HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0",
               HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run([sys.executable, "-c", script, repo_id, str(out)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_published_files_carry_no_local_path_component(hub, tmp_path):  # noqa: F811 (fixture)
    from transformers import AutoModelForCausalLM

    user = getpass.getuser()
    home = tmp_path / "home" / f"{user}-x7q" / "private projects" / "run-2031"
    checkpoint = home / "ckpt-final"
    build("llama").save_pretrained(checkpoint)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(checkpoint)
    calibration = _write_text(home / "calib data" / "valid.txt")
    eval_text = _write_text(home / "eval data" / "held-out.txt", PARAGRAPHS[::-1])

    base = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    config = hl.LayerSwapConfig(num_layers=1, calibration=str(calibration), tokenizer=tokenizer,
                                num_prompts=4, seq_len=24, batch_size=2, progress=False)
    pruned = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config,
                                                  attn_implementation="eager").eval()
    options = dict(tokenizer=tokenizer, window=64, stride=32, bootstrap=20)
    evaluation = {"base": hl.evaluate_perplexity(base, eval_text, **options),
                  "pruned": hl.evaluate_perplexity(pruned, eval_text, **options)}
    # the identity names the folder and the weights, nothing above the folder
    assert evaluation["base"].contract["model"]["name"] == "ckpt-final"
    assert len(evaluation["base"].contract["model"]["fingerprint"]) == 64
    assert pruned.layerswap_report.metadata["model"]["name"] == "ckpt-final"

    hl.push_to_hub(pruned, "user/private-check", tokenizer=tokenizer, report=pruned.layerswap_report,
                   evaluation=evaluation, token=TOKEN, endpoint=hub.url)
    fetched = _fetch_every_file(hub, "user/private-check", tmp_path / "fetched")
    files = {p.relative_to(fetched).as_posix(): p.read_bytes() for p in fetched.rglob("*")
             if p.is_file() and ".cache" not in p.relative_to(fetched).parts}
    assert {"config.json", "model.safetensors", "README.md", "layerswap_report.json",
            "layerswap_evaluation.json", "tokenizer.json"} <= set(files)
    assert files == hub.files("user/private-check") | {".gitattributes": files[".gitattributes"]}

    private = {part for path in (checkpoint, calibration, eval_text) for part in path.parent.parts if part != "/"}
    private |= {user, str(tmp_path)}
    leaks = {name: sorted(part for part in private if part.encode() in data) for name, data in files.items()}
    assert {name: parts for name, parts in leaks.items() if parts} == {}
    # the folder and file names may be named, but only bare, never after a separator
    for bare in ("ckpt-final", "valid.txt", "held-out.txt"):
        behind_separator = [name for name, data in files.items() if re.search(rb"[/\\]" + re.escape(bare.encode()), data)]
        assert behind_separator == []
    assert b'"ckpt-final"' in files["layerswap_report.json"]


# --------------------------------------------------------------------------- 2. missing files


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _count_forwards(model) -> list:
    calls: list = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("name", ["my data/wiki.test.raw", "wiki.test.raw", "notes.TXT", "corpus/held-out"])
def test_a_missing_file_is_refused_not_scored_as_text(llama, tokenizer, tmp_path, name):
    missing = str(tmp_path / name) if "/" in name else name
    calls, handle = _count_forwards(llama)
    try:
        with pytest.raises(FileNotFoundError) as err:
            hl.evaluate_perplexity(llama, missing, tokenizer=tokenizer, bootstrap=0)
        assert repr(missing) in str(err.value) and "no such file" in str(err.value)
        assert "list of strings" in str(err.value)
        for call in (lambda: hl.score_layers(llama, missing, tokenizer=tokenizer, progress=False),
                     lambda: hl.build_calibration(missing, tokenizer)):
            with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
                call()
        with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
            hl.prune_loaded_model(llama, hl.LayerSwapConfig(num_layers=1, calibration=missing, tokenizer=tokenizer,
                                                            progress=False))
    finally:
        handle.remove()
    assert calls == []
    assert hl.num_blocks(llama) == 6


def test_literal_text_that_looks_like_a_path_goes_in_a_list(llama, tokenizer):
    path_like = "see docs/usage.txt"
    as_list = hl.evaluate_perplexity(llama, [path_like], tokenizer=tokenizer, window=16, stride=8, bootstrap=0)
    assert as_list.contract["source"] == "list of 1 strings"
    assert as_list.tokens == len(path_like) - 1  # one token per character, the first is context only
    # prose with no separator and no file suffix stays text, and so does several lines of it
    prose = hl.evaluate_perplexity(llama, "A plain sentence, no path.", tokenizer=tokenizer, window=16, stride=8,
                                   bootstrap=0)
    assert prose.contract["source"] == "string" and prose.tokens == 25
    lines = hl.evaluate_perplexity(llama, "first line with a/b\nsecond line.txt", tokenizer=tokenizer, window=16,
                                   stride=8, bootstrap=0)
    assert lines.contract["source"] == "string"


# --------------------------------------------------------------------------- 3. binary files


@pytest.mark.parametrize("kind", ["random bytes", "utf-16", "nul bytes"])
def test_a_file_that_is_not_text_is_refused_before_any_forward_pass(llama, tokenizer, tmp_path, kind):
    path = tmp_path / "b.bin"
    if kind == "random bytes":
        path.write_bytes(bytes(np_random_bytes(4096)))
    elif kind == "utf-16":
        path.write_bytes("\n\n".join(PARAGRAPHS).encode("utf-16"))
    else:
        path.write_bytes(("\n\n".join(PARAGRAPHS) + "\0\0\0").encode("utf-8"))
    calls, handle = _count_forwards(llama)
    try:
        for what, call in (
            ("calibration", lambda: hl.score_layers(llama, str(path), tokenizer=tokenizer, progress=False)),
            ("calibration", lambda: hl.score_layers(llama, path, tokenizer=tokenizer, progress=False)),
            ("text", lambda: hl.evaluate_perplexity(llama, str(path), tokenizer=tokenizer, bootstrap=0)),
            ("text", lambda: hl.evaluate_perplexity(llama, path, tokenizer=tokenizer, bootstrap=0)),
        ):
            with pytest.raises(ValueError) as err:
                call()
            assert type(err.value) is ValueError  # not a bare UnicodeDecodeError
            message = str(err.value)
            assert message.startswith(f"{what}={str(path)!r} is not a text file"), message
            assert "allowed: UTF-8 text" in message
    finally:
        handle.remove()
    assert calls == []


def np_random_bytes(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def test_cli_refuses_a_binary_calibration_file_before_loading(tmp_path, capsys):
    from hf_layerswap.cli import main

    path = tmp_path / "b.bin"
    path.write_bytes(bytes(np_random_bytes(4096)))
    checkpoint = tmp_path / "ckpt"
    build("llama").save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    capsys.readouterr()
    for argv in (["score", str(checkpoint), "--calibration", str(path), "-o", str(tmp_path / "r.json")],
                 ["prune", str(checkpoint), str(tmp_path / "out"), "--num-layers", "1", "--calibration", str(path)],
                 ["demo", "--model", str(checkpoint), "--eval-text", str(path), "--output", str(tmp_path / "demo")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and f"{str(path)!r} is not a text file" in err and "UTF-8" in err
        assert "loading" not in err
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 5. non-causal models


def test_perplexity_refuses_a_model_without_a_language_model_head(tokenizer):
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    bert = BertModel(BertConfig(vocab_size=128, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32)).eval()
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2)).eval()
    for model, message in ((bert, "BertModel has no language-model head (get_output_embeddings() is None)"),
                           (t5, "T5ForConditionalGeneration is an encoder-decoder model")):
        calls, handle = _count_forwards(model)
        try:
            with pytest.raises(ValueError, match=re.escape(message)):
                hl.evaluate_perplexity(model, PARAGRAPHS, tokenizer=tokenizer, bootstrap=0)
            with pytest.raises(ValueError, match=re.escape(message)):
                perplexity_from_ids(model, torch.arange(4, 40), window=16, stride=8, bootstrap=0)
        finally:
            handle.remove()
        assert calls == []


# --------------------------------------------------------------------------- 6. one-block models

ONE_BLOCK = "a model with one block has nothing removable (at least one block must stay)"


def test_a_one_block_model_has_nothing_removable():
    from hf_layerswap.selection import check_budget

    model = build("llama", num_layers=1)
    calls = [
        ("num_layers=1: ", lambda: hl.prune_loaded_model(model, hl.LayerSwapConfig(
            num_layers=1, calibration=prompts(), progress=False))),
        ("num_layers=1: ", lambda: check_budget(1, 1)),
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
    assert hl.num_blocks(model) == 1


# --------------------------------------------------------------------------- 8. contradictory config


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
    assert hl.num_blocks(model) == 6
    # explicit layers without an explicit protect are taken as given (block 0 included), and the
    # hidden flag never reaches the serialized config
    hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[0, 5]))
    assert hl.num_blocks(model) == 4 and model.config.layerswap["removed_layers"] == [0, 5]
    assert "_protect_given" not in hl.LayerSwapConfig(layers=[0]).to_dict()
    assert hl.LayerSwapConfig().protect == [0, -1]
