"""Publishing against a real HTTP server: the loopback Hub stand-in of ``hub_server.py``.

Why this layout is robust:

- The pushes run in this process with an explicit ``endpoint=`` (``HfApi(endpoint=...)``
  carries it through create_repo, preupload, commit and the tree listing), so they do not
  depend on when ``HF_ENDPOINT`` was read. The fixture also points huggingface_hub's global
  ``constants.ENDPOINT`` at the stand-in (a call that forgot the endpoint still stays on
  loopback) and lifts the suite-wide ``HF_HUB_OFFLINE=1`` only for the duration of a test.
- Downloads go through code that reads the endpoint at import time (``ModelCard.load``,
  ``hf_hub_download``, ``from_pretrained("user/repo")``), so they run in a fresh
  subprocess whose environment sets ``HF_ENDPOINT`` before anything is imported, with its
  own ``HF_HOME``. That client never imports hf_layerswap: the checkpoint must load in
  plain transformers.
"""

from __future__ import annotations

import argparse
import getpass
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from arch_matrix import build, tiny_tokenizer
from conftest import NONFINITE_ADVICE, PARAGRAPHS, tiny_batch, tiny_model, write_paragraphs
from hub_server import HubStandIn
from publish_helpers import (  # noqa: F401 (pruned, report: fixtures)
    BASE_MODEL,
    evaluation_of,
    hand_report,
    pruned,
    pruned_tiny,
    report,
)

