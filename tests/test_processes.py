"""Many processes on one scoring run (scoring/processes.py): probes partitioned over the
processes of ``accelerate launch`` give the one-process report bit for bit, a model
sharded over processes is refused before any forward pass, and the weight movement of a
streamed (disk-offloaded) model scored by two processes is the sum over the processes
(gathered with accelerate's ``gather_object``), each process's own counters under
``per_process``."""

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
from hf_layerswap.scoring.processes import (
    Processes,
    ShardedModelError,
    check_model_replica,
    sharded_layout,
    sum_movement,
)

TESTS = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kls(path) -> list:
    return json.loads(path.read_text())["pairs"]


def _failure(done) -> str:
    """What a failed launch printed: every process's ``error:`` line first (the launcher's
    traceback of the process it stopped would push them out of the tail), then the tail."""
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    return "\n".join(errors[:20]) + "\n...\n" + done.stderr[-3000:]


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
        assert done.returncode == 0, _failure(done)
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


# ---------------------------------------------------------------- weight movement summed over processes

MOVEMENT_SCRIPT = """
import json, os, sys
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import compute_module_sizes
from conftest import tiny_batch, tiny_model
import hf_layerswap as hl
from hf_layerswap.calibration import build_calibration
from hf_layerswap.scoring.processes import is_main_process

out = sys.argv[1]
model = tiny_model("llama", num_blocks=6)
cap = int(0.25 * compute_module_sizes(model)[""])  # a quarter of the weights in memory: every block on disk
device_map = infer_auto_device_map(model, max_memory={"cpu": cap}, no_split_module_classes=model._no_split_modules)
model = dispatch_model(model, device_map, offload_dir=os.path.join(out, "offload" + os.environ.get("RANK", "0"))).eval()
report = hl.score_layers(model, build_calibration(tiny_batch(batch=5, length=12)), progress=False, max_gap=2,
                         batch_size=3)
if is_main_process():
    with open(os.path.join(out, sys.argv[2]), "w") as fh:
        json.dump(report.metadata, fh)
"""


def test_sum_movement_adds_the_processes_and_keeps_each():
    parts = [({"block_onloads": 12, "bytes_moved": 1200}, [6, 6]), ({"block_onloads": 10, "bytes_moved": 1000}, [6, 4])]
    moved = sum_movement(parts)
    assert moved["block_onloads"] == 22 and moved["bytes_moved"] == 2200
    assert moved["block_onloads_per_batch"] == [12, 10]
    assert moved["per_process"] == [{"block_onloads": 12, "bytes_moved": 1200, "block_onloads_per_batch": [6, 6]},
                                    {"block_onloads": 10, "bytes_moved": 1000, "block_onloads_per_batch": [6, 4]}]


def test_two_processes_report_the_sum_of_their_movement(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(MOVEMENT_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), TESTS, os.environ.get("PYTHONPATH", "")]))
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    # --multi_gpu is accelerate's multi-process launcher; without an accelerator the processes join a gloo group
    two = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(script), str(tmp_path), "two.json"]
    one = [sys.executable, str(script), str(tmp_path), "one.json"]
    for cmd in (two, one):
        done = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        assert done.returncode == 0, _failure(done)
    two_meta, one_meta = (json.loads((tmp_path / name).read_text()) for name in ("two.json", "one.json"))
    assert two_meta["world_size"] == 2 and two_meta["slot_major"] is True
    one_moved, moved = one_meta["movement"], two_meta["movement"]
    # one process: each of the 6 offloaded blocks once per batch (two batches)
    assert one_moved["block_onloads"] == 12 and one_moved["block_onloads_per_batch"] == [6, 6]
    assert "per_process" not in one_moved
    # two processes: each streams every block once per batch for its share of the probes
    assert [p["block_onloads"] for p in moved["per_process"]] == [12, 12]
    assert moved["block_onloads"] == 24 and moved["block_onloads_per_batch"] == [12, 12]
    assert moved["bytes_moved"] == 2 * one_moved["bytes_moved"] == sum(p["bytes_moved"] for p in moved["per_process"])


def test_prune_heal_under_two_processes_spends_the_budget_asked_for(tmp_path):
    # the card said 1,024 tokens for --heal-max-tokens 512: each process took a whole batch per step
    calib = _checkpoint(tmp_path / "ckpt")
    flags = ["--layers", "1", "--calibration", str(calib), "--heal", "last_k", "--heal-option", "k=2",
             "--heal-max-tokens", "128", "--heal-seq-len", "8", "--heal-batch-size", "4", "--heal-eval-every", "2",
             "--heal-heldout-prompts", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    two = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "hf_layerswap.cli", "prune",
           str(tmp_path / "ckpt"), str(tmp_path / "two"), *flags]
    done = subprocess.run(two, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, _failure(done)
    entry = json.loads((tmp_path / "two" / "config.json").read_text())["layerswap"]["healing"][-1]
    # 128 tokens in 4 steps of 4 prompts x 8 tokens, the prompts of each step shared by the two processes
    assert entry["settings"]["max_tokens"] == 128 and entry["settings"]["batch_size"] == 4
    assert entry["steps"] == 4 and entry["tokens"] <= 128
    assert "--max-tokens 128 " in (tmp_path / "two" / "README.md").read_text()
    odd = [*two[:-len(flags) - 2], str(tmp_path / "ckpt"), str(tmp_path / "odd"), *flags[:-6], "--heal-batch-size", "3",
           *flags[-4:]]
    done = subprocess.run(odd, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode != 0 and "error: HealConfig(batch_size=3) under 2 launched processes" in done.stderr
    assert "removed layers" not in done.stdout and not (tmp_path / "odd").exists()  # refused before the model loaded
