"""Layer removal inside ``from_pretrained`` through transformers' quantizer plugin API.

``import hf_layerswap`` registers ``quant_method="layerswap"`` with
``register_quantization_config`` / ``register_quantizer``. Then::

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=LayerSwapConfig(num_layers=2, protocol="interchange")
    )

scores the loaded model (unless ``layers`` is given), selects and removes blocks after the
weights load. The quantizer then detaches itself ("strip mode"): the model is a plain
transformers model, ``save_pretrained`` writes no ``quantization_config``, and the saved
checkpoint reloads in plain transformers without this library. Provenance lives in
``model.config.layerswap``; the swap report is on ``model.layerswap_report``.

A checkpoint saved with Ghosted Layers recovery carries a ``quant_method="layerswap"``
marker instead: loading it with ``hf_layerswap`` imported prunes nothing and re-attaches its
operators (:func:`hf_layerswap.recovery.attach_saved_recovery`); when their file cannot be
found there, a warning says so and the plainly pruned model loads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .plan import as_index
from .report import PROTOCOLS

__all__ = ["LayerSwapConfig", "LayerSwapQuantizer", "QUANT_METHOD"]

logger = logging.getLogger(__name__)

QUANT_METHOD = "layerswap"
#: Constructor arguments that are runtime-only and never serialized.
RUNTIME_ONLY = ("calibration", "tokenizer")
_RECOVERY_METHODS = (None, "ghosted", "fused")


def _check_int(name: str, value, minimum: int, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be an int >= {minimum}")


def _int_list(name: str, value) -> list[int]:
    if isinstance(value, (int, str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"LayerSwapConfig({name}={value!r}): must be a list of 0-based block indices (ints)")
    out = list(value)
    bad = [v for v in out if as_index(v) is None]
    if bad:
        raise ValueError(f"LayerSwapConfig({name}={out!r}): entries {bad!r} are not ints; indices are 0-based ints")
    return [as_index(v) for v in out]


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
            :data:`hf_layerswap.selection.STRATEGIES`. Default ``"search"``: whole
            candidate sets from both protocols (each protocol's greedy set, lowest-scored
            layers, low-score contiguous runs, single-removal ranking) scored on the
            calibration prompts and refined by local moves
            (:func:`hf_layerswap.search.search_select`); ``"greedy"``: the paper's rule on
            ``protocol``; ``"auto"``: the better of the two protocols' greedy sets.
        objective: what ``"search"`` minimises on the calibration prompts:
            ``"removal_kl"``, ``"nll"`` or ``"ghosted"`` (the removal KL after the Ghosted
            Layers repair). ``None``: ``"ghosted"`` when ``recovery="ghosted"``, else
            ``"removal_kl"``.
        max_evaluations: most candidate sets ``"search"`` scores (default ``5 * L``).
        protocol: ``"interchange"`` (default), ``"replacement"`` or ``"auto"`` (both
            candidate sets evaluated by joint removal KL; the lower is kept).
        max_gap, spacing, protect: scoring and selection rules, see
            :func:`~hf_layerswap.score_layers` and :func:`~hf_layerswap.select_layers`.
            ``protect`` defaults to ``(0, -1)`` (first and last block) for a scored
            selection; explicit ``layers`` are taken as given unless ``protect`` is given
            too, and then a block in both is a contradiction (``ValueError``, at once or,
            for negative indices, when the model's depth is known).
        calibration: calibration source (runtime only, never serialized); default: the
            embedded prose shipped with Python.
        tokenizer: tokenizer for text calibration (runtime only); default: loaded from
            the checkpoint directory or Hub id being loaded.
        num_prompts, seq_len, batch_size, seed: calibration budget.
        recovery: ``None``, ``"ghosted"`` or ``"fused"`` (repair of the cut).
        sparsity, allocation, method, sparsity_pattern: optional one-shot sparsification
            after removal (see :func:`hf_layerswap.sparsity.sparsify`).
        progress: show progress bars while scoring.

    Raises:
        ValueError: contradictory or out-of-range fields (e.g. ``layers`` together with a
            different ``num_layers``, an unknown protocol).
    """

    def __init__(
        self,
        num_layers: int | None = None,
        layers: Sequence[int] | None = None,
        protocol: str = "interchange",
        max_gap: int = 1,
        spacing: int | None = None,
        protect: Sequence[int] | None = None,
        calibration=None,
        num_prompts: int = 64,
        seq_len: int = 128,
        batch_size: int = 8,
        seed: int = 0,
        recovery: str | None = None,
        sparsity: float | None = None,
        allocation: str = "pals",
        method: str = "wanda",
        sparsity_pattern: str | None = None,
        tokenizer=None,
        progress: bool = True,
        strategy: str = "search",
        objective: str | None = None,
        max_evaluations: int | None = None,
        **kwargs,
    ):
        kwargs.pop("quant_method", None)
        if kwargs:
            raise TypeError(f"LayerSwapConfig got unexpected arguments {sorted(kwargs)}")
        self.quant_method = QUANT_METHOD
        _check_int("num_layers", num_layers, 1, allow_none=True)
        if layers is not None:
            layers = _int_list("layers", layers)
            if not layers:
                raise ValueError("LayerSwapConfig(layers=[]): give at least one block index, or use num_layers")
            dupes = sorted({i for i in layers if layers.count(i) > 1})
            if dupes:  # same wording as remove_layers, which also catches -1 vs L-1 once L is known
                raise ValueError(f"duplicate layer indices {dupes} in {layers} (after resolving negative indices)")
            if num_layers is not None and num_layers != len(layers):
                raise ValueError(
                    f"LayerSwapConfig(num_layers={num_layers}, layers={layers}) is contradictory: "
                    f"layers names {len(layers)} blocks"
                )
        if protocol not in PROTOCOLS + ("auto",):
            raise ValueError(f"LayerSwapConfig(protocol={protocol!r}): allowed {list(PROTOCOLS) + ['auto']}")
        _check_int("max_gap", max_gap, 1)
        _check_int("spacing", spacing, 0, allow_none=True)
        from .selection import STRATEGIES

        if strategy not in STRATEGIES:
            raise ValueError(f"LayerSwapConfig(strategy={strategy!r}): allowed {sorted(STRATEGIES)}")
        if objective is not None and objective not in ("removal_kl", "nll", "ghosted"):
            raise ValueError(f"LayerSwapConfig(objective={objective!r}): allowed ['removal_kl', 'nll', 'ghosted'] or None")
        _check_int("max_evaluations", max_evaluations, 1, allow_none=True)
        _check_int("num_prompts", num_prompts, 1)
        _check_int("seq_len", seq_len, 2)
        _check_int("batch_size", batch_size, 1)
        if recovery not in _RECOVERY_METHODS:
            raise ValueError(f"LayerSwapConfig(recovery={recovery!r}): allowed {list(_RECOVERY_METHODS)}")
        if recovery is not None and num_layers is None and layers is None:
            raise ValueError(f"LayerSwapConfig(recovery={recovery!r}) needs num_layers or layers: nothing is removed")
        if sparsity is not None and not (isinstance(sparsity, (int, float)) and 0.0 <= float(sparsity) < 1.0):
            raise ValueError(f"LayerSwapConfig(sparsity={sparsity!r}): must be a float in [0, 1)")
        if sparsity is not None:  # checked now: after loading, blocks would already be gone
            from .sparsity import check_arguments, check_bound

            try:
                check_arguments(float(sparsity), allocation, method, sparsity_pattern)
            except ValueError as err:
                raise ValueError(f"LayerSwapConfig: {err}") from None
            try:
                check_bound(float(sparsity), allocation)
            except ValueError as err:
                raise ValueError(
                    f"LayerSwapConfig(allocation={allocation!r}): {err} (the default delta here; choose "
                    "allocation='uniform' or 'owl', or call hf_layerswap.sparsity.sparsify with a smaller delta)"
                ) from None
        self.num_layers = num_layers
        self.layers = layers
        self.protocol = protocol
        self.max_gap = max_gap
        self.spacing = (1 if strategy in ("greedy", "auto") else 0) if spacing is None else spacing
        self.strategy = strategy
        self.objective = objective
        self.max_evaluations = max_evaluations
        self._protect_given = protect is not None  # runtime only: explicit layers are checked against it
        self.protect = _int_list("protect", (0, -1) if protect is None else protect)
        if layers is not None and self._protect_given:
            clash = sorted(set(layers) & set(self.protect))
            if clash:
                raise ValueError(_protect_clash(layers, self.protect, clash))
        self.calibration = calibration
        self.num_prompts = num_prompts
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.recovery = recovery
        self.sparsity = None if sparsity is None else float(sparsity)
        self.allocation = allocation
        self.method = method
        self.sparsity_pattern = sparsity_pattern
        self.tokenizer = tokenizer
        self.progress = progress

    def to_dict(self) -> dict:
        """Serializable fields only: calibration data and tokenizers never enter config.json."""
        from .models import public_name

        out = {k: v for k, v in self.__dict__.items() if k not in RUNTIME_ONLY and not k.startswith("_")}
        # a calibration file is recorded by its name: config.json gets published
        out["calibration"] = public_name(self.calibration) if isinstance(self.calibration, str) else None
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "quant_method")
        return f"LayerSwapConfig({fields})"


