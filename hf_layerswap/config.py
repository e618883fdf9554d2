"""``LayerSwapConfig``: what to remove, how to choose it, and what to do after the cut.

One module on purpose: the config and its nested sub-configs (repair, sparsity, healing)
share one validation and one serialisation, read best side by side.

The one typed description of a pruning run: :func:`hf_layerswap.pipeline.prune` reads it,
``from_pretrained(..., quantization_config=LayerSwapConfig(...))`` carries it through
transformers' quantizer plugin API (:mod:`hf_layerswap.integration`), ``hf-layerswap
prune`` and the demo build it from their flags (their help texts are the fields' ``help``
metadata), and its :meth:`~LayerSwapConfig.to_dict` is recorded in
``config.layerswap["steps"][k]["config"]``.

It is a dataclass (on transformers' ``QuantizationConfigMixin``): every field carries its
help (``field(metadata={"help": ...})``); the repair and the sparsification are nested
dataclass fields (:class:`RecoveryConfig`, :class:`SparsityConfig`); every field is
checked in ``__post_init__`` (:meth:`LayerSwapConfig.validate`), and :meth:`to_dict` /
:meth:`from_dict` are the one serialisation (a JSON round trip is exact). The
choices with a registry (``protocol``, ``strategy``, ``objective``, the ``recovery`` method,
the sparsity ``allocation`` and ``pruner``) are open strings, checked against the registry
when the config is validated, so a name added with ``register_protocol``,
``register_strategy``, ``register_recovery_method`` (a search objective too, with
``search_objective = True``), ``register_allocator`` or ``register_pruner`` is accepted.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, asdict, dataclass, field, fields, replace
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from .healing import HEAL_METHODS, get_heal_method
from .healing.distill import MAX_SEED, processes_launched
from .healing.measure import check_eval_tasks
from .layerplan import as_index, decoder_blocks
from .utils.provenance import public_name
from .utils.registry import Options
from .recovery import RECOVERY_METHODS, check_epsilon, cut_boundaries, get_recovery_method, recovery_entry
from .scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS
from .scoring.rule import resolve_protect
from .selection import STRATEGIES
from .selection.dispatch import selection_protocols
from .selection.objectives import OBJECTIVES
from .selection.registry import STRATEGY_ENTRIES, Strategy, strategies_taking, strategy_entry
from .sparsity import ALLOCATORS, PRUNERS, check_arguments, check_bound

__all__ = [
    "CONFIG_VERSION",
    "FLAT_KEYWORDS",
    "HealConfig",
    "LayerSwapConfig",
    "QUANT_METHOD",
    "RENAMED_KEYS",
    "RECIPE_STEPS",
    "RecoveryConfig",
    "SparsityConfig",
    "check_against_model",
    "config_keys",
    "protect_clash",
    "recipe_entry",
    "recipe_kind",
]

QUANT_METHOD = "layerswap"
#: Format version of :meth:`LayerSwapConfig.to_dict` (``config.json`` of a pruned checkpoint).
CONFIG_VERSION = 1

#: The choices with a registry are open strings: :meth:`LayerSwapConfig.validate` checks them
#: against the registry as it is then (a refused name's message lists the registered ones), and
#: the command line's choices are the registry's names (``metadata["choices"]``), so a name
#: registered later is a valid value and no list of names is kept here. ``protocol``: a swap
#: protocol (:data:`~hf_layerswap.scoring.protocols.SWAP_PROTOCOLS`) or ``"auto"``;
#: ``objective``: :data:`~hf_layerswap.selection.objectives.OBJECTIVES`; the repair's
#: ``method``: :data:`~hf_layerswap.recovery.RECOVERY_METHODS` (those that fit);
#: ``allocation``, ``pruner``: :data:`~hf_layerswap.sparsity.ALLOCATORS`,
#: :data:`~hf_layerswap.sparsity.PRUNERS`.
ProtocolName = str
ObjectiveName = str
RecoveryMethodName = str
AllocationName = str
PrunerName = str

#: Flat constructor keywords -> (the nested field, its sub-config field): the one place
#: they are mapped (the constructor, :meth:`LayerSwapConfig.update` and the command line's
#: help, ``hf_layerswap.cli.options.config_help``).
FLAT_KEYWORDS = {
    "recovery_num_tokens": ("recovery", "num_tokens"),
    "recovery_epsilon": ("recovery", "epsilon"),
    "allocation": ("sparsity", "allocation"),
    "pruner": ("sparsity", "pruner"),
    "sparsity_pattern": ("sparsity", "pattern"),
}


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


def _cli(text: str, **extra) -> dict:
    """Metadata of a field that is also a command-line setting (``cli=True``): its
    ``help``, and optionally ``minimum`` (an int option's least value), ``choices`` (a
    callable returning the allowed names now, for the choices with a registry) and
    ``entries`` (a callable returning ``{name: one line}`` of the registry's entries, which
    the help lists after its text); read by ``hf_layerswap.cli.options.add_config_options``."""
    return {"help": text, "cli": True, **extra}


def _recovery_choices() -> list:
    """The allowed ``recovery`` values now: ``None`` (plain removal) and every method
    registered with :func:`~hf_layerswap.recovery.register_recovery_method` that repairs
    (its entry's ``fits``; plain removal, ``"none"``, is spelled ``recovery=None``)."""
    return [None] + _repairs()


def _repairs() -> list[str]:
    """The registered recovery methods that repair the cut (their entry's ``fits``)."""
    return [name for name, method in RECOVERY_METHODS.items() if method.fits]


def _check_int(name: str, value, minimum: int, allow_none: bool = False):
    """``value`` as a Python int (any integral number: ``int``, a NumPy integer; not a bool)."""
    if value is None and allow_none:
        return None
    if as_index(value) is None or value < minimum:
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be an int >= {minimum}")
    return int(value)


def _check_choice(name: str, value, allowed, allow_none: bool = False):
    """Refuse ``value`` outside ``allowed`` (a registry's names now), naming them and the closest."""
    allowed = list(allowed)
    if value is None and allow_none:
        return
    if value not in allowed:
        names = [a for a in allowed if isinstance(a, str)]
        close = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
        raise ValueError(f"LayerSwapConfig({name}={value!r}): allowed {allowed + ([None] if allow_none else [])}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))


def _int_list(name: str, value) -> list[int]:
    if isinstance(value, (int, str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be a list of 0-based block indices (ints)")
    out = list(value)
    bad = [v for v in out if as_index(v) is None]
    if bad:
        raise ValueError(f"LayerSwapConfig({name}={out!r}): entries {bad!r} are not ints; indices are 0-based ints")
    return [as_index(v) for v in out]


#: Keys renamed before the first release (see CHANGELOG.md): named in the error, never accepted.
RENAMED_KEYS = {"num_layers": "num_to_remove", "method": "pruner", "sparsity_method": "pruner"}


def _unknown_keys(what: str, given, allowed: Sequence[str]) -> str | None:
    """The message for keys of ``given`` not in ``allowed`` (each with its new name when
    it is in :data:`RENAMED_KEYS`, else its closest allowed key by
    :func:`difflib.get_close_matches`), or ``None`` when there are none."""
    unknown = sorted((str(k) for k in given if k not in allowed), key=str)
    if not unknown:
        return None
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(allowed), n=1)
        if RENAMED_KEYS.get(key) in allowed:
            hints.append(f"{key!r} is now {RENAMED_KEYS[key]!r}")
        elif close:
            hints.append(f"{key!r}: did you mean {close[0]!r}?")
    return (f"{what}: unknown keys {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
            + f"; allowed {list(allowed)}")


def _sub_config(kind, value, what: str) -> dict:
    """The fields of a sub-config given as its dataclass or a dict; unknown keys raise."""
    if isinstance(value, kind):
        return asdict(value)
    problem = _unknown_keys(f"LayerSwapConfig({what}={dict(value)!r})", value, [f.name for f in fields(kind)])
    if problem:
        raise ValueError(problem)
    return dict(value)


@dataclass(frozen=True)
class RecoveryConfig:
    """Repair of the cut (:func:`hf_layerswap.recovery.recover`); checked by the
    :class:`LayerSwapConfig` that holds it.

    Attributes:
        method: ``"ghosted"`` (Ghosted Layers, arXiv 2605.15491, operators attached),
            ``"fused"`` (folded into ``down_proj``), ``"linearpatch"`` (LinearPatch, arXiv
            2505.24680: folded into the embedding at a cut of block 0, operators elsewhere) or a name registered with
            :func:`~hf_layerswap.recovery.register_recovery_method`.
        num_tokens: at most this many real calibration tokens for the fit; ``None`` = every
            real token of the calibration set, at most 65,536 (:func:`~hf_layerswap.recovery.recover`).
        epsilon: relative ridge toward the identity, in [0, 2**52]
            (:data:`~hf_layerswap.recovery.MAX_EPSILON`); ``None`` = the method's default.
    """

    method: RecoveryMethodName = field(default="ghosted", metadata=_cli(
        "repair the cut",
        choices=_repairs, entries=lambda: {n: RECOVERY_METHODS[n].help for n in _repairs()}))
    num_tokens: int | None = field(default=None, metadata=_help(
        "most real calibration tokens the repair is fitted on (default: all of them, at most 65,536)"))
    epsilon: float | None = field(default=None, metadata=_help(
        "relative ridge of the repair toward the identity, a float in [0, 2**52] (default: the method's own; "
        "linearpatch has none)"))


@dataclass(frozen=True)
class SparsityConfig:
    """One-shot sparsification after removal (:func:`hf_layerswap.sparsity.sparsify`);
    checked by the :class:`LayerSwapConfig` that holds it.

    Attributes:
        sparsity: overall target in [0, 1) (fraction of prunable block weights set to zero).
        allocation: per-block rule (``"pals"`` default, ``"uniform"``, ``"owl"``, ...).
        pruner: the pruner (``"wanda"`` default, ``"sparsegpt"``, ``"magnitude"``).
        pattern: ``None`` (unstructured) or ``"N:M"`` such as ``"2:4"``.
    """

    sparsity: float = field(metadata=_cli("one-shot sparsity target in [0, 1) after removal (default: none)"))
    allocation: AllocationName = field(default="pals", metadata=_cli("per-block sparsity rule",
                                                                     choices=lambda: list(ALLOCATORS)))
    pruner: PrunerName = field(default="wanda", metadata=_cli("the pruner that sets the weights to zero",
                                                              choices=lambda: list(PRUNERS)))
    pattern: str | None = field(default=None, metadata=_cli(
        "N:M sparsity pattern, e.g. 2:4 (default unstructured)"))


#: ``HealConfig.method``: a registered healing method (built-ins ``"lora"``, ``"adjacent"``,
#: ``"last_k"``; :data:`~hf_layerswap.healing.HEAL_METHODS`).
HealMethodName = str


@dataclass(frozen=True)
class HealConfig:
    """Healing after the cut and its repair (:func:`hf_layerswap.healing.heal`): the pruned
    model is distilled from its dense self. Every field is checked at construction.

    Attributes:
        method: ``"lora"``, ``"adjacent"``, ``"last_k"`` or a name registered with
            :func:`~hf_layerswap.healing.register_heal_method`.
        max_tokens: training budget in prompt positions (int >= 1); ``None`` (default): the
            whole steps that fit 10 minutes on the device at the cost model's rates, at most one
            pass over the text (:mod:`~hf_layerswap.healing.choice`).
        calibration: the training text (a text file); ``None`` = the removal's calibration
            source (:class:`LayerSwapConfig`'s ``calibration``).
        seq_len, batch_size: tokens per prompt (>= 2) and prompts per step (>= 1).
        packing: ``True`` (default): the text packed into full windows of ``seq_len``
            tokens; ``False``: one paragraph per prompt (:func:`~hf_layerswap.healing.heal`).
        learning_rate: peak learning rate (finite, > 0); ``None`` (default): chosen by a short
            probe of the method's candidate rates on the held-out KL.
        ce_weight: weight of the cross-entropy on the text (finite, >= 0).
        heldout_prompts, eval_every, patience: the early stop on held-out KL (ints >= 1;
            ``patience=None``: a tenth of the planned evaluations, at least 2).
        seed: training seed (int).
        teacher_top_k: ``None`` = the teacher's full logits; an int ``k`` >= 1 = a cache of
            its top-k log-probs plus the rest's mass (KL over ``k + 1`` buckets, a lower
            bound of the full KL).
        options: the method's options (``{"lora_r": 8}``, ``{"k": 3}``), JSON-able values, or
            its typed options (``LoraOptions(lora_r=8)``, the method's ``option_class``),
            kept as their dict; checked by that class (unknown keys, types, bounds).
        perplexity_text: ``None`` (no perplexity), ``"embedded"`` (the embedded evaluation
            text) or a text file: the perplexity of the dense model, after the cut, after
            the repair (when one ran) and after healing, one contract and one text for all,
            recorded in ``config.layerswap["healing"]`` for the card.
        eval_tasks: lm-eval task names measured before and after healing
            (:func:`~hf_layerswap.evaluate_tasks`, zero-shot; needs the ``lm-eval`` extra);
            ``None`` = none.
        eval_tasks_path: a folder of lm-eval task YAML files (``include_path``; lm-eval's
            built-in index is not scanned then); ``None`` = lm-eval's own tasks.
        eval_tasks_limit: documents per task (int >= 1) or a fraction in (0, 1); ``None`` = all.

    Raises:
        ValueError: a bad field, naming it, its value and what is allowed.
    """

    method: HealMethodName = field(default="lora", metadata=_help(
        "healing method: lora (LoRA on the kept blocks' projections, merged back), adjacent (the blocks next "
        "to each cut, plus norms) or last_k (the last k blocks and the head)"))
    max_tokens: int | None = field(default=None, metadata=_help(
        "healing budget in training tokens (prompt positions) (default: the whole steps that fit 10 minutes on the "
        "device at the measured rates, at most one pass over the text)"))
    calibration: str | None = field(default=None, metadata=_help(
        "healing text: a text file (default: the removal's calibration source; for the heal verb the embedded text)"))
    seq_len: int = field(default=128, metadata=_help("tokens per healing prompt"))
    packing: bool = field(default=True, metadata=_help(
        "pack the healing text into full windows of seq_len tokens (paragraphs joined by EOS, no padding; epochs "
        "only when the text runs out); off: one paragraph per prompt, truncated and padded, at most 256 prompts"))
    batch_size: int = field(default=4, metadata=_help("healing prompts per optimiser step"))
    learning_rate: float | None = field(default=None, metadata=_help(
        "peak learning rate of healing (default: a short probe of the method's candidate rates on the held-out KL)"))
    ce_weight: float = field(default=0.0, metadata=_help(
        "weight of the cross-entropy on the text added to the KL (0 = pure distillation)"))
    heldout_prompts: int = field(default=4, metadata=_help(
        "calibration prompts held out for the early stop's KL (never trained on)"))
    eval_every: int = field(default=4, metadata=_help("optimiser steps between held-out evaluations"))
    patience: int | None = field(default=None, metadata=_help(
        "stop after this many evaluations without a lower held-out KL (the best weights are kept; "
        "default: a tenth of the planned evaluations, at least 2)"))
    seed: int = field(default=0, metadata=_help("healing seed (data order, LoRA initialisation)"))
    teacher_top_k: int | None = field(default=None, metadata=_help(
        "cache the teacher's top-k log-probs plus the rest's mass instead of its full logits (default: full)"))
    options: dict = field(default_factory=dict, metadata=_help(
        "method options, e.g. lora_r=8, lora_alpha=16 (lora) or k=3 (last_k)"))
    perplexity_text: str | None = field(default=None, metadata=_help(
        "measure perplexity of the dense model, after the cut, after the repair and after healing on TEXT "
        "(a text file; without a value the embedded evaluation text) and record it for the card"))
    eval_tasks: list[str] | None = field(default=None, metadata=_help(
        "lm-eval tasks measured before and after healing (needs the lm-eval extra)"))
    eval_tasks_path: str | None = field(default=None, metadata=_help(
        "folder of lm-eval task YAML files for the healing's task evaluation (default: lm-eval's own tasks)"))
    eval_tasks_limit: int | float | None = field(default=None, metadata=_help(
        "documents per task of the healing's task evaluation: an int >= 1 or a fraction in (0, 1) (default: all)"))

    def __post_init__(self):
        what = "HealConfig"
        if self.method not in HEAL_METHODS:
            raise ValueError(f"{what}(method={self.method!r}): allowed {sorted(HEAL_METHODS)}")
        for name, minimum in (("max_tokens", 1), ("seq_len", 2), ("batch_size", 1), ("heldout_prompts", 1),
                              ("eval_every", 1), ("patience", 1)):
            value = getattr(self, name)
            if name in ("patience", "max_tokens") and value is None:
                continue
            if as_index(value) is None or value < minimum:
                raise ValueError(f"{what}({name}={value!r}): must be an int >= {minimum}"
                                 + (" or None (chosen for the model and the device)" if name == "max_tokens" else ""))
            object.__setattr__(self, name, int(value))  # frozen: its own normalisation, in __post_init__
        world = processes_launched()  # checked here, before a model loads: each process takes its share of a step
        if self.batch_size % world:
            raise ValueError(f"{what}(batch_size={self.batch_size!r}) under {world} launched processes: each process "
                             f"takes batch_size / {world} prompts of every step; give a multiple of {world}")
        for name, low in (("learning_rate", None), ("ce_weight", 0.0)):
            value = getattr(self, name)
            if name == "learning_rate" and value is None:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or (value <= 0 if low is None else value < low):
                raise ValueError(f"{what}({name}={value!r}): must be a finite number {'> 0' if low is None else '>= 0'}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"{what}(seed={self.seed!r}): must be an int in 0..{MAX_SEED}")
        if not isinstance(self.packing, bool):
            raise ValueError(f"{what}(packing={self.packing!r}): must be True or False")
        k = self.teacher_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"{what}(teacher_top_k={k!r}): must be None (full logits) or an int >= 1")
        if self.calibration is not None and not isinstance(self.calibration, (str, os.PathLike)):
            raise ValueError(f"{what}(calibration={self.calibration!r}): must be a text file path or None")
        if isinstance(self.options, Options):  # the method's typed options: recorded as their dict
            object.__setattr__(self, "options", self.options.to_dict())
        if not isinstance(self.options, Mapping) or not all(isinstance(key, str) for key in self.options):
            raise ValueError(f"{what}(options={self.options!r}): must be a dict with str keys")
        try:
            json.dumps(dict(self.options), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{what}(options={self.options!r}): values must be JSON-able ({err})") from None
        try:
            get_heal_method(self.method).check_options(self.options)
        except ValueError as err:
            raise ValueError(f"{what}(options={self.options!r}): {err}") from None
        object.__setattr__(self, "options", dict(self.options))
        for name in ("calibration", "perplexity_text", "eval_tasks_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
                raise ValueError(f"{what}({name}={value!r}): must be a non-empty path or None")
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
        self._check_tasks(what)

    def _check_tasks(self, what: str) -> None:
        tasks, limit = check_eval_tasks(self.eval_tasks, self.eval_tasks_path, self.eval_tasks_limit, what)
        object.__setattr__(self, "eval_tasks", tasks)
        object.__setattr__(self, "eval_tasks_limit", limit)

    def heal_kwargs(self) -> dict:
        """Keywords of :func:`~hf_layerswap.healing.heal` (all fields but ``calibration``,
        the options spread out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("calibration", "options")}
        return {**out, **self.options}

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict (a calibration file by its name only)."""
        out = asdict(self)
        for name in ("calibration", "perplexity_text", "eval_tasks_path"):  # files by their name only
            value = getattr(self, name)
            out[name] = value if value in (None, "embedded") else public_name(value)
        return out


#: Metadata of the fields that exist at run time only and never enter :meth:`LayerSwapConfig.to_dict`.
_RUNTIME = {"runtime": True}


@dataclass(eq=False, repr=False)
class LayerSwapConfig(QuantizationConfigMixin):
    """Configuration for removing decoder blocks at load time.

    Args:
        num_to_remove: remove this many blocks, chosen by ``strategy`` (swap-KL by default). ``None`` with
            ``layers=None`` scores only (the report is attached; nothing is removed, a
            requested ``sparsity`` is still applied).
        layers: explicit 0-based block indices to remove (no scoring). They index the
            blocks of the checkpoint being loaded: on a checkpoint that is already pruned
            (``config.layerswap`` records an earlier removal) ``layers=[2]`` removes its
            *current* block 2, which may be another block of the original model (after
            removing original blocks 1 and 4 of 8, current block 2 is original block 3).
            ``config.layerswap`` and the card record every step in both numberings.
        protocol: ``"interchange"`` (default), ``"replacement"`` or ``"auto"`` (both
            candidate sets evaluated by joint removal KL; the lower is kept).
        max_gap, spacing, protect: scoring and selection rules, see
            :func:`~hf_layerswap.score_layers` and :func:`~hf_layerswap.select_layers`.
            ``spacing`` defaults to 1 for ``"greedy"``/``"auto"`` and 0 otherwise.
            ``protect`` defaults to ``(0, -1)`` (first and last block) for a scored
            selection; explicit ``layers`` are taken as given unless ``protect`` is given
            too, and then a block in both is a contradiction (``ValueError``, at once or,
            for negative indices, when the model's depth is known).
        calibration: calibration source (``to_dict`` records a file's name only, and
            nothing for data); default: the embedded prose shipped with Python.
        num_prompts, seq_len, batch_size, seed: calibration budget.
        recovery: repair of the cut: ``None``, a method name (``"ghosted"``, ``"fused"``
            or one registered with :func:`~hf_layerswap.recovery.register_recovery_method`),
            a :class:`RecoveryConfig` or a dict of its fields; stored as a
            :class:`RecoveryConfig` (or ``None``).
        sparsity: optional one-shot sparsification after removal: a float target in
            [0, 1), a :class:`SparsityConfig` or a dict of its fields; stored as a
            :class:`SparsityConfig` (or ``None``).
        allocation, pruner, sparsity_pattern: constructor keywords for the other
            :class:`SparsityConfig` fields when ``sparsity`` is a float (checked against the
            registries of :func:`~hf_layerswap.sparsity.register_allocator` and
            :func:`~hf_layerswap.sparsity.register_pruner`); read them back as
            ``config.sparsity.allocation`` etc.; ignored, with a warning, without ``sparsity``.
        tokenizer: tokenizer for text calibration (runtime only); default: loaded from
            the checkpoint directory or Hub id being loaded.
        progress: show progress bars (runtime only).
        strategy: how the set is chosen, a name in
            :data:`hf_layerswap.selection.STRATEGIES` (the built-ins and those added with
            :func:`~hf_layerswap.selection.register_strategy`). Default ``"search"``: whole
            candidate sets from both protocols (each protocol's greedy set, lowest-scored
            layers, low-score contiguous runs, single-removal ranking) scored on the
            calibration prompts, the sets ranked by a prediction from the single removals
            and the pairs scored
            (:func:`hf_layerswap.selection.search_select`); ``"greedy"``: the paper's rule
            on ``protocol`` (with ``protocol="auto"``: the ``"auto"`` strategy); ``"auto"``:
            the better of the two protocols' greedy sets.
        objective: what ``"search"`` minimises on the calibration prompts:
            ``"removal_kl"``, ``"nll"`` or ``"ghosted"`` (the removal KL after the Ghosted
            Layers repair, fitted and measured on the same prompts). ``None``:
            ``"removal_kl"``, also with ``recovery="ghosted"``: on SmolLM2-135M the sets it
            picks are better after the repair than those the in-sample ``"ghosted"``
            objective picks, at every n = 1..6 (``benchmarks/results/quality-smollm2-135m.md``).
            An objective that scores sets after a repair (``"ghosted"``) needs that repair
            as ``recovery`` (refused otherwise: the saved model would be the unrepaired cut).
        max_evaluations: most candidate sets ``"search"`` scores in all (default ``None``: no cap
            beyond each budget's allowance, SLEB's schedule: U - (n - 1) sets at budget n for
            U removable blocks).
        strategy_options: the strategy's own typed options (its registry entry's
            ``option_class``, e.g. ``{"width": 4}`` for ``"beam"``, ``{"max_rounds": 2}`` for
            ``"search"``; the docs' "Method options" tables list them), a dict or the
            :class:`~hf_layerswap.utils.registry.Options` instance (kept as its dict); checked
            here against the strategy that runs (an unknown key, or a value of the wrong type
            or out of bounds, raises ``ValueError`` naming the key, the value and what is
            allowed); passed to :func:`~hf_layerswap.select_layers`, priced by
            :func:`~hf_layerswap.estimate_cost` and stated on the card. An option that a
            field also sets (``max_evaluations``) may be given in both only with one value.
            ``None`` (default): the strategy's defaults.
        score_protocols: the swap protocols scored before the selection (names of
            :data:`~hf_layerswap.scoring.protocols.SWAP_PROTOCOLS`); ``None`` (default): those
            the strategy reads (its registry entry's ``scores``: none for a strategy guided
            by no protocol, ``block_influence``, ``angular_distance``,
            ``single_removal_kl``, ``sleb``, whose prune then runs no swap-KL pass and
            whose card says that no swap-KL table was measured); a list must hold those the
            strategy reads and may add others (e.g. both, for the card's tables). Not with
            ``layers`` (nothing is scored).
        heal: healing after the cut (a :class:`HealConfig`, a dict of its fields or a method
            name); never together with ``sparsity`` (a ``recipe`` states that order).
        recipe: the steps after the removal, in the order they run: a list of
            :class:`RecoveryConfig` (only first: a repair fits the cut on the dense model's
            streams, which only the removal still has), :class:`HealConfig` and
            :class:`SparsityConfig` (or dicts with a ``"step"`` key, ``"repair"``, ``"heal"`` or
            ``"sparsify"``, and the config's fields: the form :meth:`to_dict` records), e.g.
            ``[HealConfig(...), SparsityConfig(0.5), HealConfig(...)]``; a heal after a
            sparsify keeps the zeros. ``None`` (default): ``recovery`` -> ``heal`` ->
            ``sparsity`` as those fields say (:meth:`after_removal`); giving both is refused.
        recovery_num_tokens, recovery_epsilon: constructor keywords for the other
            :class:`RecoveryConfig` fields when ``recovery`` is a method name; read them
            back as ``config.recovery.num_tokens`` and ``config.recovery.epsilon``.
        quant_method: ``"layerswap"`` (keyword only; transformers' registry key).
        version: format version of the serialized config (:data:`CONFIG_VERSION`, keyword only).

    Unknown constructor arguments raise ``TypeError`` and unknown keys in :meth:`from_dict`
    ``ValueError``, both naming the key, the closest allowed key and every allowed key.

    Raises:
        ValueError: contradictory or out-of-range fields (e.g. ``layers`` together with a
            different ``num_to_remove``, an unknown protocol, a non-finite ``recovery_epsilon``);
            the message names the value and what is allowed.
    """

    quant_method: str = field(default=QUANT_METHOD, kw_only=True, metadata=_help(  # type: ignore[assignment]  # transformers types it as its own enum; a plugin's key is a str
        "transformers' quantization method key: always 'layerswap'"))
    version: int = field(default=CONFIG_VERSION, kw_only=True, metadata=_help(
        "format version of the serialized config"))
    num_to_remove: int | None = field(default=None, metadata=_cli("remove this many layers, chosen by the strategy",
                                                                  minimum=1))
    layers: list[int] | None = field(default=None, metadata=_cli("remove exactly these 0-based layers"))
    protocol: ProtocolName = field(default="interchange", metadata=_cli(
        "protocol of the greedy strategy (auto: the better of both protocols' greedy sets)",
        choices=lambda: list(selection_protocols())))
    max_gap: int = field(default=1, metadata=_cli("pair distance bound: 1 = adjacent pairs", minimum=1))
    spacing: int | None = field(default=None, metadata=_cli(
        "selected layers stay more than this apart (default: 1 for greedy/auto, 0 for search)", minimum=0))
    protect: list[int] | None = field(default=None, metadata=_cli(
        "layers never removed (negative = from the end; default 0 -1 for a scored selection, "
        "none for explicit layers)"))
    calibration: Any = field(default=None, metadata=_help(
        "calibration text: a text file (e.g. WikiText-2 valid.txt), texts or token batches; "
        "default: prose shipped with Python"))
    num_prompts: int = field(default=64, metadata=_cli("calibration prompts: an int >= 1", minimum=1))
    seq_len: int = field(default=128, metadata=_cli("tokens per prompt (truncation)", minimum=2))
    batch_size: int = field(default=8, metadata=_cli("prompts per forward pass", minimum=1))
    seed: int = field(default=0, metadata=_cli("paragraph shuffle seed"))
    recovery: RecoveryConfig | None = field(default=None, metadata=RecoveryConfig.__dataclass_fields__["method"].metadata)
    sparsity: SparsityConfig | None = field(default=None, metadata=SparsityConfig.__dataclass_fields__["sparsity"].metadata)
    allocation: InitVar[AllocationName] = "pals"
    pruner: InitVar[PrunerName] = "wanda"
    sparsity_pattern: InitVar[str | None] = None
    tokenizer: Any = field(default=None, metadata=_help("tokenizer for text calibration", **_RUNTIME))
    progress: bool = field(default=True, metadata=_help("show progress bars", **_RUNTIME))
    strategy: str = field(default="search", metadata=_cli(
        "how the set is chosen", choices=lambda: sorted(STRATEGIES),
        entries=lambda: {n: strategy_entry(n).help for n in sorted(STRATEGIES)}))
    objective: ObjectiveName | None = field(default=None, metadata=_cli(
        "what the search strategy minimises on the calibration prompts (default removal_kl)",
        choices=lambda: list(OBJECTIVES)))
    max_evaluations: int | None = field(default=None, metadata=_cli(
        "most candidate sets search scores in all (default: no cap beyond each budget's allowance, SLEB's "
        "schedule: U - (n - 1) sets at budget n for U removable blocks)", minimum=1))
    heal: HealConfig | None = field(default=None, metadata=_help(
        "heal after the cut and its repair: distil the pruned model from the dense one (a HealConfig, a dict "
        "of its fields or a method name; default: no healing)"))
    recipe: list[RecoveryConfig | HealConfig | SparsityConfig] | None = field(default=None, metadata=_help(
        "the steps after the removal, in the order they run: RecoveryConfig (only first), HealConfig and "
        "SparsityConfig objects or dicts with a 'step' key ('repair', 'heal', 'sparsify'); default: the order "
        "recovery -> heal -> sparsity of those fields"))
    strategy_options: dict | None = field(default=None, metadata=_help(
        "the strategy's own options, e.g. {'width': 4} for beam (its registry entry's typed options; default: "
        "its defaults); on the command line --strategy-option KEY=VALUE"))
    score_protocols: list[str] | None = field(default=None, metadata=_cli(
        "swap-KL protocols scored before the selection (default: those the strategy reads; none for a strategy "
        "that reads no swap-KL score, e.g. sleb; name them to measure the tables for the card anyway)",
        choices=lambda: list(SWAP_PROTOCOLS)))
    recovery_num_tokens: InitVar[int | None] = None
    recovery_epsilon: InitVar[float | None] = None

    def __new__(cls, *args, **kwargs):
        # a misspelt keyword is named with its closest field before the generated __init__ runs
        problem = _unknown_keys("LayerSwapConfig got unexpected arguments", kwargs, config_keys())
        if problem:
            raise TypeError(problem)
        return super().__new__(cls)

    def __post_init__(self, allocation, pruner, sparsity_pattern, recovery_num_tokens, recovery_epsilon):
        flat = {"allocation": allocation, "pruner": pruner, "sparsity_pattern": sparsity_pattern,
                "recovery_num_tokens": recovery_num_tokens, "recovery_epsilon": recovery_epsilon}
        self.recovery = self._nested("recovery", RecoveryConfig, self.recovery, flat)
        self.sparsity = self._nested("sparsity", SparsityConfig, self.sparsity, flat)
        self.heal = _as_heal(self.heal)
        self._protect_given = self.protect is not None  # runtime only: explicit layers are checked against it
        self._spacing_given = self.spacing is not None  # runtime only: its default follows the strategy
        if self.protect is None:
            self.protect = [0, -1]
        if self.spacing is None:
            self.spacing = strategy_entry(self.strategy).spacing  # its entry's default (0 for an unknown name)
        self.validate()

    @staticmethod
    def _nested(name: str, kind, value, flat: dict):
        """``value`` (a method name or float target, a dict, the dataclass or ``None``) as
        ``kind``, with the flat constructor keywords of ``flat`` filled in."""
        keywords = {sub: flat[key] for key, (parent, sub) in FLAT_KEYWORDS.items() if parent == name}
        defaults = {f.name: f.default for f in fields(kind)}
        given = {sub: v for sub, v in keywords.items() if v != defaults[sub]}
        if value is None:
            if given:
                names = [key for key, (parent, sub) in FLAT_KEYWORDS.items() if parent == name and sub in given]
                warnings.warn(f"LayerSwapConfig: {names} ignored: {name} is None", UserWarning, stacklevel=4)
            return None
        if isinstance(value, (kind, Mapping)):
            data = _sub_config(kind, value, name)
        elif name == "recovery":
            data = {"method": value}
        else:
            data = {"sparsity": value}
        if name == "sparsity":
            if "sparsity" not in data:
                raise ValueError(f"LayerSwapConfig(sparsity={data!r}): the target 'sparsity' (a float in [0, 1)) is missing")
            if isinstance(value, (kind, Mapping)):
                clash = sorted(k for k, v in given.items() if k in data and data[k] != v)
                if clash:
                    raise ValueError(f"LayerSwapConfig: {clash} given both in sparsity={data!r} and as arguments")
        return kind(**{**keywords, **data})

    def validate(self) -> None:
        """Check every field (called by the constructor; call again after changing one). A
        ``recovery`` method name or a ``sparsity`` float set after construction becomes its
        sub-config here.

        Raises:
            ValueError: the first bad or contradictory field, naming it, its value and what
                is allowed.
        """
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"LayerSwapConfig(quant_method={self.quant_method!r}): allowed [{QUANT_METHOD!r}]")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or not 1 <= self.version <= CONFIG_VERSION:
            raise ValueError(f"LayerSwapConfig(version={self.version!r}): allowed 1..{CONFIG_VERSION} (a config.json "
                             "of a newer version is read with LayerSwapConfig.from_dict, which warns)")
        if self.recovery is not None and not isinstance(self.recovery, RecoveryConfig):
            self.recovery = self._nested("recovery", RecoveryConfig, self.recovery, _flat_defaults())
        if self.sparsity is not None and not isinstance(self.sparsity, SparsityConfig):
            self.sparsity = self._nested("sparsity", SparsityConfig, self.sparsity, _flat_defaults())
        self.num_to_remove = _check_int("num_to_remove", self.num_to_remove, 1, allow_none=True)
        layers = self.layers
        if layers is not None:
            layers = self.layers = _int_list("layers", layers)
            if not layers:
                raise ValueError("LayerSwapConfig(layers=[]): give at least one block index, or use num_to_remove")
            dupes = sorted({i for i in layers if layers.count(i) > 1})
            if dupes:  # same wording as remove_layers, which also catches -1 vs L-1 once L is known
                raise ValueError(f"duplicate layer indices {dupes} in {layers} (after resolving negative indices)")
            if self.num_to_remove is not None and self.num_to_remove != len(layers):
                raise ValueError(
                    f"LayerSwapConfig(num_to_remove={self.num_to_remove}, layers={layers}) is contradictory: "
                    f"layers names {len(layers)} blocks"
                )
        self.protect = _int_list("protect", self.protect)
        _check_choice("protocol", self.protocol, selection_protocols())
        self.max_gap = _check_int("max_gap", self.max_gap, 1)
        self.spacing = _check_int("spacing", self.spacing, 0)
        _check_choice("strategy", self.strategy, sorted(STRATEGIES))
        _check_choice("objective", self.objective, OBJECTIVES, allow_none=True)
        self.max_evaluations = _check_int("max_evaluations", self.max_evaluations, 1, allow_none=True)
        self._validate_strategy_options()
        self.num_prompts = _check_int("num_prompts", self.num_prompts, 1)
        self.seq_len = _check_int("seq_len", self.seq_len, 2)
        self.batch_size = _check_int("batch_size", self.batch_size, 1)
        if as_index(self.seed) is None:
            raise ValueError(f"LayerSwapConfig(seed={self.seed!r}): must be an int")
        self.seed = int(self.seed)
        self._validate_recovery()
        self._validate_sparsity()
        self._validate_heal()
        self._validate_recipe()
        self._validate_objective()
        if layers is not None and self._protect_given:
            clash = sorted(set(layers) & set(self.protect))
            if clash:
                raise ValueError(protect_clash(layers, self.protect, clash))

    def _validate_strategy_options(self) -> None:
        """``objective`` and ``max_evaluations`` only for a strategy that reads them (its
        registry entry's ``takes_objective`` and ``options``), never silently ignored."""
        entry = strategy_entry(self.strategy)
        if self.objective is not None and not entry.takes_objective:
            takers = sorted(n for n, e in STRATEGY_ENTRIES.items() if e.takes_objective)
            raise ValueError(f"LayerSwapConfig(strategy={self.strategy!r}, objective={self.objective!r}): "
                             f"strategy {self.strategy!r} minimises no objective; objective applies to {takers}")
        if self.max_evaluations is not None and "max_evaluations" not in (entry.options or ()):
            takers = strategies_taking("max_evaluations")
            raise ValueError(f"LayerSwapConfig(strategy={self.strategy!r}, max_evaluations={self.max_evaluations!r}): "
                             f"strategy {self.strategy!r} takes no max_evaluations; it applies to {takers}")
        self._validate_option_dict()
        self._validate_score_protocols()

    def selection_entry(self) -> Strategy:
        """The registry entry (:class:`~hf_layerswap.selection.registry.Strategy`) of the strategy
        that runs for this config's ``protocol`` (``greedy`` with ``protocol="auto"`` runs ``auto``)."""
        return strategy_entry(strategy_entry(self.strategy).strategy_for(self.protocol))

    def _validate_option_dict(self) -> None:
        """``strategy_options``: the typed options of the strategy that runs, each with one
        value (a field that also sets it, ``max_evaluations``, must agree)."""
        given = self.strategy_options
        if given is None:
            return
        if isinstance(given, Options):
            given = given.to_dict()
        entry = self.selection_entry()
        what = f"LayerSwapConfig(strategy={entry.name!r}, strategy_options={given!r})"
        if not isinstance(given, Mapping) or not all(isinstance(key, str) for key in given):
            raise ValueError(f"{what}: must be a dict of the strategy's options (str keys) or None")
        if self.layers is not None:
            raise ValueError(f"{what}: explicit layers are removed without a strategy; drop strategy_options or layers")
        try:
            entry.option_class.from_mapping(given, owner=f"strategy={entry.name!r}")
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
        fixed = entry.config_options(self)  # what the config's own fields already set
        clash = {key: fixed[key] for key in given if key in fixed and fixed[key] != given[key]}
        if clash:
            key = next(iter(clash))
            raise ValueError(f"{what} is contradictory: {key}={clash[key]!r} is set by the config's field {key!r} "
                             f"and {key}={given[key]!r} by strategy_options; give it once")
        self.strategy_options = dict(given)

    def _validate_score_protocols(self) -> None:
        """``score_protocols``: registered protocols without repeats, those the strategy reads among them."""
        value = self.score_protocols
        if value is None:
            return
        what = f"LayerSwapConfig(score_protocols={value!r})"
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ValueError(f"{what}: must be a list of protocols from {list(SWAP_PROTOCOLS)} or None")
        value = list(value)
        unknown = [p for p in value if not isinstance(p, str) or p not in SWAP_PROTOCOLS]  # a list is no key
        if unknown or len(set(value)) != len(value):
            raise ValueError(f"{what}: allowed a list without repeats of {list(SWAP_PROTOCOLS)}")
        if self.layers is not None:
            raise ValueError(f"{what}: explicit layers are removed without scoring; drop score_protocols or layers")
        entry = self.selection_entry()
        missing = [p for p in entry.scores(self.protocol) if p not in value] if self.num_to_remove is not None else []
        if missing:
            raise ValueError(f"{what}: strategy={entry.name!r} with protocol={self.protocol!r} reads {missing}; add "
                             "them, or leave score_protocols=None (the protocols the strategy reads)")
        self.score_protocols = value

    def selection_options(self) -> dict:
        """The keywords :func:`~hf_layerswap.select_layers` gets from this config beyond its
        own arguments: ``strategy_options``, then what the strategy's entry takes from the
        fields (``config_options``: ``objective``, ``max_evaluations``, ...)."""
        return {**(self.strategy_options or {}), **self.selection_entry().config_options(self)}

    def scored_protocols(self) -> list[str]:
        """The protocols the prune scores before the selection: ``score_protocols`` when
        given, else those the strategy reads (for a config that only scores, at least the
        paper's two); ``[]`` for explicit ``layers``."""
        if self.layers is not None:
            return []
        if self.score_protocols is not None:
            return list(self.score_protocols)
        scores = list(self.selection_entry().scores(self.protocol))
        return scores if scores or self.num_to_remove is not None else list(PROTOCOLS)

    def _validate_recovery(self) -> None:
        if self.recovery is not None:
            self.recovery = self._checked_recovery(self.recovery)

    def _checked_recovery(self, rec: RecoveryConfig) -> RecoveryConfig:
        """``rec`` checked (a field of this config or a repair step of its recipe), normalised."""
        _check_choice("recovery", rec.method, _recovery_choices())
        if self.num_to_remove is None and self.layers is None:
            raise ValueError(f"LayerSwapConfig(recovery={rec.method!r}) needs num_to_remove or layers: nothing is removed")
        num_tokens = _check_int("recovery_num_tokens", rec.num_tokens, 1, allow_none=True)
        if num_tokens is not None and type(rec.num_tokens) is not int:
            rec = replace(rec, num_tokens=num_tokens)
        eps = rec.epsilon
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
            raise ValueError(f"LayerSwapConfig(recovery_epsilon={eps!r}): must be a float >= 0 or None")
        if eps is not None:  # inf and values where the ridge fit means nothing (recovery.MAX_EPSILON)
            check_epsilon(eps, f"LayerSwapConfig(recovery_epsilon={eps!r})")
            entry = get_recovery_method(rec.method)
            if not entry.takes_epsilon and eps != entry.default_epsilon:
                raise ValueError(f"LayerSwapConfig(recovery_epsilon={eps!r}): recovery={rec.method!r} has no ridge; "
                                 f"allowed: None or {entry.default_epsilon!r}")
        return rec

    def _validate_objective(self) -> None:
        """An objective that scores each set after a repair (a recovery method that serves as a
        search objective) needs that repair: without it the saved model is the unrepaired cut,
        and the card would quote the repaired value of a model that does not exist."""
        repair = recovery_entry(self.objective)
        if repair is None or not repair.search_objective:
            return
        given = self.repair()
        method = given.method if given is not None else None
        if method != repair.name:
            plain = [o for o in OBJECTIVES if recovery_entry(o) is None]
            raise ValueError(
                f"LayerSwapConfig(objective={self.objective!r}, recovery={method!r}) is contradictory: the "
                f"{self.objective!r} objective scores each set after the {repair.name!r} repair, but "
                f"recovery={method!r} saves the model without it; pass recovery={repair.name!r} too, or an "
                f"objective that assumes no repair ({plain})"
            )

    def _validate_heal(self) -> None:
        self.heal = _as_heal(self.heal)
        if self.heal is None:
            return
        self._check_removes(f"heal={self.heal.method!r}")
        if self.sparsity is not None:
            raise ValueError("LayerSwapConfig(heal=..., sparsity=...): not both in one run: healing merges dense "
                             "updates into the weights (their zeros would fill), and sparsifying after healing "
                             "would leave its recorded numbers stale; heal, save, then sparsify the healed checkpoint "
                             "(or state the order with recipe=[HealConfig(...), SparsityConfig(...)], whose heal "
                             "after a sparsify keeps the zeros)")

    def _check_removes(self, what: str) -> None:
        if self.num_to_remove is None and self.layers is None:
            raise ValueError(f"LayerSwapConfig({what}) needs num_to_remove or layers: nothing is removed")

    def _validate_recipe(self) -> None:
        """``recipe``: a list of step configs (or dicts with a ``"step"`` key), never together
        with the ``recovery``/``heal``/``sparsity`` fields; a repair only first (it fits the
        cut on the dense model's streams around it, which only the removal still has)."""
        if self.recipe is None:
            return
        fields_given = [name for name in ("recovery", "heal", "sparsity") if getattr(self, name) is not None]
        if fields_given:
            raise ValueError(
                f"LayerSwapConfig(recipe=..., {fields_given[0]}=...) is contradictory: give the steps after the "
                "removal either as recipe=[...] (in the order they run) or as the recovery/heal/sparsity fields "
                "(run in the order repair, heal, sparsify), not both")
        if isinstance(self.recipe, (str, bytes, Mapping)) or not isinstance(self.recipe, Sequence):
            raise ValueError(f"LayerSwapConfig(recipe={self.recipe!r}): must be a list of RecoveryConfig, HealConfig "
                             f"or SparsityConfig (or dicts with a 'step' key in {list(RECIPE_STEPS)}), or None")
        steps = [self._recipe_step(k, value) for k, value in enumerate(self.recipe)]
        for k, step in enumerate(steps):
            if isinstance(step, RecoveryConfig) and k:
                raise ValueError(
                    f"LayerSwapConfig(recipe=...): step {k} is a repair ({step.method!r}) after "
                    f"{recipe_kind(steps[k - 1])!r}: a repair fits the cut on the dense model's streams around it, "
                    "which only the removal itself still has; put it first in the recipe (right after the removal)")
        self.recipe = steps

    def _recipe_step(self, k: int, value) -> RecoveryConfig | HealConfig | SparsityConfig:
        """Step ``k`` of ``recipe`` as its checked config."""
        if isinstance(value, Mapping):
            data = dict(value)
            kind = data.pop("step", None)
            if kind not in RECIPE_STEPS:
                raise ValueError(f"LayerSwapConfig(recipe[{k}]={dict(value)!r}): its 'step' must be one of "
                                 f"{list(RECIPE_STEPS)}")
            value = (_as_heal(data) if RECIPE_STEPS[kind] is HealConfig
                     else RECIPE_STEPS[kind](**_sub_config(RECIPE_STEPS[kind], data, f"recipe[{k}]")))
        if isinstance(value, RecoveryConfig):
            return self._checked_recovery(value)
        if isinstance(value, HealConfig):
            self._check_removes(f"recipe[{k}]=heal {value.method!r}")
            return value
        if isinstance(value, SparsityConfig):
            return self._checked_sparsity(value)
        raise ValueError(f"LayerSwapConfig(recipe[{k}]={value!r}): allowed RecoveryConfig, HealConfig, "
                         f"SparsityConfig or a dict with a 'step' key in {list(RECIPE_STEPS)}")

    def after_removal(self) -> list[RecoveryConfig | HealConfig | SparsityConfig]:
        """The steps after the removal, in the order they run: ``recipe`` when given, else
        ``recovery``, ``heal``, ``sparsity`` (those that are set)."""
        if self.recipe is not None:
            return list(self.recipe)
        return [step for step in (self.recovery, self.heal, self.sparsity) if step is not None]

    def repair(self) -> RecoveryConfig | None:
        """The repair of the cut (``recovery``, or the recipe's repair step), ``None`` without one."""
        return next((step for step in self.after_removal() if isinstance(step, RecoveryConfig)), None)

    def _validate_sparsity(self) -> None:
        if self.sparsity is not None:
            self.sparsity = self._checked_sparsity(self.sparsity)

    @staticmethod
    def _checked_sparsity(sp: SparsityConfig) -> SparsityConfig:
        """``sp`` checked (a field of this config or a sparsify step of its recipe), normalised."""
        target = sp.sparsity
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= float(target) < 1.0:
            raise ValueError(f"LayerSwapConfig(sparsity={target!r}): must be a float in [0, 1)")
        _check_choice("pruner", sp.pruner, PRUNERS)
        try:  # checked now: after loading, blocks would already be gone
            check_arguments(float(target), sp.allocation, sp.pruner, sp.pattern)
        except ValueError as err:
            raise ValueError(f"LayerSwapConfig: {err}") from None
        try:
            check_bound(float(target), sp.allocation)
        except ValueError as err:
            raise ValueError(
                f"LayerSwapConfig(allocation={sp.allocation!r}): {err} (the default delta here; choose "
                "allocation='uniform' or 'owl', or call hf_layerswap.sparsity.sparsify with a smaller delta)"
            ) from None
        return sp if type(target) is float else replace(sp, sparsity=float(target))

    def to_dict(self) -> dict:
        """The serialized fields, in field order (JSON-able; the sub-configs as dicts of
        their fields or ``None``): tokenizers and the progress switch never enter
        config.json, and calibration data is recorded as ``None`` (a file by its name only)."""
        out = {}
        for f in fields(self):
            if f.metadata.get("runtime"):
                continue
            value = getattr(self, f.name)
            out[f.name] = asdict(value) if isinstance(value, (RecoveryConfig, SparsityConfig)) else value
        out["heal"] = None if self.heal is None else self.heal.to_dict()
        out["recipe"] = None if self.recipe is None else [recipe_entry(step) for step in self.recipe]
        out["layers"] = None if self.layers is None else list(self.layers)
        out["strategy_options"] = None if self.strategy_options is None else dict(self.strategy_options)
        out["score_protocols"] = None if self.score_protocols is None else list(self.score_protocols)
        out["protect"] = list(self.protect)
        # a calibration file is recorded by its name: config.json gets published
        out["calibration"] = public_name(self.calibration) if isinstance(self.calibration, (str, os.PathLike)) else None
        return out

    @classmethod
    def from_dict(cls, config_dict: Mapping, return_unused_kwargs: bool = False, **kwargs):
        """Rebuild a config from :meth:`to_dict` output (e.g. a ``config.json`` record), or
        from any dict of constructor keywords (``quantization_config={...}``).

        A newer format version (with only known keys) warns and is read as this version;
        ``kwargs`` that name a field update it (transformers' convention), the others are
        returned with ``return_unused_kwargs=True``.

        Raises:
            ValueError: an unknown key (the message names it, the closest allowed key and
                every allowed key; see :func:`config_keys`), or a known field with a bad
                value. TypeError: not a mapping.
        """
        if not isinstance(config_dict, Mapping):
            raise TypeError(f"LayerSwapConfig.from_dict needs a mapping, got {type(config_dict).__name__}")
        data = dict(config_dict)
        version = data.get("version", CONFIG_VERSION)
        newer = isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION
        problem = _unknown_keys("LayerSwapConfig.from_dict", data, config_keys())
        if problem:
            raise ValueError(problem + (f" (format version {version} is newer than this hf_layerswap's "
                                        f"{CONFIG_VERSION}: upgrade hf_layerswap to read it)" if newer else ""))
        if newer:
            warnings.warn(f"LayerSwapConfig.from_dict: format version {version} read as version {CONFIG_VERSION} "
                          "(written by a newer hf_layerswap?)", UserWarning, stacklevel=2)
            data["version"] = CONFIG_VERSION
        config = cls(**data)
        unused = config.update(**kwargs)
        return (config, unused) if return_unused_kwargs else config

    def update(self, **kwargs) -> dict:
        """Set the fields (and flat keywords, e.g. ``recovery_epsilon``) named in ``kwargs``
        and validate the result as the constructor does (transformers' ``update``); the
        config is unchanged when it raises.

        Returns:
            The ``kwargs`` that name no field.

        Raises:
            ValueError: as the constructor.
        """
        known = set(config_keys()) | {"tokenizer", "progress"}
        used = {k: v for k, v in kwargs.items() if k in known}
        if used:
            current = {f.name: getattr(self, f.name) for f in fields(self)}
            current["protect"] = self.protect if self._protect_given else None
            current["spacing"] = self.spacing if self._spacing_given else None
            for key, value in list(used.items()):
                if key in FLAT_KEYWORDS:
                    parent, sub = FLAT_KEYWORDS[key]
                    if current[parent] is None:
                        raise ValueError(f"LayerSwapConfig.update({key}={value!r}): {parent} is None")
                    current[parent] = replace(current[parent], **{sub: used.pop(key)})
            fresh = type(self)(**{**current, **used})
            self.__dict__.update(fresh.__dict__)
        return {k: v for k, v in kwargs.items() if k not in known}

    def __iter__(self):
        yield from self.to_dict().items()

    def to_json_string(self, use_diff: bool = True) -> str:
        """:meth:`to_dict` as indented JSON (``use_diff`` is accepted for transformers and ignored)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        """Write :meth:`to_json_string` to ``json_file_path``."""
        with open(json_file_path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json_string())

    @classmethod
    def from_json_file(cls, json_file_path: str | os.PathLike) -> LayerSwapConfig:
        """Read a config written by :meth:`to_json_file` (see :meth:`from_dict`)."""
        with open(json_file_path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def __eq__(self, other) -> bool:
        if not isinstance(other, LayerSwapConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # mutable and compared by value: not hashable

    def __repr__(self) -> str:
        fields_ = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "quant_method")
        return f"LayerSwapConfig({fields_})"


# the flat keywords are constructor arguments only: read them from the sub-configs
for _name in FLAT_KEYWORDS:
    delattr(LayerSwapConfig, _name)
del _name


def _flat_defaults() -> dict:
    """Each flat keyword's default: its sub-config field's."""
    kinds: dict[str, Any] = {"recovery": RecoveryConfig, "sparsity": SparsityConfig}
    return {key: kinds[parent].__dataclass_fields__[sub].default for key, (parent, sub) in FLAT_KEYWORDS.items()}


def config_keys() -> list[str]:
    """Every key a config dict may hold: the fields of :class:`LayerSwapConfig` and its
    flat constructor keywords (:data:`FLAT_KEYWORDS`), in constructor order."""
    return [name for name in inspect.signature(LayerSwapConfig.__init__).parameters if name != "self"]


#: The kinds of step a ``recipe`` holds after the removal, by the ``"step"`` key of its dict form.
RECIPE_STEPS: dict[str, type] = {"repair": RecoveryConfig, "heal": HealConfig, "sparsify": SparsityConfig}


def recipe_kind(step) -> str:
    """The ``"step"`` name of a recipe step config (``"repair"``, ``"heal"``, ``"sparsify"``)."""
    return next(kind for kind, cls in RECIPE_STEPS.items() if isinstance(step, cls))


def recipe_entry(step) -> dict:
    """A recipe step config as the JSON-able dict :meth:`LayerSwapConfig.to_dict` records:
    ``{"step": kind, **its fields}`` (a healing text by its name only)."""
    return {"step": recipe_kind(step), **(step.to_dict() if isinstance(step, HealConfig) else asdict(step))}


def _as_heal(value) -> HealConfig | None:
    """``heal=`` as a :class:`HealConfig`: ``None``, a method name, a dict of its fields or the
    dataclass (unknown dict keys raise, naming the closest field)."""
    if value is None or isinstance(value, HealConfig):
        return value
    if isinstance(value, str):
        return HealConfig(method=value)
    if isinstance(value, Mapping):
        return HealConfig(**_sub_config(HealConfig, value, "heal"))
    raise ValueError(f"LayerSwapConfig(heal={value!r}): allowed None, a method name {sorted(HEAL_METHODS)}, "
                     "a HealConfig or a dict of its fields")


def check_against_model(cfg: LayerSwapConfig, model) -> None:
    """Refuse, before any forward pass, a config the model's architecture cannot run: a
    repair that cannot act on the blocks a cut may end after (its
    :meth:`~hf_layerswap.recovery.methods.RecoveryMethod.check_hosts`, e.g. ``fused`` on
    post-norm Gemma-3 blocks), for the given ``layers`` exactly, and for a selection every
    unprotected block's predecessor (unless the only set the budget allows is blocks
    ``0..n-1``, whose cut has no such block). ``model`` may be on the meta device.

    Raises:
        ValueError: naming the repair, the block and what to use instead.
    """
    repair = cfg.repair()
    if repair is None or (cfg.layers is None and cfg.num_to_remove is None):
        return
    _, _, blocks = decoder_blocks(model)
    total = len(blocks)
    if cfg.layers is not None:
        hosts = [c["host"] for c in cut_boundaries(total, list(cfg.layers)) if c["host"] is not None]
    else:
        allowed = [i for i in range(total) if i not in resolve_protect(cfg.protect, total)]
        hosts = [] if allowed == list(range(cfg.num_to_remove)) else sorted({i - 1 for i in allowed if i > 0})
    get_recovery_method(repair.method).check_hosts(model, blocks, hosts)


def protect_clash(layers, protect, clash) -> str:
    """The error message for blocks that ``layers`` removes and ``protect`` protects (``clash``)."""
    return (f"LayerSwapConfig(layers={list(layers)}, protect={list(protect)}) is contradictory: block(s) {clash} "
            "would be removed and protected; drop them from layers or from protect")
