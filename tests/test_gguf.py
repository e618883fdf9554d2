"""GGUF export: the per-layer layout checks (what llama.cpp can and cannot express), the
converter run end to end on tiny pruned models (read back with gguf.GGUFReader and with
transformers' GGUF loader), a real pruned SmolLM2 (slow), and llama.cpp itself on a pruned
tiny Gemma-3 whose prompt is longer than its sliding window (needs llama-cpp-python)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_matrix import FAMILY_BY_NAME, build, tiny_tokenizer
from conftest import REAL_MODEL_THREADS

import hf_layerswap as hl
from hf_layerswap.cli import main
from hf_layerswap.gguf_export import (
    GGUFConversionError,
    GGUFConverterNotFoundError,
    GGUFLayoutError,
    find_converter,
    gguf_layout,
)

gguf = pytest.importorskip("gguf")

UNDER_CI = os.environ.get("CI", "").lower() == "true"


def _missing(reason: str):
    if UNDER_CI:
        pytest.fail(f"{reason}; under CI its absence is a failure (scripts/install.sh --test installs it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def converter():
    try:
        return find_converter()
    except GGUFConverterNotFoundError as err:
        _missing(f"llama.cpp's converter is not installed: {err}")


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's real tokenizer: one the converter recognises (a GPT-2 style BPE it knows)."""
    from transformers import AutoTokenizer

    from hf_layerswap.models import bundled_checkpoint_dir

    try:
        return AutoTokenizer.from_pretrained(bundled_checkpoint_dir("smollm2-135m"))
    except ModuleNotFoundError as err:
        _missing(f"the bundled SmolLM2 checkpoint is not installed: {err}")


def _pruned(name: str, removed=(1, 3), **config):
    model = build(FAMILY_BY_NAME[name])
    for key, value in config.items():
        setattr(model.config.get_text_config(decoder=True), key, value)
    if removed:
        hl.remove_layers(model, list(removed))
    return model


# ----------------------------------------------------------------------------- layout rules (no converter)


@pytest.mark.parametrize(
    ("name", "removed", "arch", "pattern"),
    [
        # Gemma-3 blocks S S F S S F; keep 0 2 4 5 -> S F S F (llama.cpp's default for 4 blocks: S S S S)
        ("gemma3_text", (1, 3), "gemma3", [True, False, True, False]),
        ("gemma3_mm", (2, 3), "gemma3", [True, True, True, False]),
        # Gemma-2 blocks S F S F S F; keep 0 1 4 5 -> S F S F
        ("gemma2", (2, 3), "gemma2", [True, False, True, False]),
        ("gemma2", (), "gemma2", [True, False, True, False, True, False]),
    ],
)
def test_gemma_layout_is_one_bool_per_kept_block(name, removed, arch, pattern):
    layout = gguf_layout(_pruned(name, removed, query_pre_attn_scalar=8).config)  # head_dim 8
    assert layout.arch == arch and layout.num_blocks == len(pattern)
    assert layout.metadata == {f"{arch}.attention.sliding_window_pattern": pattern}
    assert layout.warnings == []


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_mixed_sliding_and_full_blocks_are_refused_where_llama_cpp_has_no_pattern(name):
    with pytest.raises(GGUFLayoutError, match=r"no per-layer attention type.*\['gemma2', 'gemma3'\]"):
        gguf_layout(_pruned(name, ()).config)
    with pytest.raises(GGUFLayoutError, match=r"blocks \[.*\] use a sliding window"):
        gguf_layout(_pruned(name).config)


def test_gemma_attention_scale_llama_cpp_would_not_use_is_refused():
    from transformers import Gemma3TextConfig

    # the matrix's tiny Gemma-3: head_dim 8 but query_pre_attn_scalar 256 (transformers' default)
    with pytest.raises(GGUFLayoutError, match=r"query_pre_attn_scalar=256.*1/sqrt\(8\) at 4 blocks"):
        gguf_layout(_pruned("gemma3_text").config)

    # not a matrix row on purpose: a "27B-like" model, hidden/heads (16) differs from head_dim (8)
    def cfg(n):
        return Gemma3TextConfig(num_hidden_layers=n, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, query_pre_attn_scalar=16, intermediate_size=64, vocab_size=128)

    assert gguf_layout(cfg(62)).num_blocks == 62  # llama.cpp's 27B depth: hidden / heads
    with pytest.raises(GGUFLayoutError, match=r"1/sqrt\(8\) at 61 blocks.*except at 62 blocks"):
        gguf_layout(cfg(61))  # the same model with one block removed


