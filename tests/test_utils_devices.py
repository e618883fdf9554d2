"""dtype and device at every entry point: the dtype a model is loaded in is the dtype it is
scored, pruned and saved in; the half-precision numeric contract of the output head; and a
model split between CPU memory and disk offload (accelerate ``device_map`` with
``offload_folder``) gives the in-memory model's numbers."""

from __future__ import annotations

import copy
import json
import statistics

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from conftest import tiny_batch, tiny_model
from safetensors import safe_open
from test_cli import _calibration_file, _tiny_checkpoint
from transformers import AutoModelForCausalLM

import hf_layerswap as hl
from hf_layerswap.calibration import build_calibration
from hf_layerswap.cli import main
from hf_layerswap.cli.options import max_memory_map
from hf_layerswap.utils.devices import execution_device, input_device, process_share
from hf_layerswap.evaluation.perplexity import perplexity_from_ids
from hf_layerswap.models import host_share, load_model, resolve_dtype, resolve_placement
from hf_layerswap.layerplan import apply_plan, identity_plan, interchange_plan, model_fingerprint, replacement_plan
from hf_layerswap.surgery.history import history_problems
from hf_layerswap.surgery.operators import attached_operators
from hf_layerswap.scoring import Head, plan_kl
from hf_layerswap.scoring import head as head_module
from hf_layerswap.selection import select_layers

FIELDS = ("replacement_ij", "replacement_ji", "interchange")


