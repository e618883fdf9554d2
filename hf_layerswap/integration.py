"""Layer removal inside ``from_pretrained`` through transformers' quantizer plugin API.

``import hf_layerswap`` registers ``quant_method="layerswap"`` with
``register_quantization_config`` / ``register_quantizer``. Then::

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=LayerSwapConfig(num_to_remove=2, protocol="interchange")
    )

scores the loaded model (unless ``layers`` is given), selects and removes blocks after the
weights load. The quantizer then detaches itself ("strip mode"): the model is a plain
transformers model, ``save_pretrained`` writes no ``quantization_config``, and the saved
checkpoint reloads in plain transformers without this library. Provenance lives in
``model.config.layerswap``; the swap report is on ``model.layerswap_report``.

A checkpoint saved with Ghosted Layers recovery carries a ``quant_method="layerswap"``
marker instead: loading it with ``hf_layerswap`` imported prunes nothing and re-attaches its
operators (:func:`hf_layerswap.surgery.attach_saved_recovery`); when their file cannot be
found there, a warning says so and the plainly pruned model loads.

Passing a ``LayerSwapConfig`` when loading such a checkpoint applies it on top: the
operators are re-attached first, then the config runs on the repaired model as on any
other (scoring, removal recorded as a new step of ``config.layerswap``; the operators move
with the cut, :func:`~hf_layerswap.surgery.remove_layers`). transformers' own
``AutoHfQuantizer.merge_quantization_configs`` would keep the checkpoint's marker and drop
the argument (it merges arguments only for a fixed list of built-in config classes, and has
no hook for others), so :func:`register` wraps it for exactly this pair, a ``LayerSwapConfig``
argument over a ``layerswap`` marker, and leaves every other pair to transformers.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, AutoHfQuantizer

from .config import QUANT_METHOD, LayerSwapConfig
from .surgery.history import verify_history
from .pipeline import prune
from .surgery.operators import attach_saved_recovery

__all__ = [
    "LayerSwapQuantizer",
    "prune_loaded_model",
]

logger = logging.getLogger(__name__)


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
            verify_history(model)  # a loaded config.layerswap record is checked before anything extends it
            if self.pre_quantized:  # a saved layerswap checkpoint: re-attach its saved repair modules
                try:
                    attach_saved_recovery(model)
                except (FileNotFoundError, ValueError) as err:  # the weights loaded; say what is missing
                    if getattr(cfg, _OVER_SAVED, False):
                        raise ValueError(
                            f"{err}. The LayerSwapConfig passed to from_pretrained was not applied: without the "
                            "operators the repaired model it would prune cannot be rebuilt"
                        ) from None
                    logger.warning(
                        "%s. The model is loaded as the plainly pruned model, without the repair operators; attach "
                        "them with hf_layerswap.surgery.attach_saved_recovery(model, <checkpoint folder or Hub id>, "
                        "revision=...)", err,
                    )
            if not self.pre_quantized or getattr(cfg, _OVER_SAVED, False):
                prune(model, cfg)
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

    @property
    def is_qat_trainable(self) -> bool:
        """``True``: the weights are plain, so transformers' ``Trainer`` may train the whole
        model (healing runs inside ``from_pretrained``, before the quantizer detaches)."""
        return True

    def _dequantize(self, model, dtype=None):
        return model


def prune_loaded_model(model, cfg: LayerSwapConfig):
    """Score, select and remove blocks of an already loaded model per ``cfg``.

    The same work ``from_pretrained(..., quantization_config=cfg)`` does, usable on a model
    loaded any other way (:func:`hf_layerswap.pipeline.prune`, which also returns the
    reports). Returns the model (modified in place); the report, if scoring ran, is on
    ``model.layerswap_report``.
    """
    return prune(model, cfg).model


#: Attribute set on the copy of a user's config that is applied on top of a saved checkpoint.
_OVER_SAVED = "_over_saved_checkpoint"


def _merge_quantization_configs(transformers_merge):
    """transformers' ``merge_quantization_configs`` (the checkpoint's config wins), except for
    a ``LayerSwapConfig`` argument over a checkpoint's ``layerswap`` marker: then a copy of the
    argument, flagged so that the quantizer re-attaches the saved operators before applying it."""

    def merge(cls, quantization_config, quantization_config_from_args):
        saved = quantization_config.to_dict() if isinstance(quantization_config, LayerSwapConfig) else quantization_config
        if (
            isinstance(quantization_config_from_args, LayerSwapConfig)
            and isinstance(saved, Mapping)
            and saved.get("quant_method") == QUANT_METHOD
        ):
            merged = copy.copy(quantization_config_from_args)
            setattr(merged, _OVER_SAVED, True)
            logger.info("applying the LayerSwapConfig passed to from_pretrained on top of the checkpoint's own")
            return merged
        return transformers_merge(quantization_config, quantization_config_from_args)

    merge.wraps_transformers = True
    return classmethod(merge)


def register() -> None:
    """Register the ``layerswap`` quantization method with transformers (idempotent), and
    let a ``LayerSwapConfig`` passed to ``from_pretrained`` apply on top of a checkpoint that
    carries a ``layerswap`` marker (see the module docstring)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LayerSwapConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LayerSwapQuantizer)
    if not getattr(AutoHfQuantizer.merge_quantization_configs, "wraps_transformers", False):
        AutoHfQuantizer.merge_quantization_configs = _merge_quantization_configs(  # type: ignore[method-assign]  # wrapped on purpose
            AutoHfQuantizer.merge_quantization_configs
        )


register()