def test_smollm3_nope_blocks_must_stay_on_llama_cpps_fixed_step():
    def config(removed):
        # the matrix row with SmolLM3's stock NoPE interval (every 4th block) and 32768 positions
        model = build("smollm3", dtype=None, no_rope_layer_interval=4, max_position_embeddings=32768)
        if removed:
            hl.remove_layers(model, removed)
        return model.config

    assert gguf_layout(config([])).arch == "smollm3"  # no_rope_layers [1, 1, 1, 0, 1, 1]: stock
    assert gguf_layout(config([4, 5])).num_blocks == 4  # kept [1, 1, 1, 0]: still every 4th block
    with pytest.raises(GGUFLayoutError, match=r"no_rope_layers=\[1, 1, 0, 1, 1\].*every 4th block \(\[3\]\)"):
        gguf_layout(config([1]))  # block 3 moves to position 2
    with pytest.raises(GGUFLayoutError, match=r"every 4th block"):
        gguf_layout(_pruned("smollm3", ()).config)  # the matrix's NoPE every 3rd block


def test_uniform_sliding_window_warns_and_plain_models_pass():
    mistral = gguf_layout(_pruned("mistral").config)
    assert mistral.metadata == {} and mistral.arch is None
    assert len(mistral.warnings) == 1 and "sliding window of 4 tokens" in mistral.warnings[0]
    for name in ("llama", "phi3", "olmo2", "qwen3_moe", "gpt2"):
        layout = gguf_layout(_pruned(name).config)
        assert (layout.metadata, layout.warnings, layout.num_blocks) == ({}, [], 4)


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    model, tok = _pruned("llama"), tiny_tokenizer()
    with pytest.raises(ValueError, match=r"outtype='q4_k'.*\['f16', 'f32', 'q8_0'\]"):
        hl.save_gguf(model, tmp_path / "m.gguf", tokenizer=tok, outtype="q4_k")
    with pytest.raises(ValueError, match=r"ends in .gguf"):
        hl.save_gguf(model, tmp_path / "m.bin", tokenizer=tok)
    (tmp_path / "old.gguf").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hl.save_gguf(model, tmp_path / "old.gguf", tokenizer=tok)
    with pytest.raises(GGUFConverterNotFoundError, match=r"converter='.*nowhere'.*pip install --no-deps --target"):
        hl.save_gguf(model, tmp_path / "m.gguf", tokenizer=tok, converter=tmp_path / "nowhere")
    with pytest.raises(GGUFLayoutError):
        hl.save_gguf(_pruned("qwen3"), tmp_path / "m.gguf", tokenizer=tok)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hl.export_gguf(tmp_path, tmp_path / "m.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.gguf"]


def test_export_gguf_verb_refuses_a_mixed_qwen3_before_converting(tmp_path, capsys):
    _pruned("qwen3").save_pretrained(tmp_path / "qwen3")
    assert main(["export-gguf", str(tmp_path / "qwen3"), str(tmp_path / "q.gguf"),
                 "--converter", str(tmp_path / "no-converter-needed")]) == 2
    err = capsys.readouterr().err
    assert "error: qwen3: blocks [0, 1, 2] use a sliding window and [3] full attention" in err
    assert not (tmp_path / "q.gguf").exists()


def test_a_failing_converter_leaves_nothing_behind(tmp_path):
    fake = tmp_path / "bin" / "convert_hf_to_gguf.py"
    fake.parent.mkdir()
    fake.write_text("import sys\nsys.exit('tokenizer not recognised')\n")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GGUFConversionError, match=r"(?s)exit 1.*tokenizer not recognised"):
        hl.save_gguf(_pruned("llama"), out / "m.gguf", tokenizer=tiny_tokenizer(), converter=fake)
    assert list(out.iterdir()) == []


# ----------------------------------------------------------------------------- converter end to end


