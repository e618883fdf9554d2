"""Weight movement under several processes: the report's ``metadata["movement"]`` of a
streamed (disk-offloaded) model scored by two processes of ``accelerate launch`` is the
sum over the processes, gathered with accelerate's ``gather_object``, each process's own
counters under ``per_process``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

from conftest import REPO_ROOT

from hf_layerswap.scoring.processes import sum_movement

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = """
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sum_movement_adds_the_processes_and_keeps_each():
    parts = [({"block_onloads": 12, "bytes_moved": 1200}, [6, 6]), ({"block_onloads": 10, "bytes_moved": 1000}, [6, 4])]
    moved = sum_movement(parts)
    assert moved["block_onloads"] == 22 and moved["bytes_moved"] == 2200
    assert moved["block_onloads_per_batch"] == [12, 10]
    assert moved["per_process"] == [{"block_onloads": 12, "bytes_moved": 1200, "block_onloads_per_batch": [6, 6]},
                                    {"block_onloads": 10, "bytes_moved": 1000, "block_onloads_per_batch": [6, 4]}]


def test_two_processes_report_the_sum_of_their_movement(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), TESTS, os.environ.get("PYTHONPATH", "")]))
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    # --multi_gpu is accelerate's multi-process launcher; without an accelerator the processes join a gloo group
    two = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(script), str(tmp_path), "two.json"]
    one = [sys.executable, str(script), str(tmp_path), "one.json"]
    for cmd in (two, one):
        done = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
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
