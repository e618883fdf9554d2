"""What :func:`~hf_layerswap.healing.heal` measures around the training, for the record and
the card: perplexity of the dense model, after the cut, after the repair and after healing
(one contract, one text), and lm-eval tasks before and after healing.

The stage "after the cut" of a repaired student is the dense teacher run under the removal
plan of the student's last cut (:func:`~hf_layerswap.layerplan.apply_plan`: the same blocks
skipped, no repair, no weight copied); the stage healing starts from is the student as it
is handed in (after the repair when its last step repaired the cut, else after the cut).
A student already healed since its last cut (a second healing run) starts from that
healing: its stage is ``after_earlier_healing`` (``earlier_healing`` names the run), "after
the cut" is the replayed cut, and "after the repair" is not measured (the repaired weights
are gone), never the earlier run's healed value under another label. A student sparsified
since its last cut and not healed since (:func:`~hf_layerswap.sparsify`, then heal: a recipe's
heal after a sparsify) starts ``after_sparsity``, "after the cut" again the replayed cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from ..evaluation.contract import CONTRACTS, sliding_windows
from ..evaluation.perplexity import contract_tokens, perplexity_of_tokens, window_batches
from ..layerplan import apply_plan, num_blocks, removal_plan
from ..surgery.operators import attached_operators
from ..evaluation.tasks import check_task_names, evaluate_tasks

__all__ = ["HealMeasures", "PERPLEXITY_BATCH", "PERPLEXITY_CONTRACT", "PERPLEXITY_STAGES", "check_eval_tasks",
           "contract_summary", "earlier_healing", "max_positions", "perplexity_forwards", "perplexity_window",
           "replayed_cut", "repair_of_last_cut", "sparsified", "start_stage"]

#: The perplexity stages a healing record can hold, in order (keys of its ``perplexity``).
PERPLEXITY_STAGES = ("dense", "after_cut", "after_repair", "after_earlier_healing", "after_sparsity", "after_healing")
#: The contract of every perplexity healing measures, and its windows per forward.
PERPLEXITY_CONTRACT = "matched"
PERPLEXITY_BATCH = 2


def _evaluated_text(perplexity_text):
    return None if perplexity_text == "embedded" else perplexity_text


def max_positions(model: nn.Module) -> int | None:
    """The model's ``max_position_embeddings`` (its text config's), ``None`` when it has none."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def perplexity_window(positions: int | None) -> tuple[int, int]:
    """``(window, stride)`` of the perplexities healing measures: the
    :data:`PERPLEXITY_CONTRACT` contract's (512, 256), fitted to a model of fewer
    ``positions`` (``max_position_embeddings``): the window is the smaller of the two, and
    the stride keeps the contract's share of it (half)."""
    spec = CONTRACTS[PERPLEXITY_CONTRACT]
    window, stride = spec["window"], spec["stride"]
    if positions is None or positions >= window:
        return window, stride
    fitted = max(2, int(positions))
    return fitted, max(1, stride * fitted // window)


def perplexity_forwards(perplexity_text, tokenizer, positions: int | None = None) -> list[tuple[int, int, int]]:
    """The forward passes of one perplexity evaluation :class:`HealMeasures` runs (the
    :data:`PERPLEXITY_CONTRACT` contract's windows, fitted to ``positions``
    (:func:`perplexity_window`), over ``perplexity_text`` read by ``tokenizer``,
    :data:`PERPLEXITY_BATCH` windows per forward; no model needed).

    Returns:
        one ``(windows, length, keep)`` per forward: windows in the batch, their length
        (tokens) and the positions whose logits the head computes.

    Raises:
        ValueError, FileNotFoundError: a text the evaluation would refuse (the message names it).
    """
    window, stride = perplexity_window(positions)
    ids, window, stride, _ = contract_tokens(_evaluated_text(perplexity_text), tokenizer, contract=PERPLEXITY_CONTRACT,
                                             window=window, stride=stride)
    try:
        spans = sliding_windows(len(ids), window, stride)
    except ValueError as err:  # a text too short to score: name it
        raise ValueError(f"perplexity_text={perplexity_text!r}: {err}") from None
    return [(len(members), length, keep) for length, keep, members in window_batches(spans, PERPLEXITY_BATCH)]


def check_eval_tasks(tasks, path, limit, what: str) -> tuple[list[str] | None, int | float | None]:
    """``(tasks, limit)`` of a healing's task evaluation, checked: ``tasks`` ``None``, one
    lm-eval task name or a non-empty list of them (returned as a list); ``limit`` ``None``,
    an int >= 1 (a whole float becomes an int) or a fraction in (0, 1); ``path`` and
    ``limit`` only with ``tasks``.

    Raises:
        ValueError: naming ``what`` (``"HealConfig"``, ``"heal"``), the field, its value
            and what is allowed.
    """
    if tasks is not None:
        names = [tasks] if isinstance(tasks, str) else tasks
        if not isinstance(names, Sequence) or not names or not all(isinstance(t, str) and t for t in names):
            raise ValueError(f"{what}(eval_tasks={tasks!r}): must be None or a non-empty list of lm-eval task names")
        tasks = list(names)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not (limit >= 1 and float(limit).is_integer() or 0 < limit < 1)):
        raise ValueError(f"{what}(eval_tasks_limit={limit!r}): must be None, an int >= 1 or a fraction in (0, 1)")
    if isinstance(limit, float) and limit >= 1:
        limit = int(limit)
    if tasks is None and (path is not None or limit is not None):
        raise ValueError(f"{what}(eval_tasks_path={path!r}, eval_tasks_limit={limit!r}) without "
                         "eval_tasks: name the lm-eval tasks to measure")
    return tasks, limit


