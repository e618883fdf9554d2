"""What a prune will cost, known before it starts: :func:`estimate_cost`.

One module on purpose: the scoring engine's counts, the search's bound built on them,
the peak memory of the planned engine and the throughput probe that turns FLOPs into
seconds are one walk over the same planned engine; the steps after the selection are
planned in :mod:`~hf_layerswap.cost.steps`.

The model is built on the meta device (``accelerate.init_empty_weights`` +
``AutoModelForCausalLM.from_config``: no weight is read) and the run is planned by the
scoring engine's own planning (:func:`~hf_layerswap.scoring.engine.plan_engine`: batch size,
batches, head/KL chunks, probe groups, the prefix-reuse schedule of
:func:`~hf_layerswap.scoring.probes.schedule`), so the counts are the engine's:

- **block passes**: decoder-block forward calls (one block over one batch); exact for the
  swap-KL scoring; the selection is planned by each strategy's own registry entry
  (:class:`~hf_layerswap.selection.registry.Strategy` ``cost``, given a
  :class:`SelectionPlan`): exact where it does not depend on the scores (``greedy``,
  ``single_removal_kl``, ``block_influence``, ``angular_distance``, ``sleb`` for one
  block), otherwise an upper bound that its phase's ``note`` explains (``auto``: two
  different candidate sets; the search from its per-budget allowances,
  :func:`~hf_layerswap.selection.search_select`; ``beam``; ``sleb`` for more blocks);
  the steps after the selection (a repair, healing, sparsity) are planned from their own
  code by :mod:`~hf_layerswap.cost.steps` and reported per phase (``CostEstimate.phases``);
- **head passes**: output-head calls (one position chunk of one batch, the whole vocabulary
  or one slice), the engine's head/KL phase plus its one-time head check;
- **flops**: 2 x block parameters per position per block pass plus 4 T H per position for
  attention scores, and 2 H V per position per head pass;
- **bytes_moved**: 0 for a model in memory; with weights streamed from CPU memory (or
  disk) to the compute device, each block once per batch and per sweep (slot-major
  streaming) -- the search sweeps once per evaluator call;
- **peak_memory_bytes** per device: weights (those on the device: a streamed model keeps
  its blocks the device map leaves on it and a window of ``2 max_gap + 1`` of its offloaded
  blocks, one more on CUDA where the next block is read ahead, at most the offloaded ones)
  + the engine's working memory (activations,
  head/KL block, fp32 head copy, held probe states, the search's kept reference) + on a
  CPU the process's resident memory when estimating (libraries);
- **seconds**: flops over the throughput measured on this machine by a short probe of one
  block of the model's real shape and its output head (random weights), plus bytes moved
  over the host bandwidth; or from a given :class:`Throughput` (a prediction for another
  machine).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..calibration import CalibrationSet, build_calibration
from ..config import LayerSwapConfig
from .steps import (ModelShape, add_forward, block_flops, check_removal, healing_phase, measure_lines, measure_tokenizer,
                    recovery_phase, sparsity_phase, text_tokenizer)
from ..models import BUNDLED, DTYPES, bundled_checkpoint_dir, resolve_dtype
from ..layerplan import decoder_blocks, num_blocks, removal_plan
from ..scoring.rule import resolve_protect
from ..scoring.engine import head_fixed_bytes, KL_BLOCK_ENTRY_BYTES, plan_engine
from ..scoring.head import Head, UPCAST_PIECE_BYTES, linear32, mixed_gemm, param_dtype, text_config
from ..scoring.kl import OnlineKL
from ..scoring.settings import (EngineSettings, MemoryBudget, batch_activation_bytes, device_memory_budget,
                                kl_block_bytes, resolve_memory)
from ..scoring.slotmajor import blocks_offloaded, movable_blocks
from ..scoring.layerscores import swap_plans
from ..selection import STRATEGIES
from ..selection.nll import NLLSizing
from ..selection.registry import strategy_entry
from ..steps import recipe_steps
from ..utils.registry import Options

__all__ = ["CostEstimate", "SelectionPlan", "StepPlan", "Throughput", "estimate_cost", "forwards_phase", "measure_throughput"]


@dataclass
class Throughput:
    """Sustained rates of the machine that will run the prune.

    Attributes:
        block_flops_per_second: decoder-block forward FLOP/s at the model's dtype.
        head_flops_per_second: output-head GEMM FLOP/s (fp32, as the engine runs it),
            with the time of its KL against the reference (:class:`~.scoring.kl.OnlineKL`'s
            float64 sums over the vocabulary) included.
        host_bytes_per_second: weight streaming bandwidth, host to compute device (B/s).
        source: how the rates were obtained (a probe on this machine, or assumed).
    """

    block_flops_per_second: float
    head_flops_per_second: float
    host_bytes_per_second: float = 25e9
    source: str = "given"

    def seconds(self, phase: Mapping) -> float:
        """Predicted wall seconds of a ``phase`` (a mapping with ``block_flops``,
        ``head_flops`` and, optionally, ``bytes_moved``): each part over its rate."""
        return (phase["block_flops"] / self.block_flops_per_second
                + phase["head_flops"] / self.head_flops_per_second
                + phase.get("bytes_moved", 0) / self.host_bytes_per_second)

    def __post_init__(self):
        for name in ("block_flops_per_second", "head_flops_per_second", "host_bytes_per_second"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Throughput {name}={value!r}: must be a finite number > 0 (a rate per second)")


@dataclass
class CostEstimate:
    """The predicted cost of one prune (:func:`estimate_cost`).

    Attributes:
        block_passes: decoder-block forward calls (one block over one batch).
        head_passes: output-head calls (one position chunk of one batch).
        flops: floating-point operations (multiply-add = 2).
        bytes_moved: weight bytes brought to the compute device (0 for a model in memory).
        peak_memory_bytes: ``{device: bytes}`` at the peak.
        seconds: predicted wall time.
        exact: whether the passes are exact (False: some phase's count is an upper bound).
        phases: the breakdown per step, in the order the prune runs them
            (:func:`~hf_layerswap.steps.recipe_steps`): ``"scoring"``, ``"selection"``, then
            the steps after the removal, ``"recovery"``, ``"healing"``, ``"sparsity"`` (in a
            recipe's order; a kind's second step ``"healing 2"``, ...); each with ``block_passes``, ``head_passes``, ``block_flops``,
            ``head_flops``, ``flops``, ``bytes_moved``, ``seconds`` and ``exact``; the later
            steps also with ``memory_bytes`` (their peak) and ``note``; healing with
            ``trainable_params``, ``trainable_tensors`` and ``optimizer_bytes``
            (gradients + AdamW state + the early stop's best copy), and for its
            measurements ``perplexity`` (stages, forwards per stage, passes: exact),
            ``tasks`` (lm-eval forwards per task and run, passes: an upper bound) and ``not_estimated``
            (what is left out, and why) (:func:`~hf_layerswap.cost.steps.heal_measures`).
        derivation: per field, how it was derived (sentences).
        throughput: the rates used for ``seconds``.
        memory_parts: bytes of the peak's parts: ``weights``, ``working`` (the engine's at
            its largest: ``max(scoring, selection + reference_kept)``), ``scoring`` (the
            scoring engine's working memory: a batch's activations, the head/KL block, the
            KL's float64 temporaries, the held final rows, the head's working piece),
            ``selection`` (the same for one engine call of the selection, planned at what the
            budget leaves beside the kept reference), ``reference_kept`` (the kept dense
            reference of a strategy that keeps one: at most half the budget; the rest is the
            engine calls'),
            ``kl_temporaries`` (the scoring KL's float64 temporaries beside its head/KL
            block, counted in ``working``), ``steps`` (the
            largest peak of the steps after the selection), ``steps_working`` (per step after
            the selection, its bytes beyond the weights on the compute device: the repair's
            captures and moments as its fit takes them under the budget, the sparsification's
            cached block inputs and outputs and statistics, healing's teacher, optimizer state,
            saved activations and logits), ``steps_host`` (a repair's float64 moments kept in
            host memory on an accelerator, in ``peak_memory_bytes["cpu"]``), ``budget`` (the
            one working-memory budget every step was planned under) and ``process`` (this
            process's resident memory when estimating on a CPU).
    """

    block_passes: int
    head_passes: int
    flops: float
    bytes_moved: int
    peak_memory_bytes: dict[str, int]
    seconds: float
    exact: bool
    phases: dict = field(default_factory=dict)
    derivation: dict = field(default_factory=dict)
    throughput: Throughput | None = None
    memory_parts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """A short block of lines for a terminal."""
        source = f" ({self.throughput.source})" if self.throughput is not None else ""
        bounded = [name for name, p in self.phases.items() if not p.get("exact", True)]
        bound = "" if self.exact else f" (upper bound: {', '.join(bounded) or 'the search'})"
        mem = ", ".join(f"{d} {b / 2**30:.2f} GiB" for d, b in self.peak_memory_bytes.items())
        return [
            f"estimated cost{bound}: {self.block_passes:,} block passes, {self.head_passes:,} head passes, "
            f"{self.flops / 1e12:.2f} TFLOP",
            f"  peak memory: {mem}; weights moved: {self.bytes_moved / 2**30:.2f} GiB",
            f"  about {_duration(self.seconds)}{source}",
            *(f"  {name:<9} {p['block_passes']:>10,} block passes {p['head_passes']:>8,} head passes "
              f"{p['flops'] / 1e12:8.3f} TFLOP  {_duration(p['seconds']):>7}" + ("" if p["exact"] else "  (upper bound)")
              for name, p in self.phases.items()),
            *(line for name, p in self.phases.items() if name.split()[0] == "healing" for line in measure_lines(p)),
        ]


def forwards_phase(shape: ModelShape, forwards, blocks: int) -> dict:
    """The passes and FLOPs of model forwards through ``blocks`` blocks: ``forwards`` is one
    ``(windows, length, keep)`` per forward (windows in the batch, their length in tokens,
    the positions whose logits the head computes), as
    :func:`~hf_layerswap.evaluation.perplexity.window_batches` groups a perplexity
    evaluation's windows. Returns ``{"block_passes", "head_passes", "block_flops",
    "head_flops"}`` (price it with :meth:`~hf_layerswap.cost.Throughput.seconds`)."""
    phase = {"block_passes": 0, "head_passes": 0, "block_flops": 0.0, "head_flops": 0.0}
    for windows, length, keep in forwards:
        add_forward(phase, shape, blocks, windows, length, head_rows=keep)
    return phase


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ------------------------------------------------------------------------- the model
def meta_model(model_or_path, dtype=None) -> nn.Module:
    """A model whose weights are on the meta device (or the given model itself): built from
    ``model_or_path``'s config (a model, a config, a checkpoint folder, a bundled name or a Hub
    id) at ``dtype`` (None or ``"auto"``: the config's), its tied weights tied.

    Raises:
        ValueError: a GGUF file, a folder without config.json, or a name no config is read from.
        TypeError: ``model_or_path`` of another type.
    """
    if isinstance(model_or_path, nn.Module):
        return model_or_path
    if isinstance(model_or_path, PretrainedConfig):
        cfg = model_or_path
    elif isinstance(model_or_path, (str, os.PathLike)):
        name = os.fspath(model_or_path)
        path = Path(name).expanduser()
        if name in BUNDLED:
            path = bundled_checkpoint_dir(name)
        if path.suffix == ".gguf":
            raise ValueError(f"model_or_path={name!r} is a GGUF file: estimate_cost reads a checkpoint's config.json; "
                             "give the checkpoint folder, or load the model and pass it")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"model_or_path={name!r} is a folder without config.json; give a transformers checkpoint")
        local = name.startswith((".", "/", "~"))  # a path, never a Hub id
        if not path.exists() and (name.count("/") != 1 or local):
            raise ValueError(f"model_or_path={name!r} is neither a local checkpoint folder, a bundled name "
                             f"({sorted(BUNDLED)}) nor a Hub id 'owner/name'")
        try:
            cfg = AutoConfig.from_pretrained(str(path) if path.exists() else name)
        except (OSError, ValueError) as err:  # a Hub id that is not there (or not cached, offline)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"model_or_path={name!r}: no config.json could be read from it as a local folder, a "
                             f"bundled name ({sorted(BUNDLED)}) or a Hub id ({reason})") from None
    else:
        raise TypeError(f"model_or_path must be a model, a config, or a path / Hub id; got {type(model_or_path).__name__}")
    dtype = None if dtype in (None, "auto") else dtype
    dtype = dtype or getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype) if dtype.removeprefix("torch.") in DTYPES else getattr(torch, dtype)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.tie_weights()  # tied embeddings are one tensor, as after from_pretrained
    return model


def _calibration(model, cfg: LayerSwapConfig, calibration, tokenizer) -> tuple[CalibrationSet, bool]:
    """``(the prompts prune will score, whether they are the real ones)``: ``calibration`` or
    ``cfg.calibration`` read as :func:`~hf_layerswap.prune` reads it
    (:func:`~hf_layerswap.calibration.build_calibration`: given tensors checked and cut to
    ``num_prompts``, a text source tokenized); ``num_prompts`` full prompts of ``seq_len``
    tokens (the most there can be) without a tokenizer to read a text source, or when the
    prune reads no prompt (given ``layers``, no repair, no sparsity)."""
    if isinstance(calibration, CalibrationSet):
        return calibration, True
    if calibration is not None and not isinstance(calibration, Mapping):
        raise TypeError(f"calibration must be a CalibrationSet, a dict of input_ids/attention_mask or None; "
                        f"got {type(calibration).__name__}")
    source = cfg.calibration if calibration is None else calibration
    reads = any(step.needs_calibration(None) for step in recipe_steps(cfg))
    reader = None
    if not isinstance(source, (CalibrationSet, Mapping)):
        reader = text_tokenizer(model, cfg, tokenizer, required=False) if reads else None
        if reader is None:
            ids = torch.zeros(cfg.num_prompts, cfg.seq_len, dtype=torch.long)
            return CalibrationSet(ids, torch.ones_like(ids), f"{cfg.num_prompts} full prompts of {cfg.seq_len} "
                                  "tokens (no tokenizer to read the calibration text: the most there can be)"), False
    return build_calibration(source, reader, num_prompts=cfg.num_prompts, seq_len=cfg.seq_len, seed=cfg.seed), True


# ---------------------------------------------------------------------- the counts
def _engine_counts(model, calib, plans, settings, *, streamed: bool | None = None, reference_cache=None) -> dict:
    """Block passes, block loads, head calls and row-weighted head work of one engine run
    of ``plans``: its :class:`~hf_layerswap.scoring.engineplan.EnginePlan` (``plan``)."""
    plan = plan_engine(model, calib, plans, settings, reference_cache, streamed=streamed).plan(streamed=streamed)
    return {"block_passes": plan.block_evaluations, "head_passes": plan.head_calls, "head_rows": plan.head_rows,
            "block_tokens": plan.block_tokens, "block_loads": plan.block_loads, "plan": plan}


@dataclass
class SelectionPlan:
    """What a strategy's cost estimate (its registry entry's ``cost``,
    :class:`~hf_layerswap.selection.registry.Strategy`) plans from, and the counting helpers
    it uses: the engine's own planning for the calls it makes (:meth:`engine`,
    :meth:`evaluator`), plain model forwards over the batches (:meth:`forwards`), and
    :meth:`counts` to sum them into the phase's dict.

    Attributes:
        model: the model (on the meta device, or the loaded one: nothing runs on it).
        calibration: the prompts the prune reads (:class:`CalibrationSet`).
        config: the prune's :class:`~hf_layerswap.LayerSwapConfig`.
        settings: the engine settings of an evaluator call (``plan_kl`` at the config's
            batch size and what the prune's one working-memory budget leaves beside the kept
            reference: :meth:`~hf_layerswap.scoring.settings.MemoryBudget.split`).
        memory_budget: the bytes a strategy's own reference cache may keep (its share of
            that budget, as :class:`~hf_layerswap.selection.objectives.SetObjective` takes it).
        streamed: the blocks stream to the compute device (``True``: every block, as for a
            model on the meta device; ``None``: the model's own offloaded blocks; ``False``:
            none), for the block loads of :meth:`engine`.
        device: where the prune computes (the head's fixed working piece of :meth:`nll_working`).
    """

    model: nn.Module
    calibration: CalibrationSet
    config: LayerSwapConfig
    settings: EngineSettings
    memory_budget: int
    streamed: bool | None = None
    device: torch.device = torch.device("cpu")

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.model)

    @property
    def num_to_remove(self) -> int:
        return int(self.config.num_to_remove)

    @property
    def options(self) -> Options:
        """The strategy's typed options as the prune passes them (its entry's ``option_class``
        from the config's ``strategy_options`` and the fields that set options, e.g.
        ``max_evaluations``; the defaults for the rest)."""
        entry = self.config.selection_entry()
        typed = entry.option_class.names()
        return entry.option_class.from_mapping({k: v for k, v in self.config.selection_options().items() if k in typed})

    @property
    def allowed(self) -> list[int]:
        """The blocks the strategy may remove (not in ``config.protect``), ascending."""
        protected = resolve_protect(self.config.protect, self.num_blocks)
        return [i for i in range(self.num_blocks) if i not in protected]

    @property
    def batches(self) -> list[tuple[int, int]]:
        """``(positions, real positions)`` of each batch of ``config.batch_size`` prompts,
        trailing padding columns trimmed as :meth:`CalibrationSet.batches` yields them."""
        return [(ids.numel(), int(mask.sum())) for ids, mask in self.calibration.batches(self.config.batch_size)]

    def engine(self, plans, *, settings: EngineSettings | None = None, reference_cache=None) -> dict:
        """The passes and block loads of one scoring-engine call (``plan_kl``) over
        ``plans``, exact: its batches, probe schedule or slot-major passes, head/KL chunks;
        ``plan`` the engine's :class:`~hf_layerswap.scoring.engineplan.EnginePlan`.
        ``reference_cache``: the kept reference the call finds (default none)."""
        return _engine_counts(self.model, self.calibration, plans, self.settings if settings is None else settings,
                              streamed=self.streamed, reference_cache=reference_cache)

    def probe_blocks(self, set_size: int, *, mode: str = "shared") -> int:
        """The most blocks one removal set of ``set_size`` blocks runs per batch: from its
        first removed block, at the earliest the first removable one (``mode="none"``:
        the whole plan)."""
        kept = self.num_blocks - set_size
        return kept if mode == "none" else kept - min(self.allowed[0], kept - 1)

    def evaluator(self, sets: int, set_size: int, planned=None) -> dict:
        """An upper bound of one ``plan_kl`` call over ``sets`` distinct removal sets of
        ``set_size`` blocks: the reference sweep, each set from the first removable block
        without prefix sharing (:meth:`probe_blocks`), the head/KL phase of ``sets``
        probes per batch and the one-time head check (``planned``: the
        :class:`~hf_layerswap.scoring.engineplan.EnginePlan` of a call at these settings;
        default one planned here)."""
        if sets <= 0:
            return {"block_passes": 0, "head_passes": 0, "head_rows": 0, "block_tokens": 0}
        planned = planned if planned is not None else self.engine({0: removal_plan(self.num_blocks, [0])})["plan"]
        per_set = self.probe_blocks(set_size, mode=planned.prefix_reuse)
        blocks = heads = rows_done = tokens = 0
        for batch in planned.batches:
            calls, work = planned.head_work(batch.real_positions, sets)
            per_batch = planned.num_blocks + sets * per_set
            blocks, heads, rows_done = blocks + per_batch, heads + calls, rows_done + work
            tokens += batch.positions * per_batch
        heads += planned.head_check_calls  # each call's engine checks its head once
        return {"block_passes": blocks, "head_passes": heads, "head_rows": rows_done, "block_tokens": tokens}

    def reference_batches(self, planned) -> int:
        """Batches whose dense reference a kept-reference cache holds under
        :attr:`memory_budget` (:class:`~hf_layerswap.scoring.reference.ReferenceCache`, in
        batch order; ``planned``, an :class:`~hf_layerswap.scoring.engineplan.EnginePlan`,
        gives the batches)."""
        return _reference_batches(planned, self.memory_budget)

    def nll_sizing(self, budget: int | None = None) -> NLLSizing:
        """How the calibration NLL (:func:`~hf_layerswap.selection.nll.plan_nll`) runs the
        output head under ``budget`` bytes (default the engine calls' share,
        ``settings.max_memory``): a batch's activations, the head's fixed working piece on
        :attr:`device` (for an offloaded head, one vocabulary slice read beside it:
        :func:`~hf_layerswap.scoring.engine.head_fixed_bytes`), its row slices or, for an
        offloaded head, its blocks of rows x vocabulary (:class:`~hf_layerswap.selection.nll.NLLSizing`)."""
        budget = resolve_memory(self.settings.max_memory, self.device).bytes if budget is None else int(budget)
        es = torch.finfo(param_dtype(self.model)).bits // 8
        cfg = text_config(self.model)
        activations = batch_activation_bytes(cfg, self.num_blocks, self.config.batch_size, self.calibration.seq_len, es)
        head = Head(self.model)
        vocab, hidden = (int(d) for d in head.module.weight.shape)
        if head.streamed:
            fixed = head_fixed_bytes(head)
        else:
            half = head.module.weight.dtype != torch.float32 and not (
                self.device.type == "cuda" or mixed_gemm(self.device, head.module.weight.dtype))
            fixed = min(4 * vocab * hidden, UPCAST_PIECE_BYTES) if half else 0
        return NLLSizing.of(head, budget, activations, fixed, hidden, es, self.config.batch_size,
                            self.calibration.seq_len)

    def nll_working(self, budget: int | None = None, passes: int | None = None) -> int:
        """Bytes the calibration NLL (:func:`~hf_layerswap.selection.nll.plan_nll`) holds
        at its peak under ``budget`` bytes (:meth:`nll_sizing`): a batch's activations, the
        head's fixed working piece and one row slice of fp32 logits and log-softmax
        (:func:`~hf_layerswap.selection.nll.nll_working_bytes`), or for an offloaded head the
        final rows of one head phase and one block of rows x vocabulary
        (:meth:`~hf_layerswap.selection.nll.NLLSizing.working_bytes`; of at most ``passes``
        head passes per batch, when given), for the batch with the most real positions."""
        return self.nll_sizing(budget).working_bytes(max((real for _, real in self.batches), default=1), passes)

    @property
    def predicted_rows(self) -> list[int]:
        """Positions of each batch that predict a real token from a real one (the rows the
        calibration NLL runs the head on)."""
        return [int((mask[:, 1:] * mask[:, :-1]).sum()) for _, mask in self.calibration.batches(self.config.batch_size)]

    def nll_head_loads(self, passes_per_call, budget: int | None = None) -> int:
        """Whole reads of an offloaded output head's weight by calibration-NLL calls
        (:func:`~hf_layerswap.selection.nll.plan_nll`) with ``passes_per_call[c]`` head
        passes per batch each (the reference's, where the call sweeps it, and one per
        distinct plan): one per head phase of :meth:`~hf_layerswap.selection.nll.NLLSizing.group`
        passes, per batch (:meth:`nll_sizing` under ``budget``); 0 for a head in memory."""
        sizing = self.nll_sizing(budget)
        return sum(sizing.head_loads(rows, int(items)) for rows in self.predicted_rows for items in passes_per_call)

    def forwards(self, blocks_per_batch: int, heads_per_batch: int = 0, *, predicted_rows: bool = False) -> dict:
        """Model forwards over every batch of ``config.batch_size`` prompts: ``blocks_per_batch``
        block calls and ``heads_per_batch`` output-head calls each, over every position, or
        (``predicted_rows``: the calibration NLL's row slices,
        :func:`~hf_layerswap.selection.nll.plan_nll`) over the real positions followed by a
        real one."""
        batches = self.batches
        rows = sum(self.predicted_rows) if predicted_rows else sum(n for n, _ in batches)
        return {"block_passes": blocks_per_batch * len(batches), "head_passes": heads_per_batch * len(batches),
                "head_rows": heads_per_batch * rows,
                "block_tokens": blocks_per_batch * sum(n for n, _ in batches)}

    @staticmethod
    def counts(*parts: Mapping, exact: bool, note: str, **extra) -> dict:
        """The phase's dict: the passes of ``parts`` summed, ``exact`` (False: an upper
        bound), ``note`` (how they were counted) and any ``extra`` fields."""
        out = {k: sum(int(p.get(k, 0)) for p in parts)
               for k in ("block_passes", "head_passes", "head_rows", "block_tokens")}
        if any("block_loads" in p for p in parts):  # only where every part counted its block loads
            out["block_loads"] = sum(int(p.get("block_loads", 0)) for p in parts) if all(
                "block_loads" in p for p in parts) else None
        return {**out, "exact": bool(exact), "note": note, **extra}


# ---------------------------------------------------------------------- throughput
@torch.no_grad()
def measure_throughput(model: nn.Module, batch_size: int, seq_len: int, *, device=None, repeats: int = 5) -> Throughput:
    """Time one block of ``model``'s shape and its output head on ``device`` (random
    weights, ``batch_size`` x ``seq_len`` positions): FLOP/s of each, best of ``repeats``.

    Returns:
        a :class:`Throughput` (``source`` says what was timed); host bandwidth: a timed
        copy of the block's weights to ``device`` (the CPU's memory bandwidth on a CPU).
    """
    device = torch.device(device or "cpu")
    cfg = _one_block_config(model)
    dtype = _weights_dtype(model)
    with init_empty_weights():  # only the block gets memory; the embeddings and head stay on meta
        small = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    for module in small.modules():  # buffers (rotary frequencies) to the probe's device
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)
    _, _, blocks = decoder_blocks(small)
    block = blocks[0].to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    hidden = int(cfg.hidden_size)
    captured: dict = {}

    def capture(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)
        raise _Captured

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        small(inputs_embeds=torch.randn(batch_size, seq_len, hidden, dtype=dtype, device=device), use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    block_params = sum(p.numel() for p in block.parameters())
    block_seconds = _best(lambda: block(*captured["args"], **captured["kwargs"]), repeats, device)
    # the head/KL phase on a slice of the vocabulary of up to 32k entries (the rate is the same):
    # a probe's head GEMM in the weights' dtype with fp32 logits (linear32), then its KL against
    # the reference folded in (OnlineKL.add), as the engine runs them
    w = torch.randn(min(ModelShape(model).vocab, 32768), hidden, device=device).to(dtype)
    rows = torch.randn(min(batch_size * seq_len, 1024), hidden, device=device).to(dtype)
    acc = OnlineKL(rows.shape[0], 1, device)
    weights = acc.reference(0, rows.shape[0], linear32(rows, w))
    head_seconds = _best(lambda: acc.add(0, 0, rows.shape[0], weights, linear32(rows, w)), repeats, device)
    flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()]).cpu()
    copy_seconds = _best(lambda: flat.to(device, copy=True), repeats, device)
    return Throughput(
        block_flops_per_second=block_flops(block_params, batch_size * seq_len, seq_len, hidden) / block_seconds,
        head_flops_per_second=2.0 * rows.shape[0] * hidden * w.shape[0] / head_seconds,
        host_bytes_per_second=flat.numel() * flat.element_size() / copy_seconds,
        source=f"probe on {device}: one block over {batch_size}x{seq_len} positions and the head, "
               f"{torch.get_num_threads()} thread(s)",
    )


class _Captured(Exception):
    """Stops the probe's forward once the block's inputs are captured."""


def _best(fn, repeats: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return max(min(times), 1e-9)


def _one_block_config(model):
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.num_hidden_layers = 1
    for name in ("layer_types",):
        if getattr(cfg, name, None):
            setattr(cfg, name, list(getattr(cfg, name))[:1])
    return cfg


def _weights_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


# ---------------------------------------------------------------------------- memory
def _offloaded(model) -> bool:
    """Blocks kept off the compute device (accelerate's CPU or disk offload), by the device map:
    a "disk" entry, or "cpu" beside another device (a model loaded whole on disk counts; one
    whole on the CPU does not). :func:`~.scoring.slotmajor.blocks_offloaded` reads the hooks."""
    places = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    return "disk" in places or ("cpu" in places and len(places) > 1)


def _streamed_blocks(model, stream_weights) -> int:
    """How many decoder blocks the run moves to the compute device: every block with
    ``stream_weights=True``, else the blocks the device map offloads (their hooks,
    :func:`~.scoring.slotmajor.movable_blocks`); the others stay on the device."""
    _, _, blocks = decoder_blocks(model)
    return len(blocks) if stream_weights else len(movable_blocks(blocks))


def _working_bytes(plan, search_reference: int) -> int:
    """The engine's working memory at its peak, from its
    :class:`~hf_layerswap.scoring.engineplan.EnginePlan`: activations of a batch, the
    head/KL block, what the head's GEMM holds beside it (one vocabulary slice of an
    offloaded head, which is streamed; one upcast piece of a half-precision weight on a
    CPU), the held probe states, the kept reference."""
    kl_block = KL_BLOCK_ENTRY_BYTES * plan.kl_chunk * plan.vocab_chunk  # OnlineKL's weights and logits
    real = plan.batches[0].real_positions if plan.batches else 0
    group = min(plan.flush_size(real), plan.probes)
    held = group * real * plan.hidden * plan.element_bytes
    kl_temps = _kl_temporaries(plan, real, group) if plan.stream_logits else 0
    return plan.activation_bytes + kl_block + kl_temps + plan.head_working_bytes + held + search_reference


def _kl_temporaries(plan, rows: int, probes: int) -> int:
    """Bytes of the float64 temporaries of the engine's KL beside its head/KL block
    (:class:`~hf_layerswap.scoring.kl.OnlineKL`): two float64 arrays of one row block
    (``plan.kl_block_bytes`` of fp32, so up to ``4 * kl_block_bytes``: :func:`~.scoring.kl.row_blocks`)
    and the per-row state of ``rows`` positions (running maximum, sums, and each of
    ``probes`` probes' two sums), 8 bytes each."""
    width = plan.vocab_chunk
    block_rows = min(plan.kl_chunk, max(1, plan.kl_block_bytes // (4 * max(1, width))))
    return 2 * 8 * block_rows * width + 8 * rows * (3 + 2 * probes)


def _reference_entries(plan, budget: int) -> list[int]:
    """Bytes of each batch entry the search's reference cache keeps: the streams entering
    blocks 1..L-1 and the final hidden rows, in batch order while they fit ``budget``
    (:class:`~hf_layerswap.scoring.reference.ReferenceCache`)."""
    total, kept = 0, []
    for batch in plan.batches:
        entry = ((plan.num_blocks - 1) * batch.positions + batch.real_positions) * plan.hidden * plan.element_bytes
        if total + entry > budget:
            break
        total += entry
        kept.append(entry)
    return kept


def _reference_bytes(plan, budget: int) -> int:
    return sum(_reference_entries(plan, budget))


def _reference_batches(plan, budget: int) -> int:
    return len(_reference_entries(plan, budget))


def _resident_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


# --------------------------------------------------------------------------- the verb
def estimate_cost(model_or_path, config: LayerSwapConfig | dict, *, calibration=None, device=None,
                  dtype=None, throughput: Throughput | None = None, stream_weights: bool | None = None,
                  max_memory: int | str | None = None, tokenizer=None) -> CostEstimate:
    """Predict what ``prune(model, config)`` will cost, without reading a weight.

    Args:
        model_or_path: a bundled name, a checkpoint folder or Hub id (its ``config.json``
            is read and the model built on the meta device), a ``PretrainedConfig``, or a
            loaded model (used as is; nothing runs on it).
        config: the :class:`~hf_layerswap.LayerSwapConfig` (or its dict) of the prune; it
            needs ``num_to_remove`` (or ``layers``) as ``prune`` does.
        calibration: the prompts (a :class:`~hf_layerswap.calibration.CalibrationSet` or a
            dict of ``input_ids``/``attention_mask``, shape ``(N, T)``, read as ``prune``
            reads it: checked, its first ``num_prompts`` rows); default ``config.calibration``
            read as ``prune`` reads it (a text source tokenized with ``tokenizer``); without a
            tokenizer, ``num_prompts`` full prompts of ``seq_len`` tokens (the scoring then
            an upper bound, ``exact=False``).
        device: where the prune will compute (default: the CPU); sets the working-memory
            budget, the throughput probe's device and the key of ``peak_memory_bytes``.
        dtype: the parameter dtype, a name of :data:`~hf_layerswap.models.DTYPES` or its torch
            dtype (default and ``"auto"``: the checkpoint's ``torch_dtype``, else fp32).
        throughput: rates to predict with (default: :func:`measure_throughput` on ``device``).
        stream_weights: the blocks live in CPU memory and are streamed to ``device``, each
            block once per batch and sweep (default: detected from the model's
            ``hf_device_map``).
        max_memory: the scoring working-memory budget as ``prune`` takes it: bytes or a
            size such as ``"2GiB"`` (:func:`~hf_layerswap.scoring.settings.parse_memory`);
            ``None``/``"auto"`` (default): what scoring derives for ``device``
            (:func:`~hf_layerswap.scoring.settings.device_memory_budget`), for a model not
            loaded yet from its free memory less the weights the load will put there. Every
            step is planned under it (``memory_parts``).
        tokenizer: reads the calibration text and the texts of healing's measurements
            (``perplexity_text``, ``eval_tasks``), whose passes are counted from their
            tokens; a tokenizer, a folder or Hub id; default ``config.tokenizer``, else the
            checkpoint's own (loaded only when a text is read).

    Returns:
        a :class:`CostEstimate`; its ``derivation`` says how each number was obtained.

    Raises:
        ValueError: a strategy whose registry entry has no cost estimate
            (:class:`~hf_layerswap.selection.registry.Strategy` ``cost``; every built-in one
            has), a config without a budget, a budget or ``layers`` the model cannot take (as
            ``prune`` refuses them), a configuration the model's architecture cannot run (as
            ``prune`` refuses it before scoring), a healing method other than ``lora``,
            ``adjacent`` and ``last_k``, a healing text with no training prompt, healing
            measurements without a tokenizer to read their texts, a path that is no
            checkpoint or a Hub id whose ``config.json`` cannot be read (the message names
            it), a ``dtype`` outside :data:`~hf_layerswap.models.DTYPES`, a CUDA ``device``
            this machine lacks without ``max_memory`` and ``throughput`` (what would be read
            of it), a ``max_memory`` that is no size; a :class:`Throughput` whose rates are
            not finite numbers > 0 is refused when it is built.
        TypeError: a ``model_or_path``, ``config`` or ``calibration`` of the wrong type.
    """
    cfg = _config(config)
    if dtype is not None:
        resolve_dtype(dtype)  # a name or dtype load_model takes, before anything is read
    device = torch.device(device or "cpu")
    _check_device(device, max_memory, throughput)
    model = meta_model(model_or_path, dtype)
    check_removal(cfg, num_blocks(model))
    for step in recipe_steps(cfg):  # as prune refuses them before scoring
        step.check(model)
    calib, calib_known = _calibration(model, cfg, calibration, tokenizer)
    memory = _budget(max_memory, device, model, stream_weights)  # the one budget prune resolves for every step
    budget = memory.bytes
    settings = EngineSettings(batch_size=cfg.batch_size, max_memory=budget, progress=False)
    kept, working = memory.split()  # the selection: its kept reference and its engine calls share the budget
    streamed = None if stream_weights is None else bool(stream_weights)  # None: the model's own offload
    plan = StepPlan(model, calib, cfg, calibration, measure_tokenizer(model, cfg, tokenizer), streamed=streamed,
                    device=device, settings=settings, kept=kept.bytes, working=working.bytes, calib_known=calib_known,
                    rates=lambda batch, width: throughput or measure_throughput(model, batch, width, device=device),
                    budget=budget)
    phases: dict = {}
    for step in recipe_steps(cfg):  # each step's cost, in the order the prune runs them
        phase = step.estimate(plan)
        if phase is not None:
            phases[_phase_name(phases, step.phase)] = phase
    exact = all(p.get("exact", True) for k, p in phases.items() if k in ENGINE_PHASES)
    estimate = _assemble(model, calib, cfg, phases, plan.scoring_plan, exact, device, kept.bytes, throughput,
                         stream_weights)
    estimate.memory_parts["budget"] = int(budget)
    return estimate


def _budget(max_memory, device: torch.device, model, stream_weights) -> MemoryBudget:
    """The one working-memory budget of the prune, as :func:`~hf_layerswap.prune` will
    resolve it: given bytes or a size as they are; ``"auto"`` for a model not loaded yet (on
    the meta device) from the free memory of ``device`` less the weights the load will put
    there (what remains after them, as the run reads it), else from ``device`` as it is."""
    if max_memory not in (None, "auto"):
        return resolve_memory(max_memory, device)
    on_meta = any(p.is_meta for p in model.parameters())
    pending = ModelShape(model).weight_bytes if on_meta and not stream_weights else 0
    return MemoryBudget(*device_memory_budget(device, pending=pending))


def _on_device(plan, device: torch.device):
    """``plan`` (an :class:`~hf_layerswap.scoring.engineplan.EnginePlan` made on the meta
    device) with the KL's row blocks the engine takes on ``device``
    (:func:`~hf_layerswap.scoring.settings.kl_block_bytes` of the plan's slice budget: large on
    an accelerator)."""
    return dataclasses.replace(plan, kl_block_bytes=kl_block_bytes(device, plan.slice_bytes))


def _on_this_machine(device: torch.device) -> bool:
    """Whether ``device`` can be read here (the CPU, or a CUDA device this machine has)."""
    here = torch.cuda.device_count() if device.type == "cuda" else 0
    return device.type != "cuda" or bool(here and (device.index is None or device.index < here))


def _check_device(device: torch.device, max_memory, throughput) -> None:
    """Refuse a CUDA device this machine lacks when the estimate would read it (its free
    memory for the budget, its speed for the rates)."""
    here = torch.cuda.device_count() if device.type == "cuda" else 0
    if _on_this_machine(device):
        return
    missing = [name for name, unset in (("max_memory", max_memory in (None, "auto")), ("throughput", throughput is None))
               if unset]
    if missing:
        raise ValueError(f"device={str(device)!r} is not on this machine ({here} CUDA device(s)): to predict for "
                         f"another machine pass {' and '.join(m + '=' for m in missing)} (its scoring memory "
                         "budget, its rates)")


class StepPlan:
    """What each step's :meth:`~hf_layerswap.steps.Step.estimate` reads: the meta-device
    ``model`` and its :class:`~hf_layerswap.cost.steps.ModelShape`, the prompts ``calib``,
    the config, the raw ``calibration`` (healing reads given tensors), the ``tokenizer`` of
    healing's measurement texts, the device's ``rates(batch, width)``, the one working-memory
    ``budget`` (bytes) and whether the ``device`` is an ``accelerator``; :meth:`scoring` and
    :meth:`selection` plan the engine's two phases (the scoring's plan kept in
    ``scoring_plan`` for the peak memory); ``recovery_phase``, ``healing_phase`` and
    ``sparsity_phase`` are the per-step planners of :mod:`~hf_layerswap.cost.steps` that the
    later steps call (the steps module stays below the cost package: it imports none of it)."""

    recovery_phase = staticmethod(recovery_phase)
    healing_phase = staticmethod(healing_phase)
    sparsity_phase = staticmethod(sparsity_phase)

    def __init__(self, model, calib: CalibrationSet, cfg: LayerSwapConfig, calibration, tokenizer, *, streamed,
                 device, settings: EngineSettings, kept: int, working: int, calib_known: bool, rates, budget: int):
        self.model, self.calib, self.cfg, self.calibration, self.tokenizer = model, calib, cfg, calibration, tokenizer
        self.budget, self.accelerator = budget, device.type != "cpu"
        self.shape = ModelShape(model)
        self.streamed, self.device, self.settings, self.kept, self.working = streamed, device, settings, kept, working
        self.calib_known, self.rates = calib_known, rates
        self.scoring_plan = None
        self.entry = cfg.selection_entry()  # as prune resolves it

    def scoring(self, protocols) -> dict:
        """The swap-KL scoring's phase: the engine's own plan of every pair's probes under
        ``protocols`` (none: a phase of no pass, whose note says why)."""
        total = self.shape.num_blocks
        if not protocols:
            return {"block_passes": 0, "head_passes": 0, "head_rows": 0, "block_tokens": 0, "block_loads": 0,
                    "sweeps": 0, "exact": True,
                    "note": f"no swap-KL scoring: strategy {self.entry.name!r} reads no swap-KL score "
                            "(score_protocols names protocols to score anyway)"}
        plans = swap_plans(total, min(self.cfg.max_gap, total - 1), protocols)
        phase = _engine_counts(self.model, self.calib, plans, self.settings, streamed=self.streamed)
        self.scoring_plan = _on_device(phase.pop("plan"), self.device)
        phase["sweeps"] = 1
        phase["exact"] = self.calib_known
        return phase

    def selection(self) -> dict | None:
        """The selection's phase, planned by the strategy's registry entry (``None``: the
        paper's rule reads the scores, no phase of its own)."""
        cfg, total = self.cfg, self.shape.num_blocks
        plan = SelectionPlan(self.model, self.calib, cfg, EngineSettings(batch_size=cfg.batch_size,
                                                                         max_memory=self.working, progress=False),
                             self.kept, self.streamed, self.device)
        selection = dict(self.entry.cost(plan))
        selection.pop("plan", None)
        selection["memory_plan"] = _on_device(plan.engine({0: removal_plan(total, [plan.allowed[0]])})["plan"],
                                              self.device)
        if selection["block_passes"] or selection["head_passes"] or not selection["exact"]:
            return selection
        return None


def _phase_name(phases: dict, name: str) -> str:
    """``name``, or for a step kind that ran before ``name 2``, ``name 3``, ..."""
    if name not in phases:
        return name
    return f"{name} {sum(k == name or k.startswith(name + ' ') for k in phases) + 1}"


def _config(config) -> LayerSwapConfig:
    if config is None:
        raise ValueError("config=None: give the LayerSwapConfig of the prune (with num_to_remove or layers)")
    if isinstance(config, Mapping):
        config = LayerSwapConfig(**config)
    if not isinstance(config, LayerSwapConfig):
        raise TypeError(f"config must be a LayerSwapConfig or a dict of its fields; got {type(config).__name__}")
    if config.layers is None and config.num_to_remove is None:
        raise ValueError("the config removes nothing (num_to_remove=None, layers=None): give num_to_remove or layers")
    if config.layers is None:
        strategy = strategy_entry(config.strategy).strategy_for(config.protocol)
        if strategy_entry(strategy).cost is None:
            estimated = sorted(name for name in STRATEGIES if strategy_entry(name).cost is not None)
            raise ValueError(f"strategy={strategy!r} has no cost estimate: estimate_cost plans the strategies whose "
                             f"registry entry has one ({estimated}); register it with cost=")
    return config


ENGINE_PHASES = ("scoring", "selection")


def _assemble(model, calib, cfg, phases, plan, exact, device, budget, throughput, stream_weights) -> CostEstimate:
    shape = ModelShape(model)
    total_blocks, block_params, hidden, block_bytes = shape.num_blocks, shape.block_params, shape.hidden, shape.block_bytes
    seq = calib.input_ids.shape[1]
    engine_phases = {k: p for k, p in phases.items() if k in ENGINE_PHASES}
    for p in engine_phases.values():
        p["block_flops"] = block_flops(block_params, p["block_tokens"], seq, hidden)
        p["head_flops"] = 2.0 * p["head_rows"] * hidden * shape.vocab
        p.setdefault("exact", p is not phases.get("selection") or exact)
    for p in phases.values():
        p["flops"] = p["block_flops"] + p["head_flops"]
    streamed = (_offloaded(model) or blocks_offloaded(model)) if stream_weights is None else bool(stream_weights)
    n_batches = math.ceil(calib.num_prompts / cfg.batch_size)
    for name, p in phases.items():  # the engine's phases: the block loads of its plan (where a strategy's
        # cost counts them; else each block once per batch and sweep); the other steps run the model's own
        # forward, whose offload hooks move a block at each call
        sweeps = p.get("sweeps", p.get("calls", 1))
        if name in ENGINE_PHASES:
            loads = p.get("block_loads")
            p["block_loads"] = (total_blocks * n_batches * sweeps if loads is None else int(loads)) if streamed else 0
        p["bytes_moved"] = 0 if not streamed else block_bytes * (p["block_loads"] if name in ENGINE_PHASES
                                                                 else p["block_passes"])
    weights = shape.weight_bytes
    search_ref = 0
    selection_plan = phases.get("selection", {}).pop("memory_plan", None)
    keeps = strategy_entry(strategy_entry(cfg.strategy).strategy_for(cfg.protocol)).keeps_reference  # as prune runs it
    if "selection" in phases and keeps and (plan or selection_plan) is not None:  # the batches' shapes: either plan
        search_ref = _reference_bytes(plan or selection_plan, budget)  # ``budget``: the share the search keeps
    scoring_working = _working_bytes(plan, 0) if plan is not None else 0
    selection_working = _working_bytes(selection_plan, 0) if selection_plan is not None else 0
    if "working_bytes" in phases.get("selection", {}):  # a strategy that plans its own (the NLL's row slices)
        selection_working = int(phases["selection"]["working_bytes"])
    # the selection's engine calls beside its kept reference, each within its share of the one budget
    working = max(scoring_working, selection_working + search_ref if selection_plan is not None else 0)
    kl_temps = 0
    if plan is not None and plan.stream_logits:
        real = plan.batches[0].real_positions
        kl_temps = _kl_temporaries(plan, real, min(plan.flush_size(real), plan.probes))
    key = str(device)
    if streamed:
        # the blocks the map leaves on the device, and of the moved ones a window of 2g + 1 resident blocks;
        # on CUDA one more, the next block read ahead (BlockPrefetcher)
        moved = _streamed_blocks(model, stream_weights)
        window = min(moved, 2 * cfg.max_gap + 1 + (device.type == "cuda")) * block_bytes
        peak = {key: weights - moved * block_bytes + window + working, "cpu": weights}
    else:
        peak = {key: weights + working}
    steps_peak = max((p["memory_bytes"] for k, p in phases.items() if k not in ENGINE_PHASES), default=0)
    peak[key] = max(peak[key], steps_peak)
    resident = _resident_bytes() if device.type == "cpu" else 0
    if device.type == "cpu":
        peak["cpu"] = peak.get("cpu", 0) + resident + (working if streamed else 0)
    host = max((p.get("host_bytes", 0) for p in phases.values()), default=0)  # a repair's moments kept on the host
    if host and device.type != "cpu":
        peak["cpu"] = max(peak.get("cpu", 0), host)
    if throughput is None:
        throughput = measure_throughput(model, cfg.batch_size, seq, device=device)
    for p in phases.values():
        p["seconds"] = throughput.seconds(p)
    exact = all(p["exact"] for p in phases.values())
    return CostEstimate(
        block_passes=int(sum(p["block_passes"] for p in phases.values())),
        head_passes=int(sum(p["head_passes"] for p in phases.values())),
        flops=float(sum(p["flops"] for p in phases.values())),
        bytes_moved=int(sum(p["bytes_moved"] for p in phases.values())),
        peak_memory_bytes={k: int(v) for k, v in peak.items()},
        seconds=float(sum(p["seconds"] for p in phases.values())), exact=exact,
        phases={k: {kk: vv for kk, vv in v.items() if kk not in ("plan", "exact_sets")} for k, v in phases.items()},
        derivation=_derivation(phases, exact, streamed, device, throughput), throughput=throughput,
        memory_parts={"weights": int(weights), "working": int(working), "reference_kept": int(search_ref),
                      "scoring": int(scoring_working), "selection": int(selection_working),
                      "kl_temporaries": int(kl_temps),
                      "steps_working": {k: int(p["working_bytes"]) for k, p in phases.items()
                                        if "working_bytes" in p and k not in ENGINE_PHASES},
                      "steps_host": int(host),
                      "process": int(resident), "steps": int(steps_peak)},
    )


def _derivation(phases: dict, exact: bool, streamed: bool, device, throughput: Throughput) -> dict:
    """Per field of :class:`CostEstimate`, how it was derived (sentences)."""
    out = {
        "block_passes": "the scoring engine's own plan (batches, prefix-reuse schedule) on the meta-device model"
                        + ("" if exact else "; an upper bound where a phase says exact=False (a selection that "
                                            "depends on the scores, as its note says; a repair of blocks not yet "
                                            "chosen, a healing run the early stop may end sooner)"),
        "head_passes": "head/KL phase per batch: (probe groups + probes) x position chunks (x vocabulary slices), "
                       "plus the one-time head check; one per model forward in the later steps",
        "flops": "2 x block parameters (+ 4 T H attention) per position per block pass; 2 H V per head row; "
                 "a training backward as 2 forwards",
        "bytes_moved": ("the engine: each block once per batch and sweep, streamed from CPU memory; later steps: "
                        "each block call" if streamed else "0: the weights stay on the device"),
        "peak_memory_bytes": "the largest of: weights + the engine's working memory (activations, head/KL block, "
                             "fp32 head copy, held probe states, the search's kept reference), and each later "
                             "step's peak (memory_parts['steps'])"
                             + ("; CPU: plus this process's resident memory now" if device.type == "cpu" else ""),
        "seconds": f"flops / throughput ({throughput.source}) + bytes moved / host bandwidth, summed over the phases",
    }
    for name, p in phases.items():
        if "note" in p:
            out[name] = p["note"]
    return out