def _safetensors_dtypes(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


# ----------------------------------------------------------------------------- the helper
def test_execution_device_is_the_hooks_then_the_first_real_parameters():
    lin = torch.nn.Linear(4, 4)
    assert execution_device(lin) == torch.device("cpu")
    on_meta = torch.nn.Linear(4, 4, device="meta")
    assert execution_device(on_meta) == torch.device("cpu")  # nothing real: the CPU
    add_hook_to_module(on_meta, AlignDevicesHook(execution_device="meta"))
    assert execution_device(on_meta) == torch.device("meta")  # the hook's word wins over the weights
    model = tiny_model("llama")
    assert input_device(model) == torch.device("cpu")


# ----------------------------------------------------------------------------- load_model
def test_load_model_keeps_the_checkpoints_dtype_and_refuses_unknown_ones(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    assert _safetensors_dtypes(tmp_path / "bf16") == {"BF16"}
    auto, _ = load_model(tmp_path / "bf16")
    assert {p.dtype for p in auto.parameters()} == {torch.bfloat16}
    fp32, _ = load_model(tmp_path / "bf16", dtype="float32")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"dtype='fp8': allowed \['auto', 'bfloat16', 'float16', 'float32'\]"):
        load_model(tmp_path / "bf16", dtype="fp8")
    assert resolve_dtype("auto", gguf=True) is torch.float32  # GGUF keeps its fp32 dequantization
    assert resolve_dtype("torch.bfloat16") is torch.bfloat16


def test_device_map_auto_is_the_cpu_without_an_accelerator(monkeypatch):
    monkeypatch.setattr("hf_layerswap.models.accelerator_available", lambda: False)
    assert resolve_placement("auto") == (None, None, None)
    assert resolve_placement("auto", max_memory={"cpu": "1GiB"}) == ("auto", {"cpu": "1GiB"}, None)
    assert resolve_placement("auto", offload_folder="off") == ("auto", None, "off")
    assert resolve_placement({"": "cpu"}) == ({"": "cpu"}, None, None)
    monkeypatch.setattr("hf_layerswap.models.accelerator_available", lambda: True)
    assert resolve_placement("auto") == ("auto", None, None)


def _launched(monkeypatch, gpus: int, world: int, local_rank: int, rank: int | None = None):
    """Launched process ``local_rank`` of ``world`` on a machine with ``gpus`` accelerators
    (simulated: torch.accelerator answers for them; nothing is placed)."""
    monkeypatch.setattr("hf_layerswap.models.accelerator_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world), ("LOCAL_RANK", local_rank),
                        ("RANK", local_rank if rank is None else rank)):
        monkeypatch.setenv(name, str(value))


def test_device_map_auto_under_a_launcher_is_each_processs_own_share(monkeypatch, tmp_path):
    """accelerate launch of several processes, each with device_map="auto" (or --max-memory,
    --offload-folder): each process places its replica on its own accelerators, never on
    every accelerator of the machine, and each offloads to a folder of its own."""
    _launched(monkeypatch, gpus=2, world=2, local_rank=1)
    assert resolve_placement("auto") == ({"": "cuda:1"}, None, None)  # one whole replica on its own GPU
    assert resolve_placement("balanced") == ({"": "cuda:1"}, None, None)
    limits = {0: "20GiB", 1: "20GiB", "cpu": "60GiB"}
    # accelerate's map within the limits of its own GPU (and its half of the CPU): GPU 0 is process 0's
    assert resolve_placement("auto", max_memory=limits) == ("auto", {1: "20GiB", "cpu": 30 << 30}, None)
    assert resolve_placement("auto", max_memory=limits, offload_folder=tmp_path) == (
        "auto", {1: "20GiB", "cpu": 30 << 30}, str(tmp_path / "process1"))
    assert resolve_placement({"": "cuda:0"}, max_memory=limits) == ({"": "cuda:0"}, limits, None)  # a map as given
    # four GPUs, two processes: two each, the second process GPUs 2 and 3
    _launched(monkeypatch, gpus=4, world=2, local_rank=1)
    assert resolve_placement("auto", max_memory={i: "10GiB" for i in range(4)}) == ("auto", {2: "10GiB", 3: "10GiB"}, None)
    monkeypatch.setattr("hf_layerswap.models.get_max_memory", lambda: {0: 7, 1: 7, 2: 7, 3: 7, "cpu": 9})
    assert resolve_placement("auto", offload_folder="off") == ("auto", {2: 7, 3: 7, "cpu": 4}, "off/process1")
    # one process: the whole machine, as before
    _launched(monkeypatch, gpus=4, world=1, local_rank=0)
    assert resolve_placement("auto", max_memory=limits, offload_folder="off") == ("auto", limits, "off")
    # CPU processes: no map, each offloads to its own folder
    _launched(monkeypatch, gpus=0, world=2, local_rank=0, rank=0)
    monkeypatch.setattr("hf_layerswap.models.accelerator_available", lambda: False)
    assert resolve_placement("auto") == (None, None, None)
    monkeypatch.setattr("hf_layerswap.models.get_max_memory", lambda: {"cpu": 9})
    assert resolve_placement("auto", offload_folder="off") == ("auto", {"cpu": 4}, "off/process0")


def test_launched_processes_share_the_host_memory_limit(monkeypatch, tmp_path):
    """Eight GPUs, two launched processes, a model larger than a process's four GPUs: the
    host memory is one device shared by the processes, so each map may fill only its half of
    the ``cpu`` limit (given, or the free memory when none is given) and the two replicas
    together stay within it; the GPU limits are per device and each process keeps its own."""
    limits = {**{i: "80GiB" for i in range(8)}, "cpu": "1000GiB"}
    half = 500 << 30
    for rank in (0, 1):
        _launched(monkeypatch, gpus=8, world=2, local_rank=rank)
        mine = {i: "80GiB" for i in range(4 * rank, 4 * rank + 4)}
        assert resolve_placement("auto", max_memory=limits, offload_folder=tmp_path) == (
            "auto", {**mine, "cpu": half}, str(tmp_path / f"process{rank}"))
        monkeypatch.setattr("hf_layerswap.models.get_max_memory", lambda: {i: 80 << 30 for i in range(8)} | {"cpu": 999})
        assert resolve_placement("auto", offload_folder=tmp_path)[1] == {i: 80 << 30 for i in mine} | {"cpu": 499}
    assert host_share({0: "80GiB", "cpu": "1000GiB"}, 1) == {0: "80GiB", "cpu": "1000GiB"}  # one process: as given
    assert host_share({"cpu": 10, "disk": 5}, 3) == {"cpu": 3, "disk": 5}


def test_a_launch_without_a_share_for_each_process_is_refused_before_loading(monkeypatch, tmp_path):
    """Three processes on two GPUs, or limits for another process's GPU only: refused, by
    name, before anything is read (the checkpoint folder does not even exist)."""
    _launched(monkeypatch, gpus=2, world=3, local_rank=2)
    message = r"3 launched processes on this machine but 2 accelerator\(s\).*--num_processes 2"
    with pytest.raises(ValueError, match=message):
        resolve_placement("auto")
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "no-such-model", device_map="auto")
    _launched(monkeypatch, gpus=2, world=2, local_rank=1)
    with pytest.raises(ValueError, match=r"max_memory=\{0: '20GiB'\} names no accelerator of launched process 1 "
                                         r"\(its share: \[1\]\)"):
        resolve_placement("auto", max_memory={0: "20GiB"})
    with pytest.raises(ValueError, match="outside the 2 launched processes"):
        process_share(2, 2, 2)
    assert [process_share(8, 3, r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]  # GPUs 6 and 7 stay idle


def test_max_memory_takes_accelerates_format():
    assert max_memory_map("0=20GiB,cpu=60GiB") == {0: "20GiB", "cpu": "60GiB"}
    assert max_memory_map("cpu=1000000") == {"cpu": 1000000}
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="expected DEVICE=SIZE pairs"):
        max_memory_map("20GiB")
    with pytest.raises(argparse.ArgumentTypeError, match="size 'lots' of 'cpu' is not a size"):
        max_memory_map("cpu=lots")