#: Config fields of the tiny models over SmolLM2's vocabulary, apart from the vocabulary size.
_REAL_VOCAB_FIELDS = dict(max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _tiny_real_vocab(kind: str, vocab: int, seed: int = 0):
    """A tiny random model over SmolLM2's vocabulary (the converter needs a tokenizer it knows):
    the matrix row (6 blocks, fp32) with SmolLM2's vocabulary size and special ids, 128 positions."""
    if kind == "llama":
        return build("llama", seed=seed, **_REAL_VOCAB_FIELDS, vocab_size=vocab)
    # sliding window 4, blocks S S F S S F, RoPE bases 10k (sliding) / 1M (full); the attention
    # scale llama.cpp uses (query_pre_attn_scalar = head_dim) and larger initial weights
    return build("gemma3_text", seed=seed, **_REAL_VOCAB_FIELDS, vocab_size=vocab, query_pre_attn_scalar=8,
                 initializer_range=0.1)


def _gguf_model(path: Path, attn: str = "eager", **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation=attn, **kw).eval()


def _ids(vocab: int, length: int = 12, seed: int = 1):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


LLAMA_BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                       "ffn_down")


def test_pruned_llama_exports_with_the_cli_and_reloads_with_identical_logits(tmp_path, converter, smol_tok, capsys):
    from transformers import AutoModelForCausalLM

    model = _tiny_real_vocab("llama", len(smol_tok))
    hl.remove_layers(model, [1, 3])
    model.save_pretrained(tmp_path / "pruned")
    smol_tok.save_pretrained(tmp_path / "pruned")
    out = tmp_path / "pruned.gguf"
    assert main(["export-gguf", str(tmp_path / "pruned"), str(out), "--outtype", "f32"]) == 0
    assert f"wrote {out} (llama, 4 blocks, 39 tensors, f32)" in capsys.readouterr().out

    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("llama.block_count").contents() == 4
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{b}.{t}.weight" for b in range(4) for t in LLAMA_BLOCK_TENSORS
    }
    assert {t.name for t in reader.tensors} == expected
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}

    ids = _ids(len(smol_tok))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype=torch.float32,
                                                   attn_implementation="eager").eval()(ids).logits
        got = _gguf_model(out)(ids).logits
    assert _gguf_model(out).config.num_hidden_layers == 4
    assert torch.equal(got, ref)
    # an existing file is kept unless --overwrite
    assert main(["export-gguf", str(tmp_path / "pruned"), str(out)]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize(("outtype", "types", "tol"), [("f16", {"F16", "F32"}, 2e-3), ("q8_0", {"Q8_0", "F32"}, 3e-2)])
def test_f16_and_q8_0_exports_stay_close(tmp_path, converter, smol_tok, outtype, types, tol):
    model = _tiny_real_vocab("llama", len(smol_tok))
    hl.remove_layers(model, [2])
    out = hl.save_gguf(model, tmp_path / "m.gguf", tokenizer=smol_tok, outtype=outtype)
    reader = gguf.GGUFReader(out)
    assert reader.get_field("llama.block_count").contents() == 5
    assert {t.tensor_type.name for t in reader.tensors} == types
    assert all(t.tensor_type.name == "F32" for t in reader.tensors if len(t.shape) == 1)  # norms stay f32
    ids = _ids(len(smol_tok))
    with torch.no_grad():
        ref, got = model(ids).logits, _gguf_model(out)(ids).logits
    assert 0 < (got - ref).abs().max().item() < tol * ref.abs().max().item()


def test_pruned_gemma3_gguf_carries_the_kept_sliding_window_pattern(tmp_path, converter, smol_tok):
    model = _tiny_real_vocab("gemma3", len(smol_tok))
    hl.remove_layers(model, [1, 3])  # kept 0 2 4 5: S F S F
    out = hl.save_gguf(model, tmp_path / "g.gguf", tokenizer=smol_tok, outtype="f32")
    reader = gguf.GGUFReader(out)
    assert reader.get_field("gemma3.block_count").contents() == 4
    assert reader.get_field("gemma3.attention.sliding_window_pattern").contents() == [True, False, True, False]
    assert reader.get_field("gemma3.attention.sliding_window").contents() == 4
    assert reader.get_field("gemma3.rope.freq_base").contents() == 1e6
    assert reader.get_field("gemma3.rope.freq_base_swa").contents() == 1e4
    assert {t.name for t in reader.tensors if t.name.startswith("blk.")} >= {f"blk.{b}.attn_q_norm.weight" for b in range(4)}
    assert not any(t.name.startswith("blk.4.") for t in reader.tensors)
    # transformers' GGUF loader reads no per-layer pattern; given the checkpoint's config, the
    # tensors give the same logits (Gemma norms are stored +1, hence not bit-identical)
    ids = _ids(len(smol_tok), length=16)
    with torch.no_grad():
        ref = model(ids).logits
        got = _gguf_model(out, config=model.config)(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def _hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, use_cache=True,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(ids):].tolist()


def _llama_import():
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install 'hf-layerswap[llama-cpp]', a source build)"
    )


