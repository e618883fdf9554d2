"""Many processes on one scoring run (scoring/processes.py): probes partitioned over the
processes of ``accelerate launch`` give the one-process report bit for bit, and a model
sharded over processes is refused before any forward pass."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from arch_matrix import tiny_tokenizer
from conftest import REPO_ROOT, tiny_batch, tiny_model

import hf_layerswap as hl
from hf_layerswap.scoring.processes import check_model_replica, Processes, sharded_layout, ShardedModelError

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kls(path) -> list:
    return json.loads(path.read_text())["pairs"]


def _checkpoint(path, dtype=torch.float32):
    model = tiny_model("qwen3", num_blocks=4).to(dtype)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    text = "\n\n".join(" ".join(f"word{(7 * p + 3 * k) % 50} and more" for k in range(6)) for p in range(8))
    (path.parent / "calib.txt").write_text(text + "\n")
    return path.parent / "calib.txt"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prune_under_accelerate_launch_with_two_processes_equals_one_process_bit_for_bit(tmp_path, dtype):
    calib = _checkpoint(tmp_path / "ckpt", dtype)
    flags = ["--calibration", str(calib), "--num-prompts", "8", "--seq-len", "12", "--batch-size", "2",
             "--num-to-remove", "1", "--strategy", "greedy", "--max-gap", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    # --multi_gpu is accelerate's multi-process launcher (torchrun underneath); without an
    # accelerator the processes join a gloo group on the CPU (`accelerate launch --cpu` starts one process)
    two = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "hf_layerswap.cli", "prune",
           str(tmp_path / "ckpt"), str(tmp_path / "two"), *flags]
    one = [sys.executable, "-m", "hf_layerswap.cli", "prune", str(tmp_path / "ckpt"), str(tmp_path / "one"), *flags]
    for cmd in (two, one):
        done = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    r2, r1 = (json.loads((tmp_path / name / "layerswap_report.json").read_text()) for name in ("two", "one"))
    # every KL and standard error equal as stored (exact floats)
    assert r2["pairs"] == r1["pairs"] and len(r1["pairs"]) == 3 + 2  # adjacent and gap-2 pairs of 4 blocks
    assert r2["metadata"]["world_size"] == 2 and r1["metadata"]["world_size"] == 1
    # the processes shared the probes: each probe ran once, plus one reference per process and batch
    assert r2["metadata"]["block_evaluations"] == r1["metadata"]["block_evaluations"] + 4 * 4
    assert json.loads((tmp_path / "two" / "config.json").read_text())["num_hidden_layers"] == 3
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    # --dtype auto (the default): the checkpoint's own dtype is scored and saved
    with safe_open(tmp_path / "two" / "model.safetensors", "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {dtype}


def test_one_process_without_a_launcher():
    procs = Processes()
    assert (procs.rank, procs.world, procs.state) == (0, 1, None)
    assert procs.share(lambda items, world, rank: items[rank::world], ["a", "b"]) == ["a", "b"]
    assert procs.gather(7) == [7]
    with pytest.raises(ValueError, match="distributed=True but this process was not launched with several processes"):
        Processes(True)


def _refused_before_any_forward(model):
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ShardedModelError, match="one whole model replica per process") as err:
        hl.score_layers(model, tiny_batch(), num_prompts=3, progress=False)
    assert calls == []
    return str(err.value)


def test_tensor_parallel_model_is_refused_before_any_forward_pass():
    model = tiny_model("llama", num_blocks=3)
    assert sharded_layout(model) is None  # the class's own _tp_plan is no sign of sharding
    assert model._tp_plan is not None or model.config.base_model_tp_plan
    model._tp_size = 2  # what from_pretrained(tp_plan="auto") records with 2 processes
    assert "tensor parallel of degree 2 (_tp_size=2)" in _refused_before_any_forward(model)


def test_fsdp_wrapped_and_dtensor_models_are_refused():
    from torch.distributed.fsdp import FSDPModule

    model = tiny_model("llama", num_blocks=3)
    block = model.model.layers[1]
    block.__class__ = type("FSDPLlamaDecoderLayer", (FSDPModule, type(block)), {})  # what fully_shard does
    assert "FSDP-wrapped (FSDPLlamaDecoderLayer at 'model.layers.1')" in _refused_before_any_forward(model)

    model = tiny_model("llama", num_blocks=3)
    model._device_mesh = object()
    with pytest.raises(ShardedModelError, match="loaded with a device mesh"):
        check_model_replica(model)

    model = tiny_model("llama", num_blocks=3)
    model.model.layers[0].mlp.up_proj.weight.ds_id = 3
    with pytest.raises(ShardedModelError, match=r"DeepSpeed ZeRO-3 partitioned \(parameter 'model.layers.0.mlp.up_proj.weight'\)"):
        check_model_replica(model)


def test_dtensor_parameters_are_refused(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Replicate

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = tiny_model("llama", num_blocks=3)
        proj = model.model.layers[2].self_attn.o_proj
        proj.weight = torch.nn.Parameter(distribute_tensor(proj.weight.data, mesh, [Replicate()]))
        assert sharded_layout(model) == "tensor parallel (parameter 'model.layers.2.self_attn.o_proj.weight' is a DTensor)"
    finally:
        torch.distributed.destroy_process_group()