def test_bf16_checkpoint_pruned_through_from_pretrained_the_cli_and_the_demo_saves_bf16(tmp_path):
    base = _tiny_checkpoint(tmp_path / "fp32")
    base.config.max_position_embeddings = 512  # the demo's perplexity window
    base.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "base" / name).write_bytes((tmp_path / "fp32" / name).read_bytes())
    calib = _calibration_file(tmp_path / "calib.txt")

    cfg = hl.LayerSwapConfig(num_to_remove=2, calibration=tiny_batch(), progress=False, strategy="greedy")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype="auto", quantization_config=cfg)
    assert model.config.num_hidden_layers == 4
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.layerswap_report.metadata["dtype"] == "bfloat16"
    hl.save_for_hub(model, tmp_path / "from_pretrained")
    assert _safetensors_dtypes(tmp_path / "from_pretrained") == {"BF16"}
    cast = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16, quantization_config=cfg)
    hl.save_for_hub(cast, tmp_path / "cast")
    assert cast.config.num_hidden_layers == 4 and _safetensors_dtypes(tmp_path / "cast") == {"BF16"}

    rc = main(["prune", str(tmp_path / "base"), str(tmp_path / "cli"), "--num-to-remove", "2", "--strategy", "greedy",
               "--calibration", str(calib), "--num-prompts", "4"])
    assert rc == 0
    assert _safetensors_dtypes(tmp_path / "cli") == {"BF16"}
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["num_hidden_layers"] == 4
    rc = main(["prune", str(tmp_path / "base"), str(tmp_path / "cli32"), "--num-to-remove", "2", "--strategy", "greedy",
               "--calibration", str(calib), "--num-prompts", "4", "--dtype", "float32"])
    assert rc == 0 and _safetensors_dtypes(tmp_path / "cli32") == {"F32"}
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(" ".join(f"w{(11 * k) % 120}" for k in range(300)) + "\n")
    rc = main(["demo", "--model", str(tmp_path / "base"), "--output", str(tmp_path / "demo"), "--budgets", "1",
               "--final-num-to-remove", "2", "--max-evaluations", "6", "--eval-text", str(held_out), "--calibration",
               str(calib), "--num-prompts", "4", "--seq-len", "16"])
    assert rc == 0 and _safetensors_dtypes(tmp_path / "demo") == {"BF16"}


# ----------------------------------------------------------------------------- half precision
def test_half_precision_head_computes_fp32_logits_from_upcast_tensors():
    model = tiny_model("llama").to(torch.bfloat16)
    head = Head(model)
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    w = model.get_output_embeddings().weight
    with torch.no_grad():
        expected = torch.nn.functional.linear(hidden.float(), w.float())
        out = head(hidden)
        buffered = head.into(hidden, torch.empty(5, head.vocab))
        sliced = head.vocab_slice(hidden, 3, 40)
    assert out.dtype == torch.float32 and torch.equal(out, expected) and torch.equal(buffered, expected)
    assert torch.equal(sliced, expected[:, 3:40])
    bf16_logits = model.get_output_embeddings()(hidden).float()
    assert not torch.equal(out, bf16_logits)  # the bf16 GEMM rounds the logits to 8 mantissa bits