def _protect_clash(layers, protect, clash) -> str:
    return (f"LayerSwapConfig(layers={list(layers)}, protect={list(protect)}) is contradictory: block(s) {clash} "
            "would be removed and protected; drop them from layers or from protect")


class LayerSwapQuantizer(HfQuantizer):
    """Quantizer plugin that removes blocks after the weights load (strip mode)."""

    requires_calibration = False  # True would mean "only pre-quantized checkpoints load"

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args, **kwargs):
        return None

    def _process_model_before_weight_loading(self, model, **kwargs):
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        try:
            from .history import verify_history

            verify_history(model)  # a loaded config.layerswap record is checked before anything extends it
            if not self.pre_quantized:
                prune_loaded_model(model, cfg)
            else:  # a saved layerswap checkpoint: re-attach its ghosted operators, prune nothing
                from .recovery import attach_saved_recovery

                try:
                    attach_saved_recovery(model)
                except (FileNotFoundError, ValueError) as err:  # the weights loaded; say what is missing
                    logger.warning(
                        "%s. The model is loaded as the plainly pruned model, without the repair operators; attach "
                        "them with hf_layerswap.recovery.attach_saved_recovery(model, <checkpoint folder or Hub id>, "
                        "revision=...)", err,
                    )
        finally:
            self._strip(model)
        return model

    def _strip(self, model):
        self.remove_quantization_config(model)
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "_is_quantized", False):
                config._is_quantized = False

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    def _dequantize(self, model, dtype=None):
        return model