def contract_summary(contract: Mapping) -> dict:
    """The part of a perplexity contract a healing record keeps: ``contract`` (its name),
    ``text`` (the source, a file by its name only), ``text_sha256``, ``window``,
    ``stride`` and ``words``."""
    return {"contract": contract.get("name", "matched"), "text": contract.get("source"),
            "text_sha256": contract.get("text_sha256"), "window": contract.get("window"),
            "stride": contract.get("stride"), "words": contract.get("words")}


def earlier_healing(model: nn.Module) -> int | None:
    """The 1-based number (in ``config.layerswap["healing"]``) of the last healing run since
    the student's last cut (one no later step marked stale), or ``None``: the student is as
    its last removal step (and repair) left it."""
    record = getattr(model.config, "layerswap", None) or {}
    runs = record.get("healing") or []
    current = [n for n, run in enumerate(runs, 1) if isinstance(run, Mapping) and not run.get("stale")]
    return current[-1] if current else None


def sparsified(model: nn.Module) -> bool:
    """Whether :func:`~hf_layerswap.sparsify` pruned ``model`` (``config.layerswap_sparsity``
    names a method)."""
    record = getattr(model.config, "layerswap_sparsity", None)
    return isinstance(record, Mapping) and bool(record.get("method"))


def start_stage(earlier: bool, sparse: bool, repaired: bool) -> str:
    """The perplexity stage a healing run starts from: after an ``earlier`` healing still
    current (it came after any sparsification, which marks earlier healing stale), else
    after a sparsification (``sparse``), else after the repair (``repaired``), else after the cut."""
    if earlier:
        return "after_earlier_healing"
    return "after_sparsity" if sparse else "after_repair" if repaired else "after_cut"


def repair_of_last_cut(model: nn.Module) -> str | None:
    """The repair method of the last removal step of ``model.config.layerswap`` when that
    step repaired its cut (``"ghosted"``, ``"fused"``, ...), else ``None`` (plain removal,
    ``recovery="none"`` or no record)."""
    record = getattr(model.config, "layerswap", None) or {}
    steps = record.get("steps") or []
    method = steps[-1].get("recovery") if steps and isinstance(steps[-1], Mapping) else None
    return method if method not in (None, "none") and record.get("recovery") else None


def replayed_cut(student: nn.Module, teacher: nn.Module) -> list[int] | None:
    """The blocks of ``teacher`` whose removal gives the student's last cut without its
    repair, or ``None`` when the record does not say: the whole record's
    ``removed_layers`` when the teacher has the original depth (``heal PRUNED BASE``), the
    last step's ``removed_layers`` when it has the depth before that step (the pipeline's
    copy taken just before the cut). A teacher carrying repair operators itself gives
    ``None`` (its hooks would sit on the wrong blocks)."""
    record = getattr(student.config, "layerswap", None) or {}
    steps = record.get("steps") or []
    total, kept = num_blocks(teacher), num_blocks(student)
    if attached_operators(teacher):
        return None
    if total == record.get("original_num_hidden_layers"):
        removed = record.get("removed_layers")
    elif steps and isinstance(steps[-1], Mapping) and total == steps[-1].get("num_blocks_before"):
        removed = steps[-1].get("removed_layers")
    else:
        return None
    if not isinstance(removed, list) or not removed or total - len(removed) != kept:
        return None
    return list(removed)