def test_half_precision_head_never_copies_its_whole_weight_to_fp32(monkeypatch):
    """A bf16 head on a device without a GEMM with fp32 output (the CPU) is upcast in pieces
    of at most ``UPCAST_PIECE_BYTES`` (here 5 vocabulary rows' worth), never whole (it was
    one ``4 H V``-byte copy per head phase, outside the memory budget), and its logits err
    from the float64 product no more than the whole fp32 GEMM's do."""
    model = tiny_model("llama").to(torch.bfloat16)
    w = model.get_output_embeddings().weight
    hidden = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        expected = torch.nn.functional.linear(hidden.float(), w.float())
    exact = hidden.double() @ w.double().t()
    fp32_err = float((expected.double() - exact).abs().max())
    monkeypatch.setattr(head_module, "UPCAST_PIECE_BYTES", 5 * 4 * w.shape[1])
    upcasts = []
    real_float = torch.Tensor.float
    weight_ptr = w.untyped_storage().data_ptr()

    def upcast(t):
        if t.untyped_storage().data_ptr() == weight_ptr:  # the head's weight or a view of it
            upcasts.append(t.numel())
        return real_float(t)

    monkeypatch.setattr(torch.Tensor, "float", upcast)
    head = Head(model)
    assert head.working_bytes(head.vocab) == 5 * 4 * w.shape[1]  # what the cost model counts
    with torch.no_grad():
        outs = [head(hidden), head.into(hidden, torch.empty(6, head.vocab)), head.vocab_slice(hidden, 0, head.vocab)]
    for out in outs:
        assert out.dtype == torch.float32 and float((out.double() - exact).abs().max()) <= 2 * fp32_err
    assert upcasts and max(upcasts) <= 5 * w.shape[1] < w.numel()


def _emulated_mixed_gemm(monkeypatch) -> list:
    """``torch.mm(a, b, out_dtype=torch.float32)`` on the CPU as CUDA runs it: half-precision
    inputs, exact products and fp32 sums (the products of two bf16 or fp16 numbers are exact
    in fp32, so the fp32 GEMM of the upcast inputs is it up to the order of the sums); the
    dtypes of every call are recorded."""
    calls = []
    real_mm = torch.mm

    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_mm(a, b, *args, **kwargs)
        assert out_dtype == torch.float32 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
        calls.append(a.dtype)
        return real_mm(a.float(), b.float())

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(head_module, "mixed_gemm", lambda device, dtype: True)
    return calls


def test_split_bf16_is_exact_and_the_mixed_gemm_is_as_accurate_as_fp32(monkeypatch):
    """fp32 hidden rows split into three bf16 terms sum back exactly; through the mixed GEMM
    (emulated) the logits against a bf16 weight, bias included, err from the float64 product
    no more than twice the fp32 GEMM of the upcast tensors does (bf16 hidden rows: one GEMM,
    fp32 ones: three), and no weight is upcast."""
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-20, 20, 96)
    hi, mid, lo = head_module.split_bf16(x)
    assert {hi.dtype, mid.dtype, lo.dtype} == {torch.bfloat16} and torch.equal(hi.float() + mid.float() + lo.float(), x)
    w = (torch.randn(4000, 96) * 0.05).bfloat16()
    bias = torch.randn(4000).bfloat16()
    calls = _emulated_mixed_gemm(monkeypatch)
    for hidden, gemms in ((torch.randn(32, 96) * 4, 3), ((torch.randn(32, 96) * 4).bfloat16(), 1)):
        exact = hidden.double() @ w.double().t() + bias.double()
        fp32 = torch.nn.functional.linear(hidden.float(), w.float(), bias.float())
        calls.clear()
        fast = head_module.linear32(hidden, w, bias)
        assert fast.dtype == torch.float32 and calls == [torch.bfloat16] * gemms
        fast_err, fp32_err = ((fast.double() - exact).abs().max()), ((fp32.double() - exact).abs().max())
        assert fast_err <= 2 * fp32_err and fast_err < 1e-5
        assert (fp32.bfloat16().float().double() - exact).abs().max() > 100 * fp32_err  # bf16 output: not enough