def _tokenizer_for(model, cfg: LayerSwapConfig):
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source:
        raise ValueError("LayerSwapConfig needs tokenizer= (the model has no name_or_path to load one from)")
    return AutoTokenizer.from_pretrained(source)


def prune_loaded_model(model, cfg: LayerSwapConfig):
    """Score, select and remove blocks of an already loaded model per ``cfg``.

    The same work ``from_pretrained(..., quantization_config=cfg)`` does, usable on a model
    loaded any other way. Returns the model (modified in place); the report, if scoring
    ran, is on ``model.layerswap_report``.
    """
    from .calibration import CalibrationSet, build_calibration
    from .plan import num_blocks
    from .scoring import score_layers
    from .selection import check_budget, select_layers
    from .surgery import remove_layers

    if cfg.layers is None and cfg.num_layers is not None:  # an impossible budget costs no scoring
        check_budget(cfg.num_layers, num_blocks(model), spacing=cfg.spacing, protect=cfg.protect)
    if cfg.layers is not None and getattr(cfg, "_protect_given", False):  # -1 and L-1 are one block
        total = num_blocks(model)
        clash = sorted({i % total for i in cfg.layers if -total <= i < total}
                       & {i % total for i in cfg.protect if -total <= i < total})
        if clash:
            raise ValueError(_protect_clash(cfg.layers, cfg.protect, clash))
    needs_text = cfg.layers is None or cfg.recovery is not None or cfg.sparsity is not None
    calib = None
    if needs_text:
        tokenizer = None
        if not isinstance(cfg.calibration, (Mapping, CalibrationSet)):  # text sources need one
            tokenizer = _tokenizer_for(model, cfg)
        calib = build_calibration(
            cfg.calibration, tokenizer, num_prompts=cfg.num_prompts, seq_len=cfg.seq_len, seed=cfg.seed
        )
    report = None
    provenance = {"protocol": cfg.protocol, "config": cfg.to_dict()}
    if cfg.layers is not None:
        layers = list(cfg.layers)
        provenance["selection"] = "explicit layers"
    else:
        one_protocol = cfg.strategy == "greedy" and cfg.protocol != "auto"
        protocols = (cfg.protocol,) if one_protocol else PROTOCOLS
        report = score_layers(
            model, calib, protocols=protocols, max_gap=min(cfg.max_gap, num_blocks(model) - 1),
            batch_size=cfg.batch_size, progress=cfg.progress, seed=cfg.seed,
        )
        model.layerswap_report = report
        if cfg.num_layers is None:  # score only; a requested sparsity still applies
            return _sparsify(model, cfg, calib)
        layers = select_layers(
            report, cfg.num_layers, protocol=cfg.protocol, spacing=cfg.spacing, protect=cfg.protect,
            model=model, calibration=calib, batch_size=cfg.batch_size, **_strategy_options(cfg),
        )
        provenance["strategy"] = cfg.strategy
        provenance["selection"] = _selection_text(cfg)
        provenance["scores"] = report.summary_dict()
        if report.selections and report.selections[-1].get("strategy") == "search":
            provenance["search"] = report.selections[-1]
        elif report.selections:
            provenance["auto"] = report.selections[-1]
    if calib is not None:
        provenance["calibration"] = calib.spec()
    if cfg.recovery is not None:
        from .recovery import recover

        model.layerswap_recovery_report = recover(model, layers, calib, method=cfg.recovery)
        _annotate_last_step(model, provenance)
    else:
        remove_layers(model, layers, provenance=provenance)
    return _sparsify(model, cfg, calib)


