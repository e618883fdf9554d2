"""How the command line fails: paths checked before the model loads, a full disk at write
time, a corrupt GGUF file, a Hub id while offline, bad reports, budgets and binary calibration
files (exit 2, nothing written), and Ctrl-C (exit 130, then ``--resume``).

Read-only outputs: the tests run as root, for whom permission bits do not stop writes, so a
path that cannot be created is made portably as a path *under a regular file* (the kernel
refuses it with ENOTDIR whoever asks), and the read-only-folder branch is reached by making
the probe file's creation fail with EROFS, as a read-only mount does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from arch_matrix import build, tiny_tokenizer
from conftest import SHORT_TEXTS, random_bytes
from test_cli import _calibration_file, _tiny_checkpoint

import hf_layerswap.cli.options as common
from hf_layerswap import SwapReport
from hf_layerswap.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(argv, capsys) -> tuple[int, str]:
    """main's exit status (or argparse's) and what it printed on stderr."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


@pytest.fixture
def base(tmp_path):
    _tiny_checkpoint(tmp_path / "base")
    _calibration_file(tmp_path / "calib.txt")
    (tmp_path / "a-file").write_text("not a folder\n")
    return tmp_path


def _verbs(tmp: Path, out: Path) -> dict:
    """Each verb with one output path ``out`` (everything else valid): ``{case: (option, argv)}``."""
    model, calib = tmp / "base", tmp / "calib.txt"
    scoring = ["--calibration", calib, "--num-prompts", "2"]
    return {
        "score -o": ("--output", ["score", model, *scoring, "-o", out]),
        "score --resume": ("--resume", ["score", model, *scoring, "-o", tmp / "r.json", "--resume", out]),
        "prune OUTPUT": ("output", ["prune", model, out, "--layers", "1"]),
        "prune --resume": ("--resume", ["prune", model, tmp / "pruned", "--num-to-remove", "1", *scoring, "--resume", out]),
        "heal OUTPUT": ("OUTPUT", ["heal", model, model, out]),
        "heal --resume": ("--resume", ["heal", model, model, tmp / "healed", "--resume", out]),
        "eval -o": ("--output", ["eval", model, "-o", out]),
        "push --output-dir": ("--output-dir", ["push", model, "me/tiny", "--output-dir", out]),
        "export-gguf OUTPUT": ("OUTPUT", ["export-gguf", model, out]),
        "demo --output": ("--output", ["demo", "--model", model, "--output", out, *scoring]),
    }


@pytest.mark.parametrize("verb", list(_verbs(Path("t"), Path("o"))))
def test_an_output_that_cannot_be_created_is_refused_before_the_model_loads(base, capsys, verb):
    out = base / "a-file" / "out.gguf"
    option, argv = _verbs(base, out)[verb]
    code, err = _run(argv, capsys)
    assert code == 2
    assert err.strip() == f"error: {option} {out} cannot be created: {base / 'a-file'} is a file, not a folder"
    assert "loading" not in err  # refused before the model loads (score and eval used to fail after the work)
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