def _llama_cpp_run(llama_cpp, path: Path, prompt: list[int], steps: int):
    """llama.cpp's logits over ``prompt`` ``(len(prompt), vocab)`` and ``steps`` greedy tokens."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=REAL_MODEL_THREADS, logits_all=True, verbose=False,
                          type_k=0, type_v=0, flash_attn=False)  # f32 KV cache (GGML_TYPE_F32 = 0)
    llm.eval(prompt)
    logits = torch.tensor(llm.scores[: len(prompt)].copy())
    tokens = []
    for _ in range(steps):
        tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        llm.eval([tokens[-1]])
    return logits, tokens


def _stock_gguf(model, tok, tmp_path: Path, converter) -> Path:
    """The stock converter's file alone (no per-layer pattern written)."""
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    script, paths = converter
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    out = tmp_path / "stock.gguf"
    subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "--outtype", "f32", "--outfile", str(out)],
                   env=env, check=True, capture_output=True)
    arch = gguf.GGUFReader(out).get_field("general.architecture").contents()
    assert gguf.GGUFReader(out).get_field(f"{arch}.attention.sliding_window_pattern") is None
    return out


@pytest.mark.llama_cpp
def test_llama_cpp_runs_a_pruned_gemma3_like_transformers(tmp_path, converter, smol_tok):
    """llama.cpp on a pruned Gemma-3 whose prompt (24 tokens) is longer than its sliding
    window (4): greedy tokens and logits match transformers; the converter's file without the
    pattern (llama.cpp's default layout) does not."""
    llama_cpp = _llama_import()
    model = _tiny_real_vocab("gemma3", len(smol_tok))
    hl.remove_layers(model, [1, 3])
    out = hl.save_gguf(model, tmp_path / "g.gguf", tokenizer=smol_tok, outtype="f32")
    prompt = _ids(len(smol_tok), length=24, seed=3)[0].tolist()
    logits, tokens = _llama_cpp_run(llama_cpp, out, prompt, steps=8)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    assert tokens == _hf_greedy(model, prompt, 8)
    torch.testing.assert_close(logits, ref, rtol=0, atol=3e-3 * ref.abs().max().item())

    stock_logits, _ = _llama_cpp_run(llama_cpp, _stock_gguf(model, smol_tok, tmp_path, converter), prompt, steps=0)
    ours, stock = (logits - ref).abs().max().item(), (stock_logits - ref).abs().max().item()
    print(f"llama.cpp vs transformers, max |logit difference|: with the pattern {ours:.2e}, without {stock:.2e}")
    assert stock > 100 * ours


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_llama_cpp_runs_a_pruned_gemma3_270m_like_transformers(gemma3_270m, tmp_path, converter):
    """The real Gemma-3-270M (full attention on blocks 5, 11, 17) without blocks 3 and 9: its
    full blocks sit at 4, 9, 15, where llama.cpp's stock pattern for 16 blocks has 5, 11."""
    import copy

    llama_cpp = _llama_import()
    model, tok = gemma3_270m
    pruned = copy.deepcopy(model)
    hl.remove_layers(pruned, [3, 9])
    out = hl.save_gguf(pruned, tmp_path / "gemma3-270m-pruned.gguf", tokenizer=tok, outtype="f32")
    pattern = gguf.GGUFReader(out).get_field("gemma3.attention.sliding_window_pattern").contents()
    assert [i for i, sliding in enumerate(pattern) if not sliding] == [4, 9, 15]
    prompt = tok("The Eiffel Tower in Paris was finished in 1889 for the World's Fair, and").input_ids
    logits, tokens = _llama_cpp_run(llama_cpp, out, prompt, steps=8)
    with torch.no_grad():
        ref = pruned(torch.tensor([prompt])).logits[0]
    assert tokens == _hf_greedy(pruned, prompt, 8)
    stock_logits, _ = _llama_cpp_run(llama_cpp, _stock_gguf(pruned, tok, tmp_path, converter), prompt, steps=0)
    ours, stock = (logits - ref).abs().max().item(), (stock_logits - ref).abs().max().item()
    print(f"Gemma-3-270M, llama.cpp vs transformers, max |logit difference|: with the pattern {ours:.3f}, "
          f"without {stock:.3f}")
    assert stock > 10 * ours


