"""Shared infrastructure with one owner: provenance (library versions, model identity,
fingerprint), files written all or nothing, and the JSON-result contract every report
class follows."""

from __future__ import annotations

import json
import math
import platform

import pytest
import torch
import transformers

import hf_layerswap
from hf_layerswap import layerplan, models, scoring
from hf_layerswap.evaluation import perplexity, rolling
from hf_layerswap.peeling import references as peeling_references
from hf_layerswap.surgery import removal
from hf_layerswap.utils import provenance
from hf_layerswap.utils.jsonio import JsonResult, atomic_path, write_json_atomic, write_text_atomic
from hf_layerswap.peeling import PeelProbe, PeelReport, PeelTrajectory, TrajectoryPoint
from hf_layerswap.recovery import BoundaryFit, RecoveryReport
from hf_layerswap.scoring.report import PairResult, SwapReport
from hf_layerswap.sparsity import SparsityReport
from hf_layerswap.sparsity.report import BlockSparsity, LinearSparsity
from hf_layerswap.evaluation import GenerationCheck, PerplexityResult
from hf_layerswap.selection.criterion import CriterionResult
from hf_layerswap.evaluation.tasks import TaskResults


def test_library_versions_one_collector():
    assert provenance.library_versions() == {
        "hf_layerswap": hf_layerswap.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert hf_layerswap.__version__ == provenance.__version__ == "0.1.0"
    # every module that records versions calls this one function
    assert perplexity.library_versions is rolling.library_versions is provenance.library_versions


def test_identity_has_one_owner():
    assert peeling_references.report_identity is provenance.report_identity
    assert removal.model_fingerprint is layerplan.model_fingerprint
    assert "model_identity" not in models.__all__ and "model_identity" not in scoring.__all__


def test_identity_records(tiny_llama):
    model = tiny_llama
    model.layerswap_identity = {"name": "/home/someone/ckpt", "revision": "abc", "path": "/home/someone/ckpt", "source": None}
    try:
        assert provenance.model_identity(model) == {"name": "ckpt", "revision": "abc", "path": "/home/someone/ckpt", "source": None}
        assert provenance.public_identity(model) == {"name": "ckpt", "revision": "abc", "source": None}
        assert provenance.report_identity(model) == {"name": "ckpt", "revision": "abc", "class": type(model).__name__}
    finally:
        del model.layerswap_identity


# ----------------------------------------------------------------------------- files
def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    target = tmp_path / "sub" / "result.md"
    assert write_text_atomic("first\n", target) == target  # the folder is made
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("half-written")
        raise KeyboardInterrupt
    assert target.read_text() == "first\n" and sorted(p.name for p in target.parent.iterdir()) == ["result.md"]
    with pytest.raises(ValueError):  # NaN is not JSON: nothing is written
        write_json_atomic({"x": math.nan}, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()
    write_json_atomic({"x": [1, 2]}, target.with_suffix(".json"))
    assert json.loads(target.with_suffix(".json").read_text()) == {"x": [1, 2]}
    with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # writers that read the format from the name
        tmp.write_bytes(b"png")
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert target.stat().st_mode == plain.stat().st_mode == (tmp_path / "plot.png").stat().st_mode


def test_atomic_writes_go_through_links_and_refuse_what_is_not_a_regular_file(tmp_path):
    import os
    import stat

    real = tmp_path / "real.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to("real.json")
    assert write_text_atomic("new\n", link) == link
    assert link.is_symlink() and os.readlink(link) == "real.json" and real.read_text() == "new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("made.json")  # a link to a missing file names the file to create
    SwapReport(num_blocks=2, pairs=[PairResult(0, 1, 0.5, 0.25, 0.125)]).to_json(dangling)
    assert dangling.is_symlink() and SwapReport.from_json(tmp_path / "made.json").num_blocks == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo").symlink_to("fifo")
    for path in (fifo, tmp_path / "to-fifo"):
        with pytest.raises(ValueError, match=r"is a FIFO, not a regular file: results are written only to regular"):
            write_json_atomic({"x": 1}, path)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(FileExistsError, match="is a folder; give a file's path"):
        write_text_atomic("x", tmp_path)
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(ValueError, match="cannot be resolved to a file|does not resolve"):
        write_text_atomic("x", tmp_path / "a")
    assert (tmp_path / "a").is_symlink() and (tmp_path / "b").is_symlink()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["a", "b", "dangling.json", "fifo", "link.json", "made.json", "real.json", "to-fifo"]


def test_overwrite_false_refuses_a_file_there_before_or_at_the_rename(tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text("theirs\n")
    with pytest.raises(FileExistsError, match="exists"):
        write_text_atomic("mine\n", kept, overwrite=False)
    late = tmp_path / "late.json"
    with pytest.raises(FileExistsError, match="exists"), atomic_path(late, overwrite=False) as tmp:
        tmp.write_text("mine\n")
        late.write_text("theirs\n")  # another writer, while the result was computed
    assert kept.read_text() == late.read_text() == "theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "late.json"]  # no temporary file left
    assert write_text_atomic("mine\n", tmp_path / "new.json", overwrite=False).read_text() == "mine\n"


# ----------------------------------------------------------------------------- JSON contract
def _examples() -> list[JsonResult]:
    swap = SwapReport(
        num_blocks=3,
        pairs=[PairResult(0, 1, 0.5, 0.25, 0.125), PairResult(1, 2, math.inf, 0.5, math.nan)],
        metadata={"note": [1.5, math.nan]},
    )
    probe = PeelProbe(site=1, span=1, reference="linear", kind="probe", dce=0.1, ci_low=0.05, ci_high=0.2,
                      ce=2.0, explained_variance=0.9, nmse=0.1)
    peel = PeelReport(num_blocks=3, base_ce=1.9, base_ce_ci=(1.8, 2.0), probes=[probe], settings={"spans": [1]})
    return [
        swap,
        RecoveryReport(method="ghosted", removed_layers=[1], epsilon=1e-4, num_tokens=10, hidden_size=4,
                       boundaries=[BoundaryFit(boundary=1, removed=[1], host=0, residual_before=0.5,
                                               residual_after=0.25, condition_number=math.inf, ridge=[0.001])]),
        SparsityReport(
            target_sparsity=0.5, allocation="uniform", method="magnitude", pattern=None,
            blocks=[BlockSparsity(index=0, target=0.5, achieved=0.5, num_params=8, num_zeros=4, statistic=None)],
            linears=[LinearSparsity(name="model.layers.0.mlp.up_proj", block=0, shape=[2, 4], target=0.5, num_zeros=4)],
        ),
        TaskResults(results={"t": {"acc": 0.5, "acc_stderr": math.nan}}, settings={}, versions={}, task_hashes={},
                    n_samples={"t": 2}),
        peel,
        PeelTrajectory([TrajectoryPoint(checkpoint="ckpt", step=1, peel=peel, swap=swap)]),
        PerplexityResult(ppl=12.5, nll=25.25, tokens=10, windows=2, ci_low=math.nan, ci_high=None,
                         contract={"name": "matched"}, window_nll=[12.0, 13.25], window_tokens=[5, 5]),
        GenerationCheck(prompts=["a"], continuations=["b"], new_tokens=[[1, 2]], distinct_2=[1.0], mean_distinct_2=1.0,
                        repetition_rate=0.0, cache_consistent=False, cache_mismatches=[0], cache_errors={0: "boom"},
                        max_new_tokens=2),
        CriterionResult(name="sleb", n=1, removed=[2], scores=[math.inf, 0.5, 0.25], forward_passes=3, block_passes=9,
                        seconds=0.5),
    ]


@pytest.mark.parametrize("result", _examples(), ids=lambda r: type(r).__name__)
def test_json_result_contract(result, tmp_path):
    cls = type(result)
    text = result.to_json()
    assert isinstance(text, str)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} literal in JSON"))  # non-finite values are strings
    path = result.to_json(tmp_path / "r.json")
    assert path == tmp_path / "r.json" and path.read_text(encoding="utf-8") == text
    back_from_file, back_from_text = cls.from_json(path), cls.from_json(text)
    assert back_from_file.to_json() == back_from_text.to_json() == text
    assert cls.from_json(str(path)).to_json() == text

    path.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(ValueError, match=rf"r\.json is not a valid {cls.__name__} JSON file"):
        cls.from_json(path)
    with pytest.raises(FileNotFoundError):
        cls.from_json(tmp_path / "missing.json")


def test_swap_report_json_text_is_unchanged(tmp_path):
    """The mixin writes exactly what the report wrote before (stored runs re-render)."""
    report = _examples()[0]
    expected = json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
    assert report.to_json() == expected
    assert report.to_json(tmp_path / "a.json").read_text(encoding="utf-8") == expected


# ------------------------------------------ a save killed between its renames


def test_the_refusal_at_the_rename_says_what_to_do_from_the_shell_and_from_python(tmp_path):
    from hf_layerswap.utils.jsonio import move_into_place

    target, staged = tmp_path / "out", tmp_path / "staged"
    target.mkdir()
    (target / "notes.md").write_text("x")
    staged.mkdir()
    with pytest.raises(FileExistsError) as refusal:
        move_into_place(staged, target, overwrite=False)
    message = str(refusal.value)
    assert message.startswith(f"{target} exists and is not an empty folder")
    assert "choose another folder, or remove that one and run again" in message  # the command line has no overwrite
    assert "pass overwrite=True" not in message and "from Python, save_for_hub(..., overwrite=True)" in message
    assert staged.is_dir() and (target / "notes.md").read_text() == "x"


def test_a_save_killed_between_its_renames_gets_the_previous_folder_back(tmp_path):
    from hf_layerswap.utils.jsonio import STAGING_PREFIX, remove_stale_staging

    stale = tmp_path / f"{STAGING_PREFIX}run.v2.previous-x1y2z3"
    (stale / "previous").mkdir(parents=True)
    (stale / "previous" / "config.json").write_text("{}")
    assert remove_stale_staging(tmp_path) == [stale.name]
    assert (tmp_path / "run.v2" / "config.json").read_text() == "{}" and not stale.exists()


def test_a_relative_path_that_is_no_link_is_not_called_a_link(tmp_path, monkeypatch):
    import os
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    os.symlink("fifo", "to-fifo")
    with pytest.raises(ValueError) as plain:
        write_json_atomic({"x": 1}, "fifo")
    assert str(plain.value).startswith("fifo is a FIFO, not a regular file")
    with pytest.raises(ValueError) as linked:
        write_json_atomic({"x": 1}, "to-fifo")
    assert str(linked.value).startswith(f"to-fifo (the link's target {tmp_path.resolve() / 'fifo'}) is a FIFO")
    with pytest.raises(FileExistsError, match=r"^sub is a folder"):
        os.mkdir("sub")
        write_text_atomic("x", "sub")