def test_a_read_only_output_folder_is_refused_before_the_model_loads(base, capsys, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(common.tempfile, "TemporaryFile", read_only)
    out = base / "new" / "out.gguf"
    for verb, (option, argv) in _verbs(base, out).items():
        if "--resume" in verb:
            continue  # its other output is checked first, with the same message
        code, err = _run(argv, capsys)
        assert code == 2, verb
        assert err.strip() == (f"error: {option} {out} cannot be written: {base} refuses new files "
                               "(Read-only file system); choose a writable folder"), verb
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


def test_missing_inputs_are_refused_before_the_model_loads(base, capsys):
    missing = base / "missing" / "dir"
    cases = {
        "--tokenizer": ["score", base / "base", "--tokenizer", missing, "-o", base / "r.json"],
        "--report": ["push", base / "base", "me/tiny", "--report", missing, "--output-dir", base / "o"],
        "--evaluation": ["push", base / "base", "me/tiny", "--evaluation", missing, "--output-dir", base / "o"],
        "--sparsity-report": ["push", base / "base", "me/tiny", "--sparsity-report", missing, "--output-dir", base / "o"],
        "CHECKPOINT": ["export-gguf", missing, base / "o.gguf"],
    }
    for option, argv in cases.items():
        code, err = _run(argv, capsys)
        assert code == 2 and "loading" not in err, option
        expected = (f"error: --tokenizer {str(missing)!r} is not a folder, and not a Hub id of the form 'owner/name'"
                    if option == "--tokenizer" else f"error: {option} {str(missing)!r} does not exist")
        assert err.strip() == expected
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


# ------------------------------------------------------------------ one output policy

def _real(path) -> str:
    return os.path.realpath(path)


def test_an_output_onto_an_input_or_into_the_checkpoint_is_refused_and_they_stay_byte_identical(base, capsys):
    """No verb writes onto a file it reads or into MODEL's folder, not even with --overwrite
    (nor through a symbolic link to one), and a --resume folder is neither MODEL nor inside
    it: all refused before the model loads, every input byte-identical after."""
    model, calib, other = base / "base", base / "calib.txt", base / "other"
    (base / "to-calib.json").symlink_to("calib.txt")
    other.mkdir()
    before = {p: p.read_bytes() for p in [calib, *model.iterdir()]}
    scoring = ["--calibration", calib, "--num-prompts", "2"]
    read_by = f"{_real(calib)}, which this run reads: an output never replaces an input"
    inside = f"inside MODEL {_real(model)}, a folder this run reads: nothing is written into an input"
    cases = [
        (["score", model, *scoring, "-o", calib], f"--output {calib} is --calibration {read_by}"),
        (["score", model, *scoring, "-o", calib, "--overwrite"], f"--output {calib} is --calibration {read_by}"),
        (["score", model, *scoring, "-o", base / "to-calib.json", "--overwrite"],
         f"--output {base / 'to-calib.json'} is --calibration {read_by}"),
        (["score", model, *scoring, "-o", model / "config.json"], f"--output {model / 'config.json'} is {inside}"),
        (["score", model, *scoring, "-o", model / "config.json", "--overwrite"],
         f"--output {model / 'config.json'} is {inside} (not even with --overwrite)"),
        (["eval", model, "--text", calib, "-o", calib, "--overwrite"], f"--output {calib} is --text {read_by}"),
        (["peel", model, "-o", model / "model.safetensors", "--overwrite"], f"--output {model / 'model.safetensors'} is {inside}"),
        (["peel", model, "--eval-text", calib, "--table", calib, "--overwrite"], f"--table {calib} is --eval-text {read_by}"),
        (["score", model, *scoring, "-o", other / "r.json", "--resume", model],
         f"--resume {model} is MODEL {_real(model)}, which this run reads"),
        (["score", model, *scoring, "-o", other / "r.json", "--resume", model / "ck"], f"--resume {model / 'ck'} is {inside}"),
        (["prune", model, other / "out", "--num-to-remove", "1", *scoring, "--resume", model / "ck"],
         f"--resume {model / 'ck'} is {inside}"),
        (["score", model, *scoring, "-o", other / "ck" / "manifest.json", "--resume", other / "ck"],
         f"--output {_real(other / 'ck' / 'manifest.json')} is inside --resume {other / 'ck'}: each output needs"),
        (["push", model, "me/tiny", "--output-dir", model / "pub"],
         f"--output-dir {model / 'pub'} is inside DIRECTORY {_real(model)}, a folder this run reads"),
        (["export-gguf", model, model / "m.gguf", "--overwrite"],
         f"OUTPUT {model / 'm.gguf'} is inside CHECKPOINT {_real(model)}, a folder this run reads"),
    ]
    for argv, message in cases:
        code, err = _run(argv, capsys)
        assert code == 2, argv
        assert err.strip().startswith(f"error: {message}"), (argv, err)
        assert "loading" not in err
    assert {p: p.read_bytes() for p in before} == before  # the calibration file and every checkpoint file
    assert sorted(model.iterdir()) == sorted(p for p in before if p != calib)
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt", "other", "to-calib.json"]
    assert list(other.iterdir()) == []


def test_an_existing_output_file_needs_overwrite_and_a_link_is_written_through(base, capsys):
    model, old = base / "base", base / "old.json"
    old.write_text("keep me\n")
    for argv, option in ((["score", model, "-o", old], "--output"), (["eval", model, "-o", old], "--output"),
                         (["peel", model, "--plot", old], "--plot"), (["export-gguf", model, old], "OUTPUT")):
        code, err = _run(argv, capsys)
        assert code == 2 and "loading" not in err
        assert err.strip() == f"error: {option} {old} exists; pass --overwrite to replace it, or choose another path"
    assert old.read_text() == "keep me\n"
    link = base / "link.json"
    link.symlink_to("old.json")
    code, err = _run(["score", model, "--calibration", base / "calib.txt", "--num-prompts", "2", "-o", link,
                      "--overwrite"], capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == "old.json"  # the link is kept, its file replaced
    assert SwapReport.from_json(old).num_blocks == 6
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt", "link.json", "old.json"]


def test_an_output_that_is_not_a_regular_file_is_refused(base, capsys):
    """A FIFO, a device node (and a link to one) are never replaced by a regular file."""
    import stat

    model, fifo, device = base / "base", base / "fifo", base / "null"
    os.mkfifo(fifo)
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        device = None
    (base / "to-fifo").symlink_to("fifo")
    cases = [(["score", model, "-o", fifo], f"--output {fifo} is a FIFO"),
             (["eval", model, "-o", base / "to-fifo", "--overwrite"],
              f"--output {base / 'to-fifo'} (the link's target {_real(fifo)}) is a FIFO"),
             (["peel", model, "--table", fifo], f"--table {fifo} is a FIFO")]
    if device is not None:
        cases.append((["score", model, "-o", device, "--overwrite"], f"--output {device} is a character device"))
    for argv, message in cases:
        code, err = _run(argv, capsys)
        assert code == 2 and "loading" not in err, argv
        assert err.strip() == (f"error: {message}, not a regular file: results are written only to regular files "
                               "(or through a symbolic link to one); give a file's path")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert device is None or stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_corrupt_gguf_file_is_a_clear_error_naming_the_file(base, capsys):
    from hf_layerswap.models import check_gguf_file, load_model

    garbage = base / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(range(7, 71)))
    empty = base / "empty.gguf"
    empty.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # parses, but holds no model
    not_gguf = base / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not GGUF")
    expected = {
        garbage: f"{garbage} is a corrupt or truncated GGUF file: ",
        empty: f"{empty} is not a GGUF model: it names no architecture or holds no tensor",
        not_gguf: f"{not_gguf} is not a GGUF file: it starts with b'PK\\x03\\x04', not b'GGUF'",
    }
    for path, message in expected.items():
        with pytest.raises(ValueError) as err:
            check_gguf_file(path)
        assert str(err.value).startswith(message)
        with pytest.raises(ValueError, match="GGUF"):
            load_model(path)  # the Python API refuses it before from_pretrained
        code, out = _run(["score", path, "-o", base / "r.json"], capsys)
        assert code == 2 and out.startswith(f"error: {message}") and len(out.strip().splitlines()) == 1
        assert "loading" not in out
    code, out = _run(["eval", base, "--gguf-file", "garbage.gguf", "-o", base / "e.json"], capsys)
    assert code == 2 and out.startswith(f"error: {garbage} is a corrupt or truncated GGUF file: ")


def test_a_hub_id_while_offline_is_a_clear_error_before_loading(base, capsys, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, err = _run(["score", "someone/not-cached", "-o", base / "r.json"], capsys)
    assert code == 2
    assert err.strip() == ("error: MODEL 'someone/not-cached' is a Hub id, but the Hub is switched off (HF_HUB_OFFLINE=1) "
                           "and config.json of it is not in the local cache: unset HF_HUB_OFFLINE to download it, or "
                           "give a local folder")
    code, err = _run(["prune", base / "base", base / "out", "--layers", "1", "--tokenizer", "someone/tok"], capsys)
    assert code == 2 and err.startswith("error: --tokenizer 'someone/tok' is a Hub id, but the Hub is switched off")
    assert not (base / "out").exists() and not (base / "r.json").exists()


def test_a_full_disk_at_write_time_is_one_error_line_and_nothing_partial(base, capsys, monkeypatch):
    """ENOSPC in the middle of the last write (the report; the checkpoint folder): exit 1,
    one ``error:`` line, no traceback, and no file or staging folder left behind."""
    import hf_layerswap.hub as hub
    import hf_layerswap.utils.jsonio as jsonio

    def full_disk(text, path, **kwargs):
        with jsonio.atomic_path(path, **kwargs) as tmp:
            tmp.write_text(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    monkeypatch.setattr(jsonio, "write_text_atomic", full_disk)
    code, err = _run(["score", base / "base", "--calibration", base / "calib.txt", "--num-prompts", "2",
                      "-o", base / "r.json"], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: [Errno 28] No space left on device: ") and "Traceback" not in err
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]

    write_card_files = hub.write_card_files

    def full_disk_folder(folder, *args, **kwargs):  # the weights are written by now
        write_card_files(folder, *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "README.md"))

    monkeypatch.setattr(hub, "write_card_files", full_disk_folder)
    code, err = _run(["prune", base / "base", base / "pruned", "--layers", "1"], capsys)
    assert code == 1 and err.strip().splitlines()[-1] == (
        f"error: [Errno 28] No space left on device while writing {(base / 'pruned').resolve()}; nothing was "
        f"written to {(base / 'pruned').resolve()} (its staging folder was removed)")
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


def test_a_full_disk_inside_safetensors_is_one_error_line_naming_the_folder(base, capsys, monkeypatch):
    """safetensors reports a full disk as its own ``SafetensorError`` (not an OSError): ``prune``
    and ``heal`` still exit 1 with one ``error:`` line naming the folder, and leave nothing."""
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    assert main(["prune", str(base / "base"), str(base / "pruned"), "--layers", "2", "3"]) == 0

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    code, err = _run(["prune", base / "base", base / "p2", "--layers", "1"], capsys)
    folder = (base / "p2").resolve()
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: writing {folder} failed (SafetensorError: Error while serializing: I/O error: No space left on "
        f"device (os error 28)); nothing was written to {folder} (its staging folder was removed)")
    code, err = _run(["heal", base / "pruned", base / "base", base / "healed", "--calibration", base / "calib.txt",
                      "--max-tokens", "64", "--seq-len", "16", "--batch-size", "2", "--heldout-prompts", "2"], capsys)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: writing {(base / 'healed').resolve()} failed (SafetensorError")
    # the Trainer checkpoints stay, so the same command resumes instead of training again
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt", "healed.heal-checkpoints", "pruned"]


# ------------------------------------------------------------------ Ctrl-C and --resume

_SLOW_SCORE = """
import sys, time
import hf_layerswap.scoring.checkpoint as checkpoint
from hf_layerswap.cli import main

save = checkpoint.ScoringCheckpoint.save

def save_then_wait(self, *args, **kwargs):  # a slow model: time to interrupt between two parts
    save(self, *args, **kwargs)
    time.sleep(float(sys.argv[1]))

checkpoint.ScoringCheckpoint.save = save_then_wait
sys.exit(main(sys.argv[2:]))
"""


def _score(argv, pause: float, **popen):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_SCORE, str(pause), *map(str, argv)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen,
    )


def test_ctrl_c_exits_130_with_one_line_and_resume_gives_the_uninterrupted_report(base):
    """``score --resume DIR`` interrupted by SIGINT once some batches are checkpointed exits
    130 with one line; the same command again finishes from the checkpoint, and its KLs
    equal those of an uninterrupted run exactly."""
    resume = base / "ckpt"
    args = ["score", base / "base", "--calibration", base / "calib.txt", "--num-prompts", "6", "--batch-size", "1",
            "--resume", resume]
    child = _score([*args, "-o", base / "resumed.json"], pause=1.0)
    try:
        deadline = time.monotonic() + 300
        while len(list(resume.glob("part-*.pt"))) < 2:
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no batch was checkpointed"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130
    assert err.splitlines()[-1] == f"interrupted; run the same command again to continue from the checkpoint in {resume}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not (base / "resumed.json").exists()
    done_before = len(list(resume.glob("part-*.pt")))

    again = _score([*args, "-o", base / "resumed.json"], pause=0.0)
    fresh = _score([*args[:-2], "-o", base / "fresh.json"], pause=0.0)
    for proc in (again, fresh):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    resumed, uninterrupted = (SwapReport.from_json(base / name) for name in ("resumed.json", "fresh.json"))
    assert resumed.metadata["checkpoint"]["resumed_values"] >= done_before > 0
    assert "checkpoint" not in uninterrupted.metadata
    pairs = [json.dumps(p) for p in resumed.to_dict()["pairs"]]
    assert pairs == [json.dumps(p) for p in uninterrupted.to_dict()["pairs"]]  # every KL and SE, bit for bit
    assert len(pairs) == 5


def test_resume_with_nothing_to_score_is_refused(base, capsys):
    code, err = _run(["prune", base / "base", base / "out", "--layers", "1", "--resume", base / "ck"], capsys)
    assert code == 2 and err.strip() == "error: --resume resumes scoring, but with --layers nothing is scored: drop --resume"
    assert not (base / "out").exists() and not (base / "ck").exists()


def test_prune_resume_reuses_the_checkpointed_scores(base, capsys):
    """``prune --resume DIR``: the scoring of a second run with the same DIR is read back
    from the checkpoint (every value resumed), and it removes the same blocks."""
    args = ["--num-to-remove", "1", "--strategy", "greedy", "--calibration", base / "calib.txt", "--num-prompts", "3",
            "--resume", base / "ck"]
    assert _run(["prune", base / "base", base / "first", *args], capsys)[0] == 0
    parts = sorted(p.name for p in (base / "ck").glob("part-*.pt"))
    assert len(parts) == 1  # 3 prompts: one batch (of up to 8), its probes in one group
    assert _run(["prune", base / "base", base / "second", *args], capsys)[0] == 0
    first, second = (json.loads((base / d / "config.json").read_text())["layerswap"] for d in ("first", "second"))
    assert first["removed_layers"] == second["removed_layers"]
    reports = [SwapReport.from_json(base / d / "layerswap_report.json") for d in ("first", "second")]
    assert reports[0].metadata["checkpoint"]["resumed_values"] == 0
    assert reports[1].metadata["checkpoint"]["resumed_values"] == 5  # one interchange value per pair of 6 blocks
    assert [p.interchange for p in reports[0].pairs] == [p.interchange for p in reports[1].pairs]
    assert sorted(p.name for p in (base / "ck").glob("part-*.pt")) == parts  # nothing scored again


# --------- bad reports, budgets and calibration files, refused before loading


def test_cli_prune_refuses_bad_input_and_writes_nothing(matrix_report, tmp_path, capsys, monkeypatch):
    from hf_layerswap.cli import main

    ckpt = tmp_path / "four"
    build("llama", num_blocks=4).save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    matrix_report.to_json(tmp_path / "six.json")
    (tmp_path / "calib.txt").write_text("\n\n".join(t + " " + t for t in SHORT_TEXTS))  # paragraphs >= 50 chars
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(tmp_path / "six.json"),
                 "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert "computed on a model with 6 blocks but this model has 4" in capsys.readouterr().err
    code = main(["prune", str(ckpt), str(out), "--layers", "4"])
    assert code == 2 and not out.exists()
    assert "layer index 4 is out of range for a model with 4 blocks" in capsys.readouterr().err
    # the ghosted objective without the ghosted repair: refused before the model loads
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--objective", "ghosted"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "loading" not in err
    assert "error: LayerSwapConfig(objective='ghosted', recovery=None) is contradictory" in err
    # a budget the rules cannot meet is refused before any scoring is spent on it
    def no_scoring(*args, **kwargs):
        raise AssertionError("scored although the budget was impossible")

    monkeypatch.setattr("hf_layerswap.steps.score_layers", no_scoring)
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "2", "--spacing", "1", "--calibration", str(tmp_path / "calib.txt"),
                 "--num-prompts", "2", "--seq-len", "32"])  # within the model's 64 positions (checked by the estimate)
    assert code == 2 and not out.exists()
    assert "cannot select 2 layers of 4 with spacing=1 and protect=[0, 3]: the rules allow at most 1" in capsys.readouterr().err
    # no output and no temporary folder left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "four", "six.json"]


