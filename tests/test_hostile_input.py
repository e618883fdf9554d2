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
import warnings
from pathlib import Path

import pytest
import torch
from arch_matrix import build, prompts, single_thread, tiny_tokenizer
from test_hub import TOKEN, hub  # noqa: F401 (hub: the loopback Hub fixture)

import hf_layerswap as hl
from hf_layerswap.card import render_card
from hf_layerswap.evaluation import perplexity_from_ids
from hf_layerswap.plan import decoder_blocks, num_blocks

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
    config = hl.LayerSwapConfig(num_to_remove=1, calibration=str(calibration), tokenizer=tokenizer,
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
            hl.prune_loaded_model(llama, hl.LayerSwapConfig(num_to_remove=1, calibration=missing, tokenizer=tokenizer,
                                                            progress=False))
    finally:
        handle.remove()
    assert calls == []
    assert num_blocks(llama) == 6


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
                 ["prune", str(checkpoint), str(tmp_path / "out"), "--num-to-remove", "1", "--calibration", str(path)],
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
    from hf_layerswap.rule import check_budget

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
    assert num_blocks(model) == 6
    # explicit layers without an explicit protect are taken as given (block 0 included), and the
    # hidden flag never reaches the serialized config
    hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[0, 5]))
    assert num_blocks(model) == 4 and model.config.layerswap["removed_layers"] == [0, 5]
    assert "_protect_given" not in hl.LayerSwapConfig(layers=[0]).to_dict()
    assert hl.LayerSwapConfig().protect == [0, -1]


# --------------------------------------------------------------------------- 4. calibration shortfall


def test_a_one_line_file_warns_of_the_shortfall_and_tokenizes_only_the_budget(tokenizer, tmp_path):
    import time

    words = ("layer", "block", "swap", "probe", "removal", "prompt")
    line = " ".join(words[k % 6] + str(k % 97) for k in range(1_400_000))  # one line, about 10 MB
    path = tmp_path / "one-line.txt"
    path.write_text(line, encoding="utf-8")
    assert path.stat().st_size > 10_000_000
    t0 = time.perf_counter()
    with pytest.warns(hl.CalibrationShortfallWarning) as caught:
        calib = hl.build_calibration(str(path), tokenizer, num_prompts=4, seq_len=16)
    seconds = time.perf_counter() - t0
    # the character tokenizer would make 10 million tokens of the whole line; 16 are needed
    assert seconds < 3.0, seconds
    assert (calib.num_prompts, calib.num_tokens) == (1, 16)
    assert calib.input_ids[0].tolist() == tokenizer(line[:16])["input_ids"]
    message = str(caught[0].message)
    assert "4 prompt(s) requested, the source gave 1 (16 real tokens of the 64 that 4 x 16 could hold)" in message
    assert "file:one-line.txt" in message
    assert calib.spec()["shortfall"] == {"requested_prompts": 4, "prompts": 1, "max_tokens": 64, "tokens": 16}


def test_prefix_tokenizing_gives_the_whole_text_tokens(tokenizer):
    from hf_layerswap.calibration import encode_prefixes

    texts = [" ".join(PARAGRAPHS * 40), "x" * 5000, "short", PARAGRAPHS[0], "\n".join(PARAGRAPHS * 30)]
    for seq_len in (2, 16, 100, 400):
        assert encode_prefixes(tokenizer, texts, seq_len) == tokenizer(
            texts, add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]


@pytest.mark.slow
def test_prefix_tokenizing_matches_a_real_tokenizer(smollm2, wikitext_test_raw):
    from hf_layerswap.calibration import encode_prefixes, split_paragraphs

    _, real = smollm2
    paras = split_paragraphs(wikitext_test_raw.read_text(encoding="utf-8"))
    texts = [" ".join(paras[k:k + 40]) for k in range(0, 200, 40)] + paras[:60] + ["\n".join(paras[:30])]
    for seq_len in (2, 16, 512):
        assert encode_prefixes(real, texts, seq_len) == real(
            texts, add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]


