"""``LayerSwapConfig``: what to remove, how to choose it, and what to do after the cut.

The one typed description of a pruning run: :func:`hf_layerswap.pipeline.prune` reads it,
``from_pretrained(..., quantization_config=LayerSwapConfig(...))`` carries it through
transformers' quantizer plugin API (:mod:`hf_layerswap.integration`, which re-exports
every name here), ``hf-layerswap prune`` and the demo build it from their flags, and its
:meth:`~LayerSwapConfig.to_dict` is recorded in ``config.layerswap["steps"][k]["config"]``.
Every field is checked in :meth:`LayerSwapConfig.validate`. The closed choices
(``protocol``, ``objective``) are ``Literal`` types and the allowed lists come from them;
the choices with a registry (``strategy``, the ``recovery`` method, the sparsity
``allocation`` and ``method``) are checked against the registry when the config is
validated, so a name added with ``register_strategy``, ``register_recovery_method``,
``register_allocator`` or ``register_pruner`` is accepted (their ``Literal`` annotations
name the built-ins). The repair and the sparsification have sub-configs
(:class:`RecoveryConfig`, :class:`SparsityConfig`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args

from transformers.utils.quantization_config import QuantizationConfigMixin

from .plan import as_index
from .provenance import public_name
from .recovery import RECOVERY_METHODS
from .selection import STRATEGIES
from .selection.core import selection_protocols
from .sparsity import check_arguments, check_bound

__all__ = [
    "CONFIG_VERSION",
    "LayerSwapConfig",
    "QUANT_METHOD",
    "RecoveryConfig",
    "SparsityConfig",
]

QUANT_METHOD = "layerswap"
#: Format version of :meth:`LayerSwapConfig.to_dict` (``config.json`` of a pruned checkpoint).
CONFIG_VERSION = 1
#: Constructor arguments that are runtime-only and never serialized.
RUNTIME_ONLY = ("calibration", "tokenizer", "progress")

#: Allowed values of the closed choices (the ``Literal`` types are the single source).
ProtocolName = Literal["replacement", "interchange", "auto"]
ObjectiveName = Literal["removal_kl", "nll", "ghosted"]
#: The built-in names of the choices with a registry; validation reads the registries
#: (:data:`~hf_layerswap.recovery.RECOVERY_METHODS`, :data:`~hf_layerswap.sparsity.ALLOCATORS`,
#: :data:`~hf_layerswap.sparsity.PRUNERS`), so registered names are allowed too.
RecoveryMethod = Literal["ghosted", "fused"]
AllocationName = Literal["uniform", "pals", "owl", "random", "gradient"]
PrunerName = Literal["wanda", "sparsegpt", "magnitude"]
#: The recovery registry's plain removal (``"none"``), which the config spells ``recovery=None``.
_PLAIN_REMOVAL = "none"


def _recovery_choices() -> list:
    """The allowed ``recovery`` values now: ``None`` (plain removal) and every method
    registered with :func:`~hf_layerswap.recovery.register_recovery_method` but
    ``"none"``."""
    return [None] + [name for name in RECOVERY_METHODS if name != _PLAIN_REMOVAL]


def _check_int(name: str, value, minimum: int, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be an int >= {minimum}")


def _check_choice(name: str, value, allowed, allow_none: bool = False):
    allowed = list(allowed)
    if value is None and allow_none:
        return
    if value not in allowed:
        raise ValueError(f"LayerSwapConfig({name}={value!r}): allowed {allowed + ([None] if allow_none else [])}")


def _int_list(name: str, value) -> list[int]:
    if isinstance(value, (int, str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be a list of 0-based block indices (ints)")
    out = list(value)
    bad = [v for v in out if as_index(v) is None]
    if bad:
        raise ValueError(f"LayerSwapConfig({name}={out!r}): entries {bad!r} are not ints; indices are 0-based ints")
    return [as_index(v) for v in out]


def _sub_config(kind, value, what: str) -> dict:
    """The fields of a sub-config given as its dataclass or a dict; unknown keys raise."""
    if isinstance(value, kind):
        return asdict(value)
    names = [f.name for f in fields(kind)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"LayerSwapConfig({what}={dict(value)!r}): unknown keys {unknown}; allowed {names}")
    return dict(value)


@dataclass(frozen=True)
class RecoveryConfig:
    """Repair of the cut (:func:`hf_layerswap.recovery.recover`).

    Attributes:
        method: ``"ghosted"`` (Ghosted Layers, arXiv 2605.15491, operators attached),
            ``"fused"`` (folded into ``down_proj``) or a name registered with
            :func:`~hf_layerswap.recovery.register_recovery_method`.
        num_tokens: at most this many real calibration tokens for the fit; ``None`` = every
            real token of the calibration set, at most 65,536 (:func:`~hf_layerswap.recovery.recover`).
        epsilon: relative ridge toward the identity (>= 0); ``None`` = the method's default.
    """

    method: RecoveryMethod = "ghosted"
    num_tokens: int | None = None
    epsilon: float | None = None


@dataclass(frozen=True)
class SparsityConfig:
    """One-shot sparsification after removal (:func:`hf_layerswap.sparsity.sparsify`).

    Attributes:
        sparsity: overall target in [0, 1) (fraction of prunable block weights set to zero).
        allocation: per-block rule (``"pals"`` default, ``"uniform"``, ``"owl"``, ...).
        method: the pruner (``"wanda"`` default, ``"sparsegpt"``, ``"magnitude"``).
        pattern: ``None`` (unstructured) or ``"N:M"`` such as ``"2:4"``.
    """

    sparsity: float
    allocation: AllocationName = "pals"
    method: PrunerName = "wanda"
    pattern: str | None = None


class LayerSwapConfig(QuantizationConfigMixin):
    """Configuration for removing decoder blocks at load time.

    Args:
        num_layers: remove this many blocks, chosen by swap-KL scoring. ``None`` with
            ``layers=None`` scores only (the report is attached; nothing is removed, a
            requested ``sparsity`` is still applied).
        layers: explicit 0-based block indices to remove (no scoring). They index the
            blocks of the checkpoint being loaded: on a checkpoint that is already pruned
            (``config.layerswap`` records an earlier removal) ``layers=[2]`` removes its
            *current* block 2, which may be another block of the original model (after
            removing original blocks 1 and 4 of 8, current block 2 is original block 3).
            ``config.layerswap`` and the card record every step in both numberings.
        strategy: how the set is chosen, a name in
            :data:`hf_layerswap.selection.STRATEGIES` (the built-ins and those added with
            :func:`~hf_layerswap.selection.register_strategy`). Default ``"search"``: whole
            candidate sets from both protocols (each protocol's greedy set, lowest-scored
            layers, low-score contiguous runs, single-removal ranking) scored on the
            calibration prompts and refined by local moves
            (:func:`hf_layerswap.selection.search_select`); ``"greedy"``: the paper's rule on
            ``protocol`` (with ``protocol="auto"``: the ``"auto"`` strategy); ``"auto"``:
            the better of the two protocols' greedy sets.
        objective: what ``"search"`` minimises on the calibration prompts:
            ``"removal_kl"``, ``"nll"`` or ``"ghosted"`` (the removal KL after the Ghosted
            Layers repair, fitted and measured on the same prompts). ``None``:
            ``"removal_kl"``, also with ``recovery="ghosted"``: on SmolLM2-135M the sets it
            picks are better after the repair than those the in-sample ``"ghosted"``
            objective picks, at every n = 1..6 (``benchmarks/results/quality-smollm2-135m.md``).
        max_evaluations: most candidate sets ``"search"`` scores in all (default ``None``: no cap
            beyond each budget's allowance of one set per removable block).
        protocol: ``"interchange"`` (default), ``"replacement"`` or ``"auto"`` (both
            candidate sets evaluated by joint removal KL; the lower is kept).
        max_gap, spacing, protect: scoring and selection rules, see
            :func:`~hf_layerswap.score_layers` and :func:`~hf_layerswap.select_layers`.
            ``protect`` defaults to ``(0, -1)`` (first and last block) for a scored
            selection; explicit ``layers`` are taken as given unless ``protect`` is given
            too, and then a block in both is a contradiction (``ValueError``, at once or,
            for negative indices, when the model's depth is known).
        calibration: calibration source (runtime only; ``to_dict`` records a file's name
            only); default: the embedded prose shipped with Python.
        tokenizer: tokenizer for text calibration (runtime only); default: loaded from
            the checkpoint directory or Hub id being loaded.
        num_prompts, seq_len, batch_size, seed: calibration budget.
        recovery: repair of the cut: ``None``, a method name (``"ghosted"``, ``"fused"``
            or one registered with :func:`~hf_layerswap.recovery.register_recovery_method`),
            a :class:`RecoveryConfig` or a dict of its fields.
        recovery_num_tokens, recovery_epsilon: the other :class:`RecoveryConfig` fields
            in flat form.
        sparsity: optional one-shot sparsification after removal: a float target in
            [0, 1), a :class:`SparsityConfig` or a dict of its fields (then
            ``allocation``, ``method`` and ``sparsity_pattern`` come from it).
        allocation, method, sparsity_pattern: the other :class:`SparsityConfig` fields in
            flat form (see :func:`hf_layerswap.sparsity.sparsify`; checked against the
            registries of :func:`~hf_layerswap.sparsity.register_allocator` and
            :func:`~hf_layerswap.sparsity.register_pruner`, only when ``sparsity`` is set).
        progress: show progress bars (runtime only).
        version: format version of the serialized config (:data:`CONFIG_VERSION`).

    Unknown constructor arguments raise ``TypeError`` (a misspelt name); unknown keys in
    :meth:`from_dict` (a ``config.json`` written by a newer version) are dropped with a
    warning.

    Raises:
        ValueError: contradictory or out-of-range fields (e.g. ``layers`` together with a
            different ``num_layers``, an unknown protocol); the message names the value and
            what is allowed.
    """

    def __init__(
        self,
        num_layers: int | None = None,
        layers: Sequence[int] | None = None,
        protocol: ProtocolName = "interchange",
        max_gap: int = 1,
        spacing: int | None = None,
        protect: Sequence[int] | None = None,
        calibration=None,
        num_prompts: int = 64,
        seq_len: int = 128,
        batch_size: int = 8,
        seed: int = 0,
        recovery: RecoveryMethod | RecoveryConfig | Mapping | None = None,
        sparsity: float | SparsityConfig | Mapping | None = None,
        allocation: AllocationName = "pals",
        method: PrunerName = "wanda",
        sparsity_pattern: str | None = None,
        tokenizer=None,
        progress: bool = True,
        strategy: str = "search",
        objective: ObjectiveName | None = None,
        max_evaluations: int | None = None,
        recovery_num_tokens: int | None = None,
        recovery_epsilon: float | None = None,
        version: int = CONFIG_VERSION,
        **kwargs,
    ):
        kwargs.pop("quant_method", None)
        if kwargs:
            raise TypeError(f"LayerSwapConfig got unexpected arguments {sorted(kwargs)}")
        self.quant_method = QUANT_METHOD
        if isinstance(recovery, (RecoveryConfig, Mapping)):
            given = _sub_config(RecoveryConfig, recovery, "recovery")
            recovery = given.get("method", "ghosted")
            recovery_num_tokens = given.get("num_tokens", recovery_num_tokens)
            recovery_epsilon = given.get("epsilon", recovery_epsilon)
        if isinstance(sparsity, (SparsityConfig, Mapping)):
            given = _sub_config(SparsityConfig, sparsity, "sparsity")
            if "sparsity" not in given:
                raise ValueError(f"LayerSwapConfig(sparsity={given!r}): the target 'sparsity' (a float in [0, 1)) is missing")
            flat = {"allocation": (allocation, "pals"), "method": (method, "wanda"), "pattern": (sparsity_pattern, None)}
            clash = sorted(k for k, (v, default) in flat.items() if v != default and k in given and given[k] != v)
            if clash:
                raise ValueError(f"LayerSwapConfig: {clash} given both in sparsity={given!r} and as arguments")
            sparsity = given["sparsity"]
            allocation = given.get("allocation", allocation)
            method = given.get("method", method)
            sparsity_pattern = given.get("pattern", sparsity_pattern)
        self.num_layers = num_layers
        self.layers = None if layers is None else _int_list("layers", layers)
        self.protocol = protocol
        self.max_gap = max_gap
        self.strategy = strategy
        self.spacing = (1 if strategy in ("greedy", "auto") else 0) if spacing is None else spacing
        self.objective = objective
        self.max_evaluations = max_evaluations
        self._protect_given = protect is not None  # runtime only: explicit layers are checked against it
        self.protect = _int_list("protect", (0, -1) if protect is None else protect)
        self.calibration = calibration
        self.num_prompts = num_prompts
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.recovery = recovery
        self.recovery_num_tokens = recovery_num_tokens
        self.recovery_epsilon = recovery_epsilon
        self.sparsity = sparsity
        self.allocation = allocation
        self.method = method
        self.sparsity_pattern = sparsity_pattern
        self.tokenizer = tokenizer
        self.progress = progress
        self.version = version
        self.validate()
        if self.sparsity is not None:
            self.sparsity = float(self.sparsity)

    #: Serialized fields, in ``config.json`` order.
    FIELDS = (
        "quant_method", "version", "num_layers", "layers", "protocol", "max_gap", "spacing", "protect", "calibration",
        "num_prompts", "seq_len", "batch_size", "seed", "recovery", "recovery_num_tokens", "recovery_epsilon",
        "sparsity", "allocation", "method", "sparsity_pattern", "strategy", "objective", "max_evaluations",
    )

    def validate(self) -> None:
        """Check every field (called by the constructor; call again after changing one).

        Raises:
            ValueError: the first bad or contradictory field, naming it, its value and what
                is allowed.
        """
        if isinstance(self.version, bool) or not isinstance(self.version, int) or not 1 <= self.version <= CONFIG_VERSION:
            raise ValueError(f"LayerSwapConfig(version={self.version!r}): allowed 1..{CONFIG_VERSION} (a config.json "
                             "of a newer version is read with LayerSwapConfig.from_dict, which warns)")
        _check_int("num_layers", self.num_layers, 1, allow_none=True)
        layers = self.layers
        if layers is not None:
            layers = self.layers = _int_list("layers", layers)
            if not layers:
                raise ValueError("LayerSwapConfig(layers=[]): give at least one block index, or use num_layers")
            dupes = sorted({i for i in layers if layers.count(i) > 1})
            if dupes:  # same wording as remove_layers, which also catches -1 vs L-1 once L is known
                raise ValueError(f"duplicate layer indices {dupes} in {layers} (after resolving negative indices)")
            if self.num_layers is not None and self.num_layers != len(layers):
                raise ValueError(
                    f"LayerSwapConfig(num_layers={self.num_layers}, layers={layers}) is contradictory: "
                    f"layers names {len(layers)} blocks"
                )
        _check_choice("protocol", self.protocol, selection_protocols())
        _check_int("max_gap", self.max_gap, 1)
        _check_int("spacing", self.spacing, 0)
        _check_choice("strategy", self.strategy, sorted(STRATEGIES))
        _check_choice("objective", self.objective, get_args(ObjectiveName), allow_none=True)
        _check_int("max_evaluations", self.max_evaluations, 1, allow_none=True)
        _check_int("num_prompts", self.num_prompts, 1)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("batch_size", self.batch_size, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LayerSwapConfig(seed={self.seed!r}): must be an int")
        _check_choice("recovery", self.recovery, _recovery_choices())
        if self.recovery is not None and self.num_layers is None and layers is None:
            raise ValueError(f"LayerSwapConfig(recovery={self.recovery!r}) needs num_layers or layers: nothing is removed")
        _check_int("recovery_num_tokens", self.recovery_num_tokens, 1, allow_none=True)
        eps = self.recovery_epsilon
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
            raise ValueError(f"LayerSwapConfig(recovery_epsilon={eps!r}): must be a float >= 0 or None")
        sparsity = self.sparsity
        if sparsity is not None and (isinstance(sparsity, bool) or not isinstance(sparsity, (int, float))
                                     or not 0.0 <= float(sparsity) < 1.0):
            raise ValueError(f"LayerSwapConfig(sparsity={sparsity!r}): must be a float in [0, 1)")
        if sparsity is not None:  # checked now: after loading, blocks would already be gone
            try:
                check_arguments(float(sparsity), self.allocation, self.method, self.sparsity_pattern)
            except ValueError as err:
                raise ValueError(f"LayerSwapConfig: {err}") from None
            try:
                check_bound(float(sparsity), self.allocation)
            except ValueError as err:
                raise ValueError(
                    f"LayerSwapConfig(allocation={self.allocation!r}): {err} (the default delta here; choose "
                    "allocation='uniform' or 'owl', or call hf_layerswap.sparsity.sparsify with a smaller delta)"
                ) from None
        if layers is not None and self._protect_given:
            clash = sorted(set(layers) & set(self.protect))
            if clash:
                raise ValueError(_protect_clash(layers, self.protect, clash))

    @property
    def recovery_config(self) -> RecoveryConfig | None:
        """The repair as a :class:`RecoveryConfig` (``None``: no repair)."""
        if self.recovery is None:
            return None
        return RecoveryConfig(self.recovery, self.recovery_num_tokens, self.recovery_epsilon)

    @property
    def sparsity_config(self) -> SparsityConfig | None:
        """The sparsification as a :class:`SparsityConfig` (``None``: none)."""
        if self.sparsity is None:
            return None
        return SparsityConfig(self.sparsity, self.allocation, self.method, self.sparsity_pattern)

    def to_dict(self) -> dict:
        """Serializable fields only (JSON-able, in :attr:`FIELDS` order): calibration data,
        tokenizers and the progress switch never enter config.json."""
        out = {k: getattr(self, k) for k in self.FIELDS}
        out["layers"] = None if self.layers is None else list(self.layers)
        out["protect"] = list(self.protect)
        # a calibration file is recorded by its name: config.json gets published
        out["calibration"] = public_name(self.calibration) if isinstance(self.calibration, (str, os.PathLike)) else None
        return out

    @classmethod
    def from_dict(cls, config_dict: Mapping, return_unused_kwargs: bool = False, **kwargs):
        """Rebuild a config from :meth:`to_dict` output (e.g. a ``config.json`` record).

        Keys this version does not know (written by a newer version) are dropped with a
        warning naming them; the remaining fields are validated as in the constructor.

        Raises:
            ValueError: a known field with a bad value. TypeError: not a mapping.
        """
        if not isinstance(config_dict, Mapping):
            raise TypeError(f"LayerSwapConfig.from_dict needs a mapping, got {type(config_dict).__name__}")
        known = set(cls.FIELDS) | set(RUNTIME_ONLY)
        data = dict(config_dict)
        unknown = sorted(str(k) for k in data if k not in known)
        version = data.get("version", CONFIG_VERSION)
        newer = isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION
        if unknown or newer:
            what = [f"ignoring unknown keys {unknown}"] if unknown else []
            if newer:
                what.append(f"format version {version} read as version {CONFIG_VERSION}")
            warnings.warn(f"LayerSwapConfig.from_dict: {'; '.join(what)} (written by a newer hf_layerswap?)",
                          UserWarning, stacklevel=2)
            data = {k: v for k, v in data.items() if k in known}
            if newer:
                data["version"] = CONFIG_VERSION
        return super().from_dict(data, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def to_json_string(self, use_diff: bool = True) -> str:
        """:meth:`to_dict` as indented JSON (``use_diff`` is accepted for transformers and ignored)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        """Write :meth:`to_json_string` to ``json_file_path``."""
        with open(json_file_path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json_string())

    @classmethod
    def from_json_file(cls, json_file_path: str | os.PathLike) -> LayerSwapConfig:
        """Read a config written by :meth:`to_json_file` (unknown keys warn, see :meth:`from_dict`)."""
        with open(json_file_path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def __eq__(self, other) -> bool:
        if not isinstance(other, LayerSwapConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None

    def __repr__(self) -> str:
        fields_ = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "quant_method")
        return f"LayerSwapConfig({fields_})"


def _protect_clash(layers, protect, clash) -> str:
    return (f"LayerSwapConfig(layers={list(layers)}, protect={list(protect)}) is contradictory: block(s) {clash} "
            "would be removed and protected; drop them from layers or from protect")
