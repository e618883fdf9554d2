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

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from .config import QUANT_METHOD, LayerSwapConfig
from .history import verify_history
from .pipeline import prune
from .recovery import attach_saved_recovery

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
            if not self.pre_quantized:
                prune(model, cfg)
            else:  # a saved layerswap checkpoint: re-attach its ghosted operators, prune nothing
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


def prune_loaded_model(model, cfg: LayerSwapConfig):
    """Score, select and remove blocks of an already loaded model per ``cfg``.

    The same work ``from_pretrained(..., quantization_config=cfg)`` does, usable on a model
    loaded any other way (:func:`hf_layerswap.pipeline.prune`, which also returns the
    reports). Returns the model (modified in place); the report, if scoring ran, is on
    ``model.layerswap_report``.
    """
    return prune(model, cfg).model


def register() -> None:
    """Register the ``layerswap`` quantization method with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LayerSwapConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LayerSwapQuantizer)


register()