def test_a_calibration_shortfall_is_recorded_in_the_report_and_the_card(tokenizer, tmp_path):
    path = _write_text(tmp_path / "two.txt", PARAGRAPHS[:2])
    model = build("llama")
    config = hl.LayerSwapConfig(num_to_remove=1, strategy="greedy", calibration=str(path), tokenizer=tokenizer,
                                num_prompts=5, seq_len=24, batch_size=2, progress=False)
    with pytest.warns(hl.CalibrationShortfallWarning, match=re.escape(
            "5 prompt(s) requested, the source gave 2 (48 real tokens of the 120 that 5 x 24 could hold)")):
        hl.prune_loaded_model(model, config)
    record = {"requested_prompts": 5, "prompts": 2, "max_tokens": 120, "tokens": 48}
    report = model.layerswap_report
    assert report.metadata["calibration"]["shortfall"] == record
    assert report.summary_dict()["calibration"]["shortfall"] == record
    assert hl.SwapReport.from_dict(report.to_dict()).metadata["calibration"]["shortfall"] == record
    card = str(render_card(model, report=report))
    assert ("| Shortfall | **fewer prompts than requested**: 5 prompt(s) requested, the source gave 2 (48 real "
            "tokens of the 120 that 5 x 24 could hold) |") in card
    # a set that fills the request records nothing and warns nothing
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.CalibrationShortfallWarning)
        full = hl.build_calibration(PARAGRAPHS, tokenizer, num_prompts=6, seq_len=24)
    assert "shortfall" not in full.spec() and full.shortfall is None


def test_recovery_warns_when_the_calibration_holds_fewer_tokens_than_requested(tokenizer):
    from hf_layerswap.recovery import recover

    model = build("llama")
    calib = hl.build_calibration(PARAGRAPHS, tokenizer, num_prompts=6, seq_len=24)
    with pytest.warns(hl.CalibrationShortfallWarning, match=re.escape(
            "recovery fitted on 144 calibration tokens, fewer than the 1,000 requested (num_tokens)")):
        recover(model, [2], calib, method="ghosted", num_tokens=1000)
    assert model.config.layerswap["recovery"]["num_tokens"] == 144
    assert model.config.layerswap["recovery"]["requested_tokens"] == 1000


def test_recovery_by_default_uses_the_whole_calibration_set_without_a_warning(tokenizer):
    """``num_tokens`` defaults to "every token, at most 65,536": the user path
    (``LayerSwapConfig(recovery="ghosted")``, 64 x 128 prompts) must not warn on every load."""
    from hf_layerswap.recovery import recover

    model = build("llama")
    calib = hl.build_calibration(PARAGRAPHS, tokenizer, num_prompts=6, seq_len=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.CalibrationShortfallWarning)
        recover(model, [2], calib, method="ghosted")
        hl.prune_loaded_model(build("llama"), hl.LayerSwapConfig(
            layers=[2], recovery="ghosted", calibration=PARAGRAPHS, tokenizer=tokenizer, num_prompts=6, seq_len=24))
    record = model.config.layerswap["recovery"]
    assert record["num_tokens"] == 144 and "requested_tokens" not in record


# --------------------------------------------------------------------------- 9. killed saves

_SAVE_AND_BLOCK = """
import sys, time
from pathlib import Path
import hf_layerswap.hub as hub
from transformers import AutoModelForCausalLM

def block(folder, *args, **kwargs):  # the card step: weights and tokenizer are written by now
    Path(sys.argv[3]).write_text(str(folder))
    time.sleep(600)

hub.write_card_files = block
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
hub.save_for_hub(model, sys.argv[2])
"""