def test_bf16_swap_kls_with_the_mixed_gemm_head_match_float64(monkeypatch):
    """The engine's swap-KLs of the bf16 model with the head's mixed GEMM (emulated as CUDA
    runs it) equal the float64 KL of the model's own final hidden states as closely as the
    fp32 head's do (relative error below 1e-4), and the head ran as bf16 GEMMs only."""
    _, m16 = _bf16_pair()
    batch = tiny_batch(batch=4, length=24)
    plans = {(i, "interchange"): interchange_plan(6, i, i + 1) for i in range(5)}
    fp32_head, _ = plan_kl(m16, build_calibration(batch), plans)
    calls = _emulated_mixed_gemm(monkeypatch)
    fast, _ = plan_kl(m16, build_calibration(batch), plans)
    assert calls and set(calls) == {torch.bfloat16}
    for key, plan in plans.items():
        exact = _exact_kl(m16, batch, plan)
        assert float(((fast[key] - exact).abs() / exact).max()) <= 1e-4
        assert torch.allclose(fast[key], fp32_head[key], rtol=1e-5, atol=0)


def _relative_errors(ref, other) -> list[float]:
    return [abs(getattr(b, f) - getattr(a, f)) / getattr(a, f) for a, b in zip(ref.pairs, other.pairs) for f in FIELDS]


def _bf16_pair(vocab: int = 2048, scale: float = 30.0):
    """A tiny fp32 model with a 2,048-entry vocabulary and logits of tens of nats (head
    scaled by 30), and its bf16 cast."""
    m32 = tiny_model("llama", vocab_size=vocab)
    with torch.no_grad():
        m32.get_output_embeddings().weight.mul_(scale)
    return m32, copy.deepcopy(m32).to(torch.bfloat16)