@pytest.mark.slow
def test_real_pruned_smollm2_gguf_reloads_with_identical_logits(smollm2, tmp_path, converter):
    import copy

    model, tok = smollm2
    pruned = copy.deepcopy(model)
    hl.remove_layers(pruned, [9, 20])
    out = hl.save_gguf(pruned, tmp_path / "smollm2-pruned.gguf", tokenizer=tok, outtype="f32")
    reader = gguf.GGUFReader(out)
    assert reader.get_field("llama.block_count").contents() == 28
    assert reader.get_field("tokenizer.ggml.pre").contents() == "smollm"
    ids = tok("The tower is 324 metres tall, about the same height as an 81-storey building.",
              return_tensors="pt").input_ids
    with torch.no_grad():
        ref = pruned(ids).logits
        got = _gguf_model(out, attn=pruned.config._attn_implementation)(ids).logits
    assert torch.equal(got, ref)


def test_converter_runs_apart_from_this_environments_gguf(converter):
    """The converter sees its own bundled gguf first; this process keeps the installed one."""
    script, paths = converter
    if not any((p / "gguf").is_dir() for p in paths):
        pytest.skip(f"{script} is installed into this environment, not apart from it")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    probe = "import gguf, os; print(os.path.dirname(gguf.__file__))"
    theirs = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert Path(theirs.stdout.strip()).parent in set(paths)
    assert Path(gguf.__file__).parent.parent not in set(paths)


def test_a_ghosted_checkpoint_is_refused_before_converting(tmp_path, capsys):
    """Ghosted operators are hooks hf_layerswap attaches at load time: a GGUF file of the plain
    blocks would be another model, so both entry points refuse before any converter runs."""
    from conftest import tiny_batch

    model = build(FAMILY_BY_NAME["llama"])
    hl.recover(model, [1, 3], tiny_batch(vocab=model.config.vocab_size), method="ghosted")
    message = r"repaired with 'ghosted' operators that hf_layerswap attaches when it loads the model.*recovery='fused'"
    with pytest.raises(GGUFLayoutError, match=message):
        hl.save_gguf(model, tmp_path / "m.gguf", tokenizer=tiny_tokenizer(), converter=tmp_path / "no-converter")
    hl.save_for_hub(model, tmp_path / "ghosted", tokenizer=tiny_tokenizer())
    capsys.readouterr()
    assert main(["export-gguf", str(tmp_path / "ghosted"), str(tmp_path / "g.gguf"),
                 "--converter", str(tmp_path / "no-converter")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this checkpoint's cut is repaired with 'ghosted' operators") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ghosted"]


def test_a_linearpatch_cut_is_refused_where_it_attaches_operators_and_checked_where_only_folded(tmp_path):
    """LinearPatch hooks an operator at a cut after block 0 (refused like ghosted), and folds the
    one at block 0 into the embedding (a plain checkpoint: the refusal does not apply)."""
    from conftest import tiny_batch

    from hf_layerswap.gguf_export import check_plain

    hooked = build(FAMILY_BY_NAME["llama"])
    hl.recover(hooked, [1, 3], tiny_batch(vocab=hooked.config.vocab_size), method="linearpatch")
    with pytest.raises(GGUFLayoutError, match=r"repaired with 'linearpatch' operators"):
        check_plain(hooked.config, hooked)
    folded = build(FAMILY_BY_NAME["llama"])
    hl.recover(folded, [0], tiny_batch(vocab=folded.config.vocab_size), method="linearpatch")
    assert not folded.config.layerswap["recovery"].get("boundaries")
    assert folded.config.layerswap["recovery"]["folded_boundaries"]
    check_plain(folded.config, folded)  # nothing attached: no refusal