@dataclass
class HealMeasures:
    """The measurements :func:`heal` was asked for.

    Attributes:
        perplexity_text: ``None`` (no perplexity), ``"embedded"`` or a text source
            :func:`~hf_layerswap.evaluation.evaluate_perplexity` accepts (``"matched"``
            contract, no bootstrap).
        eval_tasks: lm-eval task names (``None`` = none); ``eval_tasks_path`` their YAML
            folder, ``eval_tasks_limit`` documents per task (see :func:`evaluate_tasks`).
        tokenizer: the student's tokenizer (both need one).
        progress: the perplexity's progress bar.
        positions: the model's ``max_position_embeddings`` the perplexity window is fitted
            to (:func:`perplexity_window`; :meth:`start` reads the student's).
    """

    perplexity_text: object = None
    eval_tasks: Sequence[str] | None = None
    eval_tasks_path: object = None
    eval_tasks_limit: int | float | None = None
    tokenizer: object = None
    progress: bool = False
    positions: int | None = None

    def check(self) -> None:
        """Refuse, before any work, measurements that need a tokenizer there is not.

        Raises:
            ValueError: ``perplexity_text`` or ``eval_tasks`` without a tokenizer, or bad
                task fields (:func:`check_eval_tasks`).
        """
        self.eval_tasks, self.eval_tasks_limit = check_eval_tasks(self.eval_tasks, self.eval_tasks_path,
                                                                  self.eval_tasks_limit, "heal")
        for name in ("perplexity_text", "eval_tasks"):
            if getattr(self, name) is not None and self.tokenizer is None:
                raise ValueError(f"{name}={getattr(self, name)!r} needs tokenizer= (the student's tokenizer)")

    def check_sources(self) -> None:
        """Refuse, before a prune's scoring, what :meth:`start` would refuse only after it:
        a perplexity text that cannot be read or is too short to score
        (:func:`perplexity_forwards`), lm-eval task names lm-eval does not know
        (:func:`~hf_layerswap.evaluation.tasks.check_task_names`); :meth:`check` first.

        Raises:
            ValueError, FileNotFoundError: naming the text or the tasks. ImportError:
                tasks without lm-eval installed.
        """
        self.check()
        if self.perplexity_text is not None:
            perplexity_forwards(self.perplexity_text, self.tokenizer, self.positions)
        if self.eval_tasks is not None:
            check_task_names(self.eval_tasks, self.eval_tasks_path)

    def start(self, student: nn.Module, teacher: nn.Module) -> dict:
        """Everything measured before training: ``{"perplexity": {stage: ppl, ...}, "tasks":
        TaskResults or None, "contract": ..., "tokens": ...}`` (the perplexity text is
        tokenized once here, by :func:`contract_tokens` with the student's tokenizer, in
        windows fitted to the student's positions (:func:`perplexity_window`), and scored at
        every stage)."""
        out: dict = {"perplexity": {}, "tasks": None, "contract": None, "tokens": None}
        if self.perplexity_text is not None:
            if self.positions is None:
                self.positions = max_positions(student)
            window, stride = perplexity_window(self.positions)
            tokens = out["tokens"] = contract_tokens(_evaluated_text(self.perplexity_text), self.tokenizer,
                                                     contract=PERPLEXITY_CONTRACT, window=window, stride=stride)
            dense = self._perplexity(teacher, tokens)
            out["contract"] = dense.contract
            stages = {"dense": dense.ppl}
            repair, earlier, sparse = repair_of_last_cut(student), earlier_healing(student), sparsified(student)
            if repair is not None or earlier is not None or sparse:  # not the plain cut: replay it on the teacher
                cut = replayed_cut(student, teacher)
                if cut is not None:
                    with apply_plan(teacher, removal_plan(num_blocks(teacher), cut)):
                        stages["after_cut"] = self._perplexity(teacher, tokens).ppl
            start = start_stage(earlier is not None, sparse, repair is not None)
            stages[start] = self._perplexity(student, tokens).ppl
            out["perplexity"] = {"stages": stages, "repair": repair, "start": start, "earlier_healing": earlier}
        if self.eval_tasks is not None:
            out["tasks"] = self._tasks(student)
        return out

    def finish(self, healed: nn.Module, start: dict) -> tuple[dict, dict]:
        """``(perplexity, tasks)`` of the report: the stages with ``after_healing`` added,
        and the tasks before and after (``{}`` for what was not asked)."""
        perplexity, tasks = {}, {}
        if self.perplexity_text is not None:
            stages = {**start["perplexity"]["stages"], "after_healing": self._perplexity(healed, start["tokens"]).ppl}
            contract = start["contract"] or {}
            repair, begin, earlier = (start["perplexity"][k] for k in ("repair", "start", "earlier_healing"))
            perplexity = {**{k: stages.get(k) for k in PERPLEXITY_STAGES}, "start": begin, "repair": repair,
                          **contract_summary(contract)}
            if begin != "after_repair":  # not measured: the student handed in was not the repaired cut
                del perplexity["after_repair"]
            if begin != "after_sparsity":
                del perplexity["after_sparsity"]
            if earlier is None:
                del perplexity["after_earlier_healing"]
            else:
                perplexity["earlier_healing"] = earlier
        if self.eval_tasks is not None:
            before, after = start["tasks"], self._tasks(healed)
            tasks = {"before": before.results, "after": after.results, "settings": before.settings,
                     "versions": before.versions, "task_hashes": before.task_hashes, "n_samples": before.n_samples,
                     "higher_is_better": before.higher_is_better}
            if after.task_hashes != before.task_hashes:
                tasks["mismatch"] = "the task documents or prompts differ between before and after"
        return perplexity, tasks

    def _perplexity(self, model, tokens):
        return perplexity_of_tokens(model, tokens, batch_size=PERPLEXITY_BATCH, bootstrap=0, progress=self.progress)

    def _tasks(self, model):
        return evaluate_tasks(model, list(self.eval_tasks), tokenizer=self.tokenizer, include_path=self.eval_tasks_path,
                              limit=self.eval_tasks_limit)