@torch.no_grad()
def _exact_kl(model, batch, plan) -> torch.Tensor:
    """Per-prompt mean KL(identity || plan) ``(B,)`` of ``model``'s own final hidden states
    with the head and the KL in float64: the value the fp32 head should reproduce."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    w = model.get_output_embeddings().weight.double()

    def logprobs(p):
        with apply_plan(model, p):
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        return torch.log_softmax(hidden.double() @ w.T, dim=-1)

    ref, mod = logprobs(identity_plan(6)), logprobs(plan)
    kl = (ref.exp() * (ref - mod)).sum(-1)
    return (kl * mask).sum(1) / mask.sum(1)


def test_bf16_swap_kls_are_the_bf16_models_own_not_its_rounded_logits():
    """On the bf16 model, the engine's swap-KLs equal the float64 KL of the model's own
    final hidden states (relative error measured: below 1e-5); from the bf16 GEMM's rounded
    logits (``stream_logits=False``: the model's own logits, what the streamed head
    computed before the contract) they were off by up to 0.72% when measured (4e-7 with it)."""
    _, m16 = _bf16_pair()
    batch = tiny_batch(batch=4, length=24)
    plans = {(i, kind): fn(6, i, i + 1) for i in range(5)
             for kind, fn in (("interchange", interchange_plan), ("replacement", replacement_plan))}
    ours, _ = plan_kl(m16, build_calibration(batch), plans)
    rounded, _ = plan_kl(m16, build_calibration(batch), plans, stream_logits=False)
    ours_err, rounded_err = [], []
    for key, plan in plans.items():
        exact = _exact_kl(m16, batch, plan)
        ours_err.append(float(((ours[key] - exact).abs() / exact).max()))
        rounded_err.append(float(((rounded[key] - exact).abs() / exact).max()))
    assert max(ours_err) <= 1e-4
    assert max(rounded_err) >= 1e-3  # what the contract removes


def test_bf16_swap_kls_are_closer_to_fp32_with_the_fp32_head():
    """Against the fp32 model's swap-KLs, the bf16 model's with the fp32 head (the default)
    erred by a median 0.0016 (max 0.0055) when measured; from its own bf16-rounded logits
    (``stream_logits=False``) by a median 0.0025 (max 0.0062). The rest of the gap is the
    bf16 rounding of the blocks themselves, which no head can undo."""
    m32, m16 = _bf16_pair()
    calib = build_calibration(tiny_batch(batch=4, length=24))
    ref = hl.score_layers(m32, calib, progress=False)
    fp32_head = _relative_errors(ref, hl.score_layers(m16, calib, progress=False))
    rounded = _relative_errors(ref, hl.score_layers(m16, calib, progress=False, stream_logits=False))
    assert statistics.median(fp32_head) <= 0.0021 and max(fp32_head) <= 0.0065
    assert statistics.median(fp32_head) <= 0.8 * statistics.median(rounded)


# ----------------------------------------------------------------------------- offload
def _offloaded(model, folder):
    """``model`` saved and reloaded with blocks 0-2 in CPU memory and blocks 3-5 on disk."""
    model.save_pretrained(folder / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}}
    out = AutoModelForCausalLM.from_pretrained(folder / "ckpt", device_map=device_map,
                                               offload_folder=str(folder / "offload"), attn_implementation="eager")
    return out.eval()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def test_disk_offloaded_model_gives_the_in_memory_numbers(tmp_path):
    dense = tiny_model("llama")
    split = _offloaded(dense, tmp_path)
    blocks = split.model.layers
    assert blocks[4].self_attn.q_proj.weight.device.type == "meta" and hasattr(blocks[4], "_hf_hook")
    batch = tiny_batch()
    calib = build_calibration(batch)

    ours, theirs = hl.score_layers(dense, calib, progress=False), hl.score_layers(split, calib, progress=False)
    assert max(_rel(getattr(a, f), getattr(b, f)) for a, b in zip(ours.pairs, theirs.pairs) for f in FIELDS) <= 1e-5

    kw = dict(strategy="search", calibration=calib)
    assert select_layers(ours, 2, model=dense, **kw) == select_layers(theirs, 2, model=split, **kw)

    ids = torch.randint(0, dense.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    p_dense = perplexity_from_ids(dense, ids, window=64, stride=32, bootstrap=0)
    p_split = perplexity_from_ids(split, ids, window=64, stride=32, bootstrap=0)
    assert _rel(p_dense.ppl, p_split.ppl) <= 1e-5

    fits = []
    for model in (copy.deepcopy(dense), split):
        hl.recover(model, [2, 4], calib, method="ghosted")
        fits.append({b: op.weight.clone() for b, op in attached_operators(model)})
    assert fits[0].keys() == fits[1].keys() == {2, 3}
    for b in fits[0]:
        assert torch.allclose(fits[0][b], fits[1][b], rtol=1e-5, atol=1e-6)


def test_an_offloaded_models_fingerprint_reads_its_offloaded_weights(tmp_path):
    """The weight fingerprint of a model with its head, embedding and blocks 3-5 on disk is
    the in-memory model's (it reads the offloaded tensors' first values from the offload),
    and a model that differs only in an offloaded block gets another one, so a report of
    the one is refused for the other."""
    dense = tiny_model("llama")
    other = copy.deepcopy(dense)
    with torch.no_grad():
        other.model.layers[4].mlp.down_proj.weight.view(-1)[:16] += 1.0
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk",
                  **{f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}}
    split = []
    for name, model in (("dense", dense), ("other", other)):
        model.save_pretrained(tmp_path / name)
        split.append(AutoModelForCausalLM.from_pretrained(tmp_path / name, device_map=device_map,
                                                          offload_folder=str(tmp_path / f"{name}-offload")).eval())
    assert split[0].lm_head.weight.device.type == split[0].model.layers[4].mlp.down_proj.weight.device.type == "meta"
    assert split[0].model.embed_tokens.weight.device.type == "meta"
    assert model_fingerprint(split[0]) == model_fingerprint(dense)
    assert model_fingerprint(split[1]) == model_fingerprint(other) != model_fingerprint(dense)
    calib = build_calibration(tiny_batch())
    report = hl.score_layers(split[0], calib, progress=False, max_gap=1)
    with pytest.raises(ValueError, match="the report belongs to a different model"):
        select_layers(report, 1, model=split[1], calibration=calib, strategy="search")


def test_an_offloaded_models_fingerprint_is_the_in_memory_ones_for_each_storage(tmp_path):
    """model_fingerprint reads an offloaded parameter (on "meta" between calls) from where
    accelerate keeps it: the checkpoint's safetensors file (from_pretrained's disk offload),
    accelerate's .dat files (disk_offload) and tensors in CPU memory (cpu_offload). It used
    to leave such parameters out, so an offloaded model's fingerprint was not its weights':
    the removal record it saved failed the history check of every later load and push."""
    from accelerate import cpu_offload, disk_offload

    dense = tiny_model("llama")
    ours = model_fingerprint(dense)
    split = _offloaded(dense, tmp_path)
    on_disk = [n for n, p in split.named_parameters() if p.device.type == "meta"]
    assert "model.layers.4.self_attn.q_proj.weight" in on_disk and "lm_head.weight" not in on_disk
    assert model_fingerprint(split) == ours
    for offload in (lambda m: disk_offload(m, str(tmp_path / "dat"), execution_device=torch.device("cpu")),
                    lambda m: cpu_offload(m, execution_device=torch.device("cpu"))):
        model = offload(copy.deepcopy(dense))
        assert all(p.device.type == "meta" for p in model.parameters())
        assert model_fingerprint(model) == ours
    assert any((tmp_path / "dat").glob("*.dat"))
    other = tiny_model("llama", seed=1)
    assert model_fingerprint(cpu_offload(copy.deepcopy(other), execution_device=torch.device("cpu"))) == \
        model_fingerprint(other) != ours
    with torch.device("meta"):  # built on "meta", held by no offload: its weights are left out, as before
        empty = type(dense)(dense.config)
    assert model_fingerprint(empty) != ours


def test_prune_on_the_command_line_with_disk_offload_gives_the_in_memory_cut(tmp_path):
    """--max-memory below the weights and --offload-folder: accelerate's map puts the blocks
    that do not fit on disk, and the prune scores, cuts and saves as in memory."""
    base = _tiny_checkpoint(tmp_path / "base")
    calib = _calibration_file(tmp_path / "calib.txt")
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    flags = ["--num-to-remove", "2", "--strategy", "greedy", "--calibration", str(calib), "--num-prompts", "4"]
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "memory"), *flags]) == 0
    assert main(["prune", str(tmp_path / "base"), str(tmp_path / "offloaded"), *flags,
                 "--max-memory", f"cpu={weights // 2}", "--offload-folder", str(tmp_path / "offload")]) == 0
    # the same options load some blocks on disk (accelerate's map, through load_model)
    split, _ = load_model(tmp_path / "base", max_memory=max_memory_map(f"cpu={weights // 2}"),
                          offload_folder=str(tmp_path / "offload"))
    assert "disk" in split.hf_device_map.values() and "cpu" in split.hf_device_map.values()
    assert split.hf_device_map["lm_head"] == "disk"
    ours, theirs = (json.loads((tmp_path / n / "layerswap_report.json").read_text()) for n in ("memory", "offloaded"))
    assert len(ours["pairs"]) == len(theirs["pairs"]) > 0
    compared = 0
    for a, b in zip(ours["pairs"], theirs["pairs"]):
        for f in FIELDS:
            assert (a[f] is None) == (b[f] is None), (a, b, f)  # the same protocols scored
            if a[f] is not None:
                # the head on disk is read in vocabulary slices, in memory it takes the whole vocabulary at
                # once: the same float64 online KL, on fp32 logits from GEMMs of other shapes (summed in
                # another order on some CPUs), so equal to the fp32 logits' rounding
                assert _rel(a[f], b[f]) <= 1e-6, (a, b, f)
                compared += 1
    assert compared >= len(ours["pairs"])
    cuts = [json.loads((tmp_path / n / "config.json").read_text())["layerswap"]["removed_layers"]
            for n in ("memory", "offloaded")]
    assert cuts[0] == cuts[1] and len(cuts[0]) == 2
    # the recorded weights are the in-memory run's, so the offloaded run's folder publishes as verified
    steps = [json.loads((tmp_path / n / "config.json").read_text())["layerswap"]["steps"][-1]
             for n in ("memory", "offloaded")]
    assert [s["fingerprint_after"] for s in steps[1:]] == [steps[0]["fingerprint_after"]]
    assert steps[1]["fingerprint_before"] == steps[0]["fingerprint_before"]
    assert main(["push", str(tmp_path / "offloaded"), "me/tiny", "--output-dir", str(tmp_path / "published")]) == 0
    assert (tmp_path / "published" / "model.safetensors").is_file()
    reloaded = [AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("memory", "offloaded")]
    ids = tiny_batch()["input_ids"]
    with torch.no_grad():
        assert torch.allclose(reloaded[0](ids).logits, reloaded[1](ids).logits, rtol=1e-5, atol=1e-5)
    # the removal record the offloaded run saved describes the saved weights: publishing it is not refused
    assert history_problems(reloaded[1]) == []
    assert main(["push", str(tmp_path / "offloaded"), "user/tiny-offloaded", "--output-dir", str(tmp_path / "pub")]) == 0


def test_from_pretrained_with_disk_offload_prunes_repairs_and_saves_the_in_memory_model(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}}
    cfg = hl.LayerSwapConfig(num_to_remove=2, calibration=tiny_batch(), progress=False, recovery="ghosted")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=cfg, attn_implementation="eager")
    split = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=cfg, attn_implementation="eager",
                                                 device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert split.config.layerswap["removed_layers"] == dense.config.layerswap["removed_layers"]
    hl.save_for_hub(split, tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", attn_implementation="eager")
    assert [b for b, _ in attached_operators(reloaded)] == [b for b, _ in attached_operators(dense)]
    ids = tiny_batch()["input_ids"]
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_recovery_refuses_a_fold_into_offloaded_weights(tmp_path):
    """A fused map folded into a block whose weights sit on disk would not reach the saved
    weights (the write lands on the meta placeholder): refused before fitting, naming the
    block; a fold into a block held in memory still changes that block's weights."""
    split = _offloaded(tiny_model("llama"), tmp_path)
    calib = build_calibration(tiny_batch())
    with pytest.raises(ValueError, match=r"block 3's mlp\.down_proj, whose weights are offloaded"):
        hl.recover(split, [4], calib, method="fused")
    with pytest.raises(ValueError, match="offloaded"):
        hl.prune(split, hl.LayerSwapConfig(layers=[4], recovery="fused", calibration=calib, progress=False))
    assert len(split.model.layers) == 6
    before = split.model.layers[1].mlp.down_proj.weight.clone()
    hl.recover(split, [2], calib, method="fused")
    assert not torch.equal(split.model.layers[1].mlp.down_proj.weight, before)