def test_a_killed_save_leaves_no_loadable_folder_and_the_next_save_removes_it(tmp_path):
    import signal
    import time

    from transformers import AutoModelForCausalLM

    from hf_layerswap.hub import HELD_CONFIG
    from hf_layerswap.jsonio import STAGING_PREFIX
    from hf_layerswap.jsonio import staging_folder

    checkpoint = tmp_path / "ckpt"
    model = build("llama")
    model.save_pretrained(checkpoint)
    parent = tmp_path / "outputs"
    parent.mkdir()
    # look-alikes that are not ours, and a save of ours that is still running (its lock is held)
    (parent / ".out.tmp-abc").mkdir()
    (parent / ".hf_layerswap-stagingX").mkdir()
    (parent / f"{STAGING_PREFIX}a-file").write_text("not a folder")
    live, lock = staging_folder(parent / "other", "new")

    marker = tmp_path / "reached"
    env = {**os.environ, "PYTHONPATH": str(Path(hl.__file__).parent.parent)}
    child = subprocess.Popen([sys.executable, "-c", _SAVE_AND_BLOCK, str(checkpoint), str(parent / "out"), str(marker)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never reached the card step"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    staging = Path(marker.read_text())
    assert child.returncode == -signal.SIGKILL
    assert staging.parent == parent and staging.name.startswith(f"{STAGING_PREFIX}out.new-")
    assert (staging / "model.safetensors").is_file() and (staging / HELD_CONFIG).is_file()
    assert not (staging / "config.json").exists() and not (parent / "out").exists()
    with pytest.raises((OSError, ValueError), match="config.json"):
        AutoModelForCausalLM.from_pretrained(staging)

    # the next save into the same parent removes the killed save's folder, and nothing else
    hl.save_for_hub(model, parent / "second")
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [".out.tmp-abc", ".hf_layerswap-stagingX", f"{STAGING_PREFIX}a-file", live.name, "second"])
    assert live.is_dir()
    reloaded = AutoModelForCausalLM.from_pretrained(parent / "second")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    os.close(lock)
    assert hl.jsonio.remove_stale_staging(parent) == [live.name] and not live.exists()


def test_a_save_killed_between_its_renames_gets_the_previous_folder_back(tmp_path):
    from hf_layerswap.jsonio import STAGING_PREFIX, remove_stale_staging

    stale = tmp_path / f"{STAGING_PREFIX}run.v2.previous-x1y2z3"
    (stale / "previous").mkdir(parents=True)
    (stale / "previous" / "config.json").write_text("{}")
    assert remove_stale_staging(tmp_path) == [stale.name]
    assert (tmp_path / "run.v2" / "config.json").read_text() == "{}" and not stale.exists()


# --------------------------------------------------------------------------- 11. progress bars


@pytest.fixture
def bars(monkeypatch):
    """Every tqdm bar opened through ``tqdm.auto`` while the test runs: its description,
    total and each update, in order."""
    import tqdm.auto

    opened: list = []

    class Recording(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates: list = []
            opened.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    for name, module in list(sys.modules.items()):  # modules that imported the class itself
        if name.startswith("hf_layerswap") and getattr(module, "tqdm", None) is tqdm.auto.tqdm:
            monkeypatch.setattr(module, "tqdm", Recording)
    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    return opened


def _equal_length_prompts(n: int = 4, length: int = 12) -> dict:
    ids = torch.randint(4, 128, (n, length), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _head_blocks(model) -> float:
    """Output-head multiply-adds per position over a block's parameters (the bar's exchange rate)."""
    block = decoder_blocks(model)[2][0]
    vocab, hidden = model.get_output_embeddings().weight.shape
    return vocab * hidden / sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize("vocab_chunk", [None, 40])
def test_the_scoring_bar_counts_block_passes_as_they_run(bars, vocab_chunk):
    model = build("llama")  # 6 blocks
    report = hl.score_layers(model, _equal_length_prompts(), num_prompts=4, batch_size=2, progress=True,
                             vocab_chunk=vocab_chunk)
    (bar,) = [b for b in bars if b.desc == "swap-KL probes"]
    meta = report.metadata
    probes, batches, positions = meta["distinct_probes"], 2, 2 * 12
    # the total is the engine's own work: block passes plus the head rows at the head's exchange rate
    assert bar.total == round(meta["block_evaluations"] + _head_blocks(model) * meta["head_rows"] / positions)
    assert sum(bar.updates) == bar.n == bar.total
    # one move per forward pass at least (the reference and every probe, each batch), none bigger
    # than a whole-model pass: no batch arrives in one jump at its end
    assert len(bar.updates) >= batches * (1 + probes)
    assert bar.updates.count(1) >= meta["block_evaluations"]  # a step for every block run
    assert max(bar.updates) <= 6
    assert bar.unit == " block pass"


def test_the_perplexity_bar_counts_tokens_per_batch_of_windows(bars, llama, tokenizer):
    result = hl.evaluate_perplexity(llama, PARAGRAPHS, tokenizer=tokenizer, window=32, stride=16, batch_size=2,
                                    bootstrap=0, progress=True)
    (bar,) = [b for b in bars if b.desc == "perplexity windows"]
    windows = result.windows
    fed = sum(min(begin + 32, result.contract["num_input_tokens"]) - begin
              for begin in range(0, result.contract["num_input_tokens"] - 16, 16))
    assert bar.total == fed and sum(bar.updates) == fed
    assert len(bar.updates) >= windows // 2
    assert max(bar.updates) == 2 * 32
    hl.evaluate_perplexity(llama, PARAGRAPHS, tokenizer=tokenizer, window=32, stride=16, bootstrap=0, progress=False)
    assert all(b.disable for b in bars[1:])


def test_the_search_bar_shows_the_block_passes_of_each_batch_of_sets(bars, llama, tokenizer):
    calib = hl.build_calibration(PARAGRAPHS, tokenizer, num_prompts=6, seq_len=24)
    hl.search_select(None, 2, model=llama, calibration=calib, max_evaluations=12, batch_size=2, progress=True)
    sets = [b for b in bars if b.desc.startswith("removal-set search")]
    inner = [b for b in bars if b.desc == "removal KL of the candidate sets"]
    assert len(sets) == 1 and inner
    for bar in inner:  # each call of the objective: its own bar, moving per forward pass
        assert sum(bar.updates) == bar.total and max(bar.updates) <= 6
    assert sum(len(b.updates) for b in inner) > 3 * len(sets[0].updates)


# --------------------------------------------------------------------------- 12. re-pruning numbering


def test_layers_on_a_pruned_checkpoint_name_its_current_blocks_and_the_card_shows_both(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build("llama", num_blocks=8)
    first = tmp_path / "first"
    hl.save_for_hub(hl.prune_loaded_model(model, hl.LayerSwapConfig(layers=[1, 4])), first)  # 6 blocks left
    again = AutoModelForCausalLM.from_pretrained(first, quantization_config=hl.LayerSwapConfig(layers=[2]))
    steps = again.config.layerswap["steps"]
    # current block 2 of the 6 is original block 3 (0, 2, 3, 5, 6, 7 were left)
    assert [(s["num_blocks_before"], s["removed_layers"], s["removed_original_layers"]) for s in steps] == [
        (8, [1, 4], [1, 4]), (6, [2], [3])]
    assert again.config.layerswap["removed_layers"] == [1, 3, 4]
    assert again.config.layerswap["kept_layers"] == [0, 2, 5, 6, 7]
    second = tmp_path / "second"
    hl.save_for_hub(again, second)
    third = AutoModelForCausalLM.from_pretrained(second, quantization_config=hl.LayerSwapConfig(layers=[-1, 0]))
    assert third.config.layerswap["kept_layers"] == [2, 5, 6]
    card = str(render_card(third))
    assert ("Removal ran in 3 steps. Each step numbered the blocks of the checkpoint it\nstarted from (what "
            "`layers=` named then); the original numbering is the base model's:") in card
    table = card[card.index("| Step | Blocks before"):].split("\n\n")[0].splitlines()
    assert table == [
        "| Step | Blocks before | Removed (numbering at that step) | Removed (original numbering) | Selection |",
        "|---|---|---|---|---|",
        "| 0 | 8 | 1, 4 | 1, 4 | explicit layers |",
        "| 1 | 6 | 2 | 3 | explicit layers |",
        "| 2 | 5 | 0, 4 | 0, 7 | explicit layers |",
    ]
    assert "| Removed blocks (0-based, original numbering) | 0, 1, 3, 4, 7 |" in card
    doc = hl.LayerSwapConfig.__doc__ or hl.LayerSwapConfig.__init__.__doc__
    assert "*current* block 2" in doc