def test_cli_refuses_bad_report_files_and_a_folder_as_report_output(matrix_report, tmp_path, capsys):
    from hf_layerswap.cli import main

    ckpt = tmp_path / "six"
    build("llama").save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    (tmp_path / "calib.txt").write_text("\n\n".join(t + " " + t for t in SHORT_TEXTS))
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(["prune", str(ckpt), str(out), "--num-to-remove", "1", "--report", str(bad),
                 "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2"])
    assert code == 2 and not out.exists()
    assert f"error: {bad} is not a valid SwapReport JSON file: not a SwapReport dict: got list" in capsys.readouterr().err
    # push: the sidecar is read before anything else happens (no network: the endpoint is a closed port)
    code = main(["push", str(ckpt), "me/six", "--report", str(bad), "--endpoint", "http://127.0.0.1:9"])
    assert code == 2
    assert f"{bad} is not a valid SwapReport JSON file" in capsys.readouterr().err
    (tmp_path / "ev.json").write_text('{"base": ')
    code = main(["push", str(ckpt), "me/six", "--evaluation", str(tmp_path / "ev.json"), "--endpoint", "http://127.0.0.1:9"])
    assert code == 2
    assert f"error: {tmp_path / 'ev.json'} is not valid JSON: Expecting value" in capsys.readouterr().err
    # score -o FOLDER: refused before the model loads (it used to fail after scoring, with a traceback)
    folder = tmp_path / "reports"
    folder.mkdir()
    code = main(["score", str(ckpt), "--calibration", str(tmp_path / "calib.txt"), "--num-prompts", "2", "-o", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "loading" not in err
    assert f"error: --output {folder} is a folder; give the report's file path, e.g. {folder / 'layerswap_report.json'}" in err
    assert list(folder.iterdir()) == []


def test_cli_refuses_a_binary_calibration_file_before_loading(tmp_path, capsys):
    from hf_layerswap.cli import main

    path = tmp_path / "b.bin"
    path.write_bytes(bytes(random_bytes(4096)))
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


def test_prune_resume_into_its_own_output_is_refused_before_the_model_loads(base, capsys, monkeypatch):
    """--resume OUTPUT (or a folder inside it): the run used to complete and then refuse to
    save into the non-empty OUTPUT; now it is refused before loading, dry run or not."""
    import hf_layerswap.cli.prune as prune_verb
    monkeypatch.setattr(prune_verb, "load", lambda args: pytest.fail("the model loaded"))
    out = base / "out"
    scoring = ["--calibration", base / "calib.txt", "--num-prompts", "2"]
    for resume, where in ((out, "is OUTPUT"), (out / "scoring", f"is inside OUTPUT {str(out)!r}")):
        for extra in ([], ["--dry-run"]):
            code, err = _run(["prune", base / "base", out, "--num-to-remove", "1", *scoring, "--resume", resume,
                              *extra], capsys)
            assert code == 2, (resume, extra)
            assert err.startswith(f"error: --resume {str(resume)!r} {where}: the pruned checkpoint is saved into a "
                                  "new or empty folder"), err
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


def test_devices_the_machine_lacks_and_a_device_given_twice_exit_2_before_loading(base, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.backends.mps.is_available", lambda: False)
    cases = [
        (["--device-map", "cuda"], "error: --device-map 'cuda': this machine has no such device; available devices: "
                                   "cpu, disk"),
        (["--device-map", "cuda:0"], "error: --device-map 'cuda:0': this machine has no such device"),
        (["--device-map", "mps"], "error: --device-map 'mps': this machine has no such device"),
        (["--max-memory", "0=20GiB"], "error: --max-memory names accelerator 0, but this machine has no accelerator"),
        (["--max-memory", "cpu=1GiB,cpu=2GiB"], "argument --max-memory: 'cpu=1GiB,cpu=2GiB': device 'cpu' is given "
                                                "twice; give each device once"),
    ]
    for flags, message in cases:
        for argv in (["prune", base / "base", base / "out", "--layers", "1"], ["eval", base / "base", "-o", base / "e.json"],
                     ["prune", base / "base", base / "out", "--num-to-remove", "1", "--dry-run"]):
            code, err = _run([*argv, *flags], capsys)
            assert code == 2 and message in err and "Traceback" not in err and "loading" not in err, (argv, flags, err)
    assert sorted(p.name for p in base.iterdir()) == ["a-file", "base", "calib.txt"]


def test_healing_or_sparsifying_an_offloaded_model_exits_2_before_scoring(base, capsys, monkeypatch):
    """``--max-memory`` small enough that blocks go to ``--offload-folder``: the model can be
    scored and cut, not trained or sparsified in place; refused before any probe runs."""
    import hf_layerswap.steps as steps

    def no_scoring(*args, **kwargs):
        raise AssertionError("scored before the refusal")

    monkeypatch.setattr(steps, "score_layers", no_scoring)
    offload = ["--max-memory", "cpu=60KB", "--offload-folder", base / "off"]
    scoring = ["--num-to-remove", "1", "--strategy", "greedy", "--calibration", base / "calib.txt", "--num-prompts", "2"]
    code, err = _run(["prune", base / "base", base / "h", *scoring, *offload, "--heal"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "error: healing with the student offloaded (" in err and "no --offload-folder" in err
    code, err = _run(["prune", base / "base", base / "s", *scoring, *offload, "--sparsity", "0.5"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "error: sparsity on a model with offloaded weights (model.layers.0." in err
    assert main(["prune", str(base / "base"), str(base / "pruned"), "--layers", "2"]) == 0
    code, err = _run(["heal", base / "pruned", base / "base", base / "healed", *offload], capsys)
    assert code == 2 and "error: healing with the student offloaded (" in err and "Traceback" not in err
    assert not any((base / name).exists() for name in ("h", "s", "healed", "healed.heal-checkpoints"))