# ----------------------------------------------------------------------------- several devices
def test_tied_head_on_the_embeddings_device_keeps_the_kl_where_its_logits_are(monkeypatch):
    """A tied head split from the final norm (the embedding and head on one GPU, the last
    blocks and the norm on another) makes its logits on the embedding's device: the KL
    accumulator is built on the head's execution device, and every logit block is brought to
    it, not to the device of the final hidden rows. The hook's word stands in for the second
    GPU ("cpu:1": a CPU tensor asked for device index 1 is a CPU tensor), so the arithmetic
    runs here; the values equal those of the head with no hook, and the float64 KL of the
    fp32 logits."""
    from hf_layerswap.scoring import streamed

    built = []

    class RecordingKL(streamed.OnlineKL):
        def __init__(self, rows, probes, device, *args):
            built.append(torch.device(device))
            super().__init__(rows, probes, device, *args)

    monkeypatch.setattr(streamed, "OnlineKL", RecordingKL)
    model = tiny_model("llama", num_blocks=2, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, model.config.hidden_size, generator=gen)
    probe = hidden + 0.1 * torch.randn(hidden.shape, generator=gen)
    rows_of = torch.tensor([0, 0, 0, 1, 1, 1])
    counts = torch.tensor([3.0, 3.0], dtype=torch.float64)

    def kls():
        kl = streamed.StreamedKL(Head(model), kl_chunk=4, vocab_chunk=model.config.vocab_size, autocast=None,
                                 device_type="cpu", stats={"head_rows": 0})
        with torch.no_grad():  # as the engine runs it
            return kl.head_phase(hidden, [probe], rows_of, counts, 2)[0]

    plain = kls()
    model.lm_head._hf_hook = AlignDevicesHook(execution_device=torch.device("cpu", 1))  # the hook's word only
    split = kls()
    assert built == [torch.device("cpu"), torch.device("cpu", 1)]  # the head's device, not the rows' ("cpu")
    assert torch.equal(split, plain)
    w = model.lm_head.weight.detach()
    ref, mod = (torch.log_softmax((x @ w.t()).double(), -1) for x in (hidden, probe))
    expected = (ref.exp() * (ref - mod)).sum(-1).reshape(2, 3).mean(-1)
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=1e-7)