import hf_layerswap as hl
from hf_layerswap import SwapReport
from hf_layerswap.card import EVALUATION_FILE, REPORT_FILE
from hf_layerswap.plots import PLOT_FILES
from hf_layerswap.cli.push import add_push_arguments, run_push
from hf_layerswap.hub import HubPushError, PushRefusedError, push_to_hub, save_for_hub

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_layerswapTestTokenABCDEFGH012345"
IDS = [[5, 17, 99, 3, 64, 7, 12, 88], [1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    with HubStandIn() as server:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        yield server


def _download(hub: HubStandIn, repo_id: str, out: Path, token: str) -> dict:
    """Load ``repo_id`` back through the stand-in in a subprocess that never imports hf_layerswap."""
    script = textwrap.dedent(
        """
        import json, shutil, sys
        import torch
        from huggingface_hub import ModelCard, hf_hub_download
        from transformers import AutoModelForCausalLM

        repo, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        # eager attention, as the in-process reference model uses
        model = AutoModelForCausalLM.from_pretrained(repo, attn_implementation="eager")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids)).logits
        torch.save({"logits": logits, "layers": model.config.num_hidden_layers,
                    "layerswap": model.config.layerswap}, out + "/client.pt")
        open(out + "/README.md", "w", encoding="utf-8").write(str(ModelCard.load(repo)))
        shutil.copy(hf_hub_download(repo, "layerswap_report.json"), out + "/report.json")
        assert "hf_layerswap" not in sys.modules, "the client imported hf_layerswap"
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        HF_ENDPOINT=hub.url, HF_HOME=str(out / "hf_home"), HF_TOKEN=token, HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
    )
    result = subprocess.run(
        [sys.executable, "-c", script, repo_id, str(out), json.dumps(IDS)],
        cwd=out, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "client.pt")


def test_push_then_plain_transformers_download(hub, pruned, report, tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    info = push_to_hub(
        pruned, "user/tiny-pruned", report=report, evaluation=evaluation_of(pruned), private=True, token=TOKEN,
        endpoint=hub.url, base_model=BASE_MODEL, license="apache-2.0",
    )
    commits = hub.commits("user/tiny-pruned")
    assert len(commits) == 1 and info.oid == commits[0].oid
    files = hub.files("user/tiny-pruned")
    assert {"README.md", "config.json", "model.safetensors", REPORT_FILE, "layerswap_evaluation.json",
            PLOT_FILES["layer_scores"], PLOT_FILES["protocol_gap"]} <= set(files)
    assert not [name for name in files if name.endswith((".bin", ".pt"))]

    # the private flag and the token reached the server ...
    assert hub.repos["user/tiny-pruned"].private is True
    assert json.loads(hub.requests_to("create")[0].body)["visibility"] == "private"
    # (huggingface_hub's own public registry fetch, when it makes one, carries no token)
    assert {r.headers["authorization"] for r in hub.requests if r.route != "agents"} == {f"Bearer {TOKEN}"}
    # ... and the token is in no uploaded file, log record or console line
    assert not [name for name, data in files.items() if TOKEN.encode() in data]
    out, err = capfd.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out and TOKEN not in err

    client = _download(hub, "user/tiny-pruned", tmp_path, TOKEN)
    with torch.no_grad():
        reference = pruned(input_ids=torch.tensor(IDS)).logits
    assert torch.equal(client["logits"], reference)
    assert client["layers"] == 4
    assert client["layerswap"]["removed_layers"] == [1, 3]
    assert (tmp_path / "README.md").read_bytes() == files["README.md"]
    assert "| 3 | 4 | 0.3 | 0.35 | 0.35 | 0.02 | 0.057 |" in (tmp_path / "README.md").read_text()
    assert SwapReport.from_json(tmp_path / "report.json") == report


def test_second_push_is_a_second_commit(hub, pruned, report):
    first = push_to_hub(pruned, "user/twice", report=report, token=TOKEN, endpoint=hub.url)
    second = push_to_hub(pruned, "user/twice", token=TOKEN, endpoint=hub.url, commit_message="without the report")
    commits = hub.commits("user/twice")
    assert [c.oid for c in commits] == [first.oid, second.oid]
    assert commits[1].parent == first.oid and commits[1].title == "without the report"
    # files this library owns and no longer writes go away in the same commit
    assert sorted(commits[1].deleted) == sorted([REPORT_FILE, PLOT_FILES["layer_scores"], PLOT_FILES["protocol_gap"]])
    assert REPORT_FILE not in hub.files("user/twice")
    # an identical push changes nothing: no third commit, the head is returned
    third = push_to_hub(pruned, "user/twice", token=TOKEN, endpoint=hub.url, commit_message="without the report")
    assert len(hub.commits("user/twice")) == 2 and third.oid == second.oid


def test_default_endpoint_and_branch(hub, pruned):
    info = push_to_hub(pruned, "user/branchy", token=TOKEN, revision="v1")  # endpoint from huggingface_hub
    assert hub.commits("user/branchy", "main") == []
    (commit,) = hub.commits("user/branchy", "v1")
    assert commit.oid == info.oid and "README.md" in commit.files


def test_unreachable_endpoint_is_a_push_error_naming_it(pruned, monkeypatch):
    """A connection that fails raises the HTTP client's own error (the client huggingface_hub
    imported: httpx2 or httpx); push_to_hub turns it into HubPushError, nothing committed."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: the connection itself fails
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(HubPushError, match=rf"could not prepare user/nowhere@main on {re.escape(url)}: .*Nothing was "
                                           r"committed\.") as info:
        push_to_hub(pruned, "user/nowhere", token=TOKEN, endpoint=url)
    assert info.value.committed is False


@pytest.mark.parametrize("mode", [500, 503, "drop"])
def test_transient_failure_is_retried_into_one_commit(hub, pruned, mode):
    hub.fail("commit", mode, times=1)
    info = push_to_hub(pruned, "user/flaky", token=TOKEN, endpoint=hub.url)
    assert [c.oid for c in hub.commits("user/flaky")] == [info.oid]
    assert [r.status for r in hub.requests_to("commit")] == [mode if isinstance(mode, int) else None, 200]


def test_lost_answer_after_the_commit_landed(hub, pruned):
    hub.fail("commit", "drop_after_apply", times=1)
    info = push_to_hub(pruned, "user/lost", token=TOKEN, endpoint=hub.url)
    (commit,) = hub.commits("user/lost")
    assert info.oid == commit.oid
    # the replay was refused by the parent-commit check (412): no second commit
    assert [r.status for r in hub.requests_to("commit")] == [None, 412]


def test_permanent_failure_is_one_clear_error_and_no_commit(hub, pruned):
    hub.fail("commit", 500, times=None)
    with pytest.raises(HubPushError) as caught:
        push_to_hub(pruned, "user/down", token=TOKEN, endpoint=hub.url)
    err = caught.value
    assert err.committed is False and err.repo_id == "user/down" and err.revision == "main"
    assert "failed after huggingface_hub's retries" in str(err) and "500" in str(err)
    assert "no commit was made: user/down@main is unchanged" in str(err)
    assert TOKEN not in str(err)
    assert hub.commits("user/down") == []
    assert len(hub.requests_to("commit")) == 6  # the first try and huggingface_hub's 5 retries


def test_without_xet_the_single_commit_path_behaves_the_same(hub, pruned, monkeypatch):
    """HF_HUB_DISABLE_XET=1: upload_folder falls back to create_commit (always one commit).

    huggingface_hub 2.4 retries the preupload call there but not the commit call itself, so a
    commit-endpoint failure surfaces at once, still as one clear error with no commit.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    hub.fail("preupload", 503, times=1)
    info = push_to_hub(pruned, "user/noxet", token=TOKEN, endpoint=hub.url)
    assert [c.oid for c in hub.commits("user/noxet")] == [info.oid]
    assert [r.status for r in hub.requests_to("preupload")] == [503, 200]
    hub.fail("commit", 500, times=None)
    with pytest.raises(HubPushError, match="no commit was made") as caught:
        push_to_hub(pruned, "user/noxet", token=TOKEN, endpoint=hub.url, evaluation=evaluation_of(pruned))
    assert caught.value.committed is False
    assert len(hub.commits("user/noxet")) == 1 and len(hub.requests_to("commit")) == 2


def _broken_invariants():
    model = pruned_tiny()
    model.config.num_hidden_layers = 5
    return model


def _foreign_scores():
    other = hand_report()
    other.pairs[2].replacement_ji = 0.11  # pair 2-3: d_repl 0.12 -> 0.11, so s(2) and s(3) change
    return other


@pytest.mark.parametrize(
    "case, match",
    [
        ("invariants", "surgery invariants do not hold: config.num_hidden_layers=5 but the decoder has 4 blocks"),
        ("short report", "the report scored 5 blocks but the model was pruned from 6 blocks"),
        ("foreign report", "replacement layer scores differ from those recorded"),
        ("repo id", "repo_id='not a repo' is not a valid Hub repository id"),
        ("no namespace", "give the namespace too"),
        ("evaluation", r"evaluation\['pruned'\]\['ppl'\] must be a finite positive number"),
        ("evaluation without contract", r"evaluation\['base'\] \(ppl 10\) records no contract"),
        ("evaluation of other weights", r"the evaluation does not belong to this model: evaluation\['base'\] measured "
                                        r"weights \w{12} \(HuggingFaceTB/SmolLM2-135M-Instruct\), not the scored base "
                                        r"model's \(before removal\) \w{12}: it is another model's result; "
                                        r"evaluation\['pruned'\] measured weights \w{12} \(tiny-pruned\), not this model's"),
    ],
)
def test_refusals_happen_before_any_request(hub, pruned, report, case, match):
    kwargs = dict(model=pruned, repo_id="user/refused", token=TOKEN, endpoint=hub.url)
    if case == "invariants":
        kwargs["model"] = _broken_invariants()
    elif case == "short report":
        kwargs["report"] = SwapReport(5, [p for p in report.pairs if p.j < 5])
    elif case == "foreign report":
        kwargs["report"] = _foreign_scores()
    elif case == "repo id":
        kwargs["repo_id"] = "not a repo"
    elif case == "no namespace":
        kwargs["repo_id"] = "tiny"
    elif case == "evaluation":
        kwargs["evaluation"] = {"pruned": {"ppl": -1.0}}
    elif case == "evaluation without contract":
        kwargs["evaluation"] = {"base": {"ppl": 10}, "pruned": {"ppl": 5}}
    elif case == "evaluation of other weights":  # the pair of another pruned model, with its identities
        kwargs["evaluation"] = evaluation_of(pruned_tiny(seed=3))
    model = kwargs.pop("model")
    with pytest.raises(PushRefusedError, match=match):
        push_to_hub(model, kwargs.pop("repo_id"), **kwargs)
    assert hub.requests == []


def test_save_for_hub_is_atomic_and_complete(pruned, report, tmp_path):
    target = tmp_path / "out"
    save_for_hub(pruned, target, report=report, evaluation=evaluation_of(pruned), repo_id="user/tiny-pruned")
    names = {p.name for p in target.iterdir()}
    assert {"README.md", "config.json", "model.safetensors", REPORT_FILE, "layerswap_evaluation.json"} <= names
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary sibling left behind
    # the folder and the report written through a temporary file get the modes plain writes get
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "file").write_text("x")
    assert target.stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert (target / REPORT_FILE).stat().st_mode == (tmp_path / "plain" / "file").stat().st_mode
    shutil.rmtree(tmp_path / "plain")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        save_for_hub(pruned, target)
    save_for_hub(pruned, target, overwrite=True)
    assert REPORT_FILE not in {p.name for p in target.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(PushRefusedError, match="surgery invariants"):
        save_for_hub(_broken_invariants(), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_save_for_hub_overwrite_replaces_only_what_it_writes(pruned, report, tmp_path):
    """overwrite=True keeps what the save does not write (a notes.md, a data/ folder, a
    link) and drops only its own stale files at the top (an old shard, an old sidecar)."""
    from transformers import AutoModelForCausalLM

    target = tmp_path / "out"
    save_for_hub(pruned, target, report=report)
    (target / "notes.md").write_text("mine\n")
    (target / "data").mkdir()
    (target / "data" / "train.safetensors").write_bytes(b"user data")  # owned names only count at the top
    (target / "data" / "notes").symlink_to("../notes.md")
    (target / "model-00002-of-00002.safetensors").write_bytes(b"a stale shard of an earlier save")
    save_for_hub(pruned, target, overwrite=True)  # no report this time: its sidecar is stale
    assert (target / "notes.md").read_text() == "mine\n"
    assert (target / "data" / "train.safetensors").read_bytes() == b"user data"
    assert (target / "data" / "notes").is_symlink() and (target / "data" / "notes").read_text() == "mine\n"
    names = {p.name for p in target.iterdir()}
    assert "model-00002-of-00002.safetensors" not in names and REPORT_FILE not in names
    assert {"README.md", "config.json", "model.safetensors", "notes.md", "data"} <= names
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(v, pruned.state_dict()[k]) for k, v in reloaded.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left


_SAVE_IN_STEP = """
import sys, time
from pathlib import Path
import hf_layerswap.hub as hub
from hf_layerswap.cli import main

checkpoint, output, me, other = sys.argv[1:5]
write_card_files = hub.write_card_files

def write_then_wait(folder, *args, **kwargs):  # both writers have passed the emptiness check by now
    write_card_files(folder, *args, **kwargs)
    Path(me).touch()
    deadline = time.monotonic() + 300
    while not Path(other).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

hub.write_card_files = write_then_wait
sys.exit(main(["push", checkpoint, "user/tiny", "--output-dir", output]))
"""


def test_two_processes_saving_into_one_folder_exactly_one_succeeds(tmp_path):
    """Two ``push --output-dir`` runs (``save_for_hub``) into one new folder, held so that
    both pass the emptiness check before either renames: one exits 0, the other exits 2
    with a ``FileExistsError`` refusal, and the folder is the winner's, complete."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_model

    models = [tiny_model("llama", seed=seed) for seed in (1, 2)]
    for k, model in enumerate(models):
        model.save_pretrained(tmp_path / f"ckpt{k}")
    target, ready = tmp_path / "out", [tmp_path / "ready0", tmp_path / "ready1"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    children = [
        subprocess.Popen([sys.executable, "-c", _SAVE_IN_STEP, str(tmp_path / f"ckpt{k}"), str(target),
                          str(ready[k]), str(ready[1 - k])], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for k in range(2)
    ]
    outcomes = [child.communicate(timeout=600) for child in children]
    codes = [child.returncode for child in children]
    assert all(r.exists() for r in ready)  # both writers reached the rename with a complete staged folder
    assert sorted(codes) == [0, 2], outcomes
    winner, loser = codes.index(0), codes.index(2)
    assert f"wrote {target}" in outcomes[winner][0]
    refusal = outcomes[loser][1].strip().splitlines()[-1]  # after transformers' loading bar
    assert refusal.startswith(f"hf-layerswap push: refused: {target} exists and is not an empty folder")
    assert "nothing of this save was left there" in refusal and "Traceback" not in outcomes[loser][1]
    assert "choose another folder, or remove that one" in refusal and "pass overwrite=True" not in refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt0", "ckpt1", "out", "ready0", "ready1"]
    saved = AutoModelForCausalLM.from_pretrained(target)
    expected = models[winner].state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in saved.state_dict().items())
    assert not all(torch.equal(v, models[loser].state_dict()[k]) for k, v in saved.state_dict().items())
    assert (target / "README.md").is_file() and (target / "config.json").is_file()


def test_cli_push_verb(hub, pruned, report, tmp_path, capsys):
    folder = save_for_hub(pruned, tmp_path / "ckpt", report=report, evaluation=evaluation_of(pruned))
    parser = argparse.ArgumentParser(prog="hf-layerswap push")
    add_push_arguments(parser)
    args = parser.parse_args([str(folder), "user/from-cli", "--endpoint", hub.url, "--token", TOKEN,
                              "--base-model", BASE_MODEL, "--private"])
    assert run_push(args) == 0
    (commit,) = hub.commits("user/from-cli")
    assert capsys.readouterr().out.strip() == f"{hub.url}/user/from-cli/commit/{commit.oid}"
    card = commit.files["README.md"].decode()
    assert "| **removed** | **1, 3** | 0.011 |" in card and "ΔPPL = +25.0%" in card
    assert SwapReport.from_dict(json.loads(commit.files[REPORT_FILE])) == report
    bad = parser.parse_args([str(tmp_path / "missing"), "user/x", "--endpoint", hub.url])
    assert run_push(bad) == 2
    assert "is not a checkpoint folder (no config.json)" in capsys.readouterr().err


def test_cli_push_takes_eval_verb_results_and_refuses_what_it_cannot_use(pruned, report, tmp_path, capsys,
                                                                          monkeypatch):
    """--evaluation FILE from `hf-layerswap eval`: a base/pruned pair of its results is published;
    one result alone, unknown keys or a pair without a contract are refused before the model loads
    (they were dropped or published silently)."""
    from hf_layerswap.cli import main

    folder = save_for_hub(pruned, tmp_path / "ckpt", report=report)
    good = evaluation_of(pruned)
    verb = {k: {"model": {"name": "ckpt", "num_blocks": 4}, "perplexity": v, "tasks": None} for k, v in good.items()}
    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps(verb))
    out = tmp_path / "out"
    assert main(["push", str(folder), "user/x", "--evaluation", str(pair), "--output-dir", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "| base | 20.000 |" in card and "| pruned (this model) | 25.000 |" in card and "ΔPPL = +25.0%" in card
    assert json.loads((out / EVALUATION_FILE).read_text())["pruned"]["ppl"] == 25.0
    capsys.readouterr()

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded before the evaluation file was checked")

    lone, extra, bare = tmp_path / "lone.json", tmp_path / "extra.json", tmp_path / "bare.json"
    lone.write_text(json.dumps(verb["pruned"]))
    extra.write_text(json.dumps({**good, "notes": "x"}))
    bare.write_text(json.dumps({"base": {"ppl": 10}, "pruned": {"ppl": 5}}))
    expected = {
        lone: f"error: {lone} is one model's `hf-layerswap eval` result (ckpt), not the base/pruned pair",
        extra: f"error: {extra}: unknown keys ['notes']: allowed 'base', 'pruned'",
        bare: f"error: {bare}: evaluation['base'] (ppl 10) records no contract",
    }
    monkeypatch.setattr("hf_layerswap.cli.push.AutoModelForCausalLM.from_pretrained", no_loading)
    for path, message in expected.items():
        target = tmp_path / f"out-{path.stem}"
        assert main(["push", str(folder), "user/x", "--evaluation", str(path), "--output-dir", str(target)]) == 2
        assert message in capsys.readouterr().err
        assert not target.exists()


def test_optimum_cli_exposes_the_hf_layerswap_verbs(tmp_path):
    """As installed (scripts/install.sh), run from another folder with no PYTHONPATH: the
    command is registered by the installation, not by the working directory."""
    pytest.importorskip("optimum.commands.optimum_cli", reason="optimum is an optional extra")
    cli = Path(sys.executable).with_name("optimum-cli")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "optimum.commands.optimum_cli"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = subprocess.run(command + ["--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "layerswap" in listed.stdout
    push = subprocess.run(command + ["layerswap", "push", "--help"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert push.returncode == 0, push.stderr
    assert "directory" in push.stdout and "repo_id" in push.stdout and "--output-dir" in push.stdout


def test_optimum_command_delegates_to_the_hf_layerswap_parser(monkeypatch, capsys):
    pytest.importorskip("optimum.commands.base", reason="optimum is an optional extra")
    import types

    calls = []

    def build_parser(prog="hf-layerswap"):
        parser = argparse.ArgumentParser(prog=prog)
        sub = parser.add_subparsers(dest="verb")
        add_push_arguments(sub.add_parser("push"))
        return parser

    fake = types.ModuleType("hf_layerswap.cli")
    fake.build_parser = build_parser
    fake.main = lambda argv, prog=None: calls.append((list(argv), prog)) or 0
    monkeypatch.setitem(sys.modules, "hf_layerswap.cli", fake)
    path = REPO_ROOT / "optimum" / "commands" / "register" / "layerswap_cli.py"
    spec = importlib.util.spec_from_file_location("layerswap_cli_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.REGISTER_COMMANDS == [module.LayerSwapCommand]

    parser = argparse.ArgumentParser(prog="optimum-cli")
    command = module.LayerSwapCommand(parser.add_subparsers(), command=module.LayerSwapCommand.COMMAND)
    args = parser.parse_args(["layerswap", "push", "DIR", "me/repo", "--private"])
    with pytest.raises(SystemExit) as done:
        args.func(args).run()
    assert done.value.code == 0 and calls == [(["push", "DIR", "me/repo", "--private"], "optimum-cli layerswap")]
    with pytest.raises(SystemExit):
        parser.parse_args(["layerswap", "-h"])
    assert "usage: optimum-cli layerswap" in capsys.readouterr().out
    assert command.COMMAND.name == "layerswap"


# ------------------------------------- no local path published; a killed save


def _fetch_every_file(hub, repo_id: str, out: Path) -> Path:
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


def test_published_files_carry_no_local_path_component(hub, tmp_path):
    from transformers import AutoModelForCausalLM

    user = getpass.getuser()
    home = tmp_path / "home" / f"{user}-x7q" / "private projects" / "run-2031"
    checkpoint = home / "ckpt-final"
    build("llama").save_pretrained(checkpoint)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(checkpoint)
    calibration = write_paragraphs(home / "calib data" / "valid.txt")
    eval_text = write_paragraphs(home / "eval data" / "held-out.txt", PARAGRAPHS[::-1])

    base = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    config = hl.LayerSwapConfig(num_to_remove=1, calibration=str(calibration), tokenizer=tokenizer,
                                num_prompts=4, seq_len=24, batch_size=2, progress=False)
    pruned_model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config,
                                                  attn_implementation="eager").eval()
    options = dict(tokenizer=tokenizer, window=64, stride=32, bootstrap=20)
    evaluation = {"base": hl.evaluate_perplexity(base, eval_text, **options),
                  "pruned": hl.evaluate_perplexity(pruned_model, eval_text, **options)}
    # the identity names the folder and the weights, nothing above the folder
    assert evaluation["base"].contract["model"]["name"] == "ckpt-final"
    assert len(evaluation["base"].contract["model"]["fingerprint"]) == 64
    assert pruned_model.layerswap_report.metadata["model"]["name"] == "ckpt-final"

    hl.push_to_hub(pruned_model, "user/private-check", tokenizer=tokenizer, report=pruned_model.layerswap_report,
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
    from hf_layerswap.utils.jsonio import STAGING_PREFIX
    from hf_layerswap.utils.jsonio import staging_folder

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
    assert hl.utils.jsonio.remove_stale_staging(parent) == [live.name] and not live.exists()


# --------------- non-finite scores: a removal chosen on them is not published


def test_save_for_hub_refuses_a_removal_chosen_on_non_finite_values(tmp_path):
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=1, calibration=tiny_batch(4, 12), progress=False))
    step = model.config.layerswap["steps"][-1]
    assert step["strategy"] == "search" and math.isfinite(step["decision"]["value"])
    step["decision"]["value"] = math.nan  # as an older version recorded it
    with pytest.raises(hl.PushRefusedError, match=(
            rf"^the removal was chosen on non-finite values: step 0 \(search\) removed {re.escape(str(step['removed_layers']))} on the "
            rf"search's value = NaN; {NONFINITE_ADVICE}, then select again \(or remove explicit layers\)$")):
        hl.save_for_hub(model, tmp_path / "out", report=result.report)
    assert not (tmp_path / "out").exists()


def test_a_prune_that_scored_nothing_is_pushed_with_a_card_that_says_so(hub):
    """A strategy that reads no swap-KL score: no report to publish, and the pushed card says
    that no swap-KL table was measured and why."""
    from conftest import tiny_batch, tiny_model

    model = tiny_model("llama", 6)
    result = hl.prune(model, hl.LayerSwapConfig(num_to_remove=2, strategy="block_influence", calibration=tiny_batch(),
                                                progress=False))
    push_to_hub(model, "user/unscored", report=result.report, token=TOKEN, endpoint=hub.url, base_model=BASE_MODEL)
    files = hub.files("user/unscored")
    assert {"README.md", "config.json", "model.safetensors"} <= set(files) and REPORT_FILE not in files
    card = files["README.md"].decode()
    assert ("No swap-KL tables were measured for this removal: strategy `block_influence` reads no swap-KL score"
            in card)
    assert json.loads(files["config.json"])["layerswap"]["recipe"][0] == {
        "step": "score", "protocols": [], "pairs": 0, "skipped": "strategy `block_influence` reads no swap-KL score",
        "removal_step": 0}