def _strategy_options(cfg: LayerSwapConfig) -> dict:
    """``select_layers`` keywords for the config's strategy."""
    if cfg.strategy == "search":
        objective = cfg.objective or ("ghosted" if cfg.recovery == "ghosted" else "removal_kl")
        out = {"strategy": "search", "objective": objective, "progress": cfg.progress}
        if cfg.max_evaluations is not None:
            out["max_evaluations"] = cfg.max_evaluations
        return out
    if cfg.strategy == "auto":
        return {"strategy": "auto"}
    return {"strategy": cfg.strategy, **({"objective": cfg.objective} if cfg.objective else {})}


def _selection_text(cfg: LayerSwapConfig) -> str:
    if cfg.strategy == "search":
        return (f"search over candidate sets ({_strategy_options(cfg)['objective']} on the calibration prompts), "
                f"spacing={cfg.spacing}, protect={cfg.protect}")
    if cfg.strategy in ("greedy", "auto"):
        return f"greedy min-over-partners, spacing={cfg.spacing}, protect={cfg.protect}"
    return f"{cfg.strategy}, protect={cfg.protect}"


def _sparsify(model, cfg: LayerSwapConfig, calib):
    if cfg.sparsity is not None:
        from .sparsity import sparsify

        sparsify(  # leaves its report on model.layerswap_sparsity_report
            model, calib, sparsity=cfg.sparsity, allocation=cfg.allocation, method=cfg.method,
            pattern=cfg.sparsity_pattern,
        )
    return model


def _annotate_last_step(model, provenance: dict):
    record = getattr(model.config, "layerswap", None)
    if record and record.get("steps"):
        for key, value in provenance.items():
            record["steps"][-1].setdefault(key, value)


def register() -> None:
    """Register the ``layerswap`` quantization method with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LayerSwapConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LayerSwapQuantizer)


register()
