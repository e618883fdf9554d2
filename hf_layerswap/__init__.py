"""hf_layerswap: protocol-aware layer redundancy (replacement and interchange swap-KL),
decoder-layer removal at ``from_pretrained`` time, and publishing with the evidence.

Data flow: calibration text -> token batches (:func:`build_calibration`) -> probes (layer
plans) -> KL statistics (:func:`score_layers`) -> :class:`SwapReport` ->
:func:`select_layers` -> :func:`remove_layers` -> checkpoint + card; :func:`prune` runs
the whole chain from a :class:`LayerSwapConfig` (the one path behind ``from_pretrained``,
``hf-layerswap prune`` and the demo).

``__all__`` is the user API (what README.md and docs/python.md show). Importing the
package registers the ``quant_method="layerswap"`` quantizer plugin with transformers
(:mod:`hf_layerswap.integration`). Everything else is imported from the module that owns
it (docs/architecture.md); the internals this namespace used to export
(``hf_layerswap.apply_plan``, ...) still resolve here, with a ``DeprecationWarning`` that
names the owning module (PEP 562 ``__getattr__``).
"""

import sys as _sys
import warnings as _warnings

# integration registers the quantizer plugin; the others own the moved names (below), and
# search is the old path of the search (hf_layerswap.search.search_select)
from . import calibration, card, integration, plan, report, scoring, search, surgery  # noqa: F401
from .baselines import compare_criteria
from .calibration import CalibrationSet, CalibrationShortfallWarning, build_calibration
from .config import LayerSwapConfig, RecoveryConfig, SparsityConfig
from .evaluation import PerplexityResult, delta_ppl_percent, evaluate_perplexity, generation_check
from .gguf_export import GGUFLayoutError, export_gguf, save_gguf
from .hub import HubPushError, PushRefusedError, push_to_hub, save_for_hub
from .integration import prune_loaded_model
from .models import load_model
from .pipeline import PruneResult, prune
from .provenance import __version__
from .recovery import RecoveryReport, recover
from .report import SwapReport
from .scoring import score_layers
from .selection import STRATEGIES, NonFiniteScoresError, NonFiniteScoresWarning, search_select, select_layers
from .sparsity import SparsityReport, sparsify
from .surgery import remove_layers
from .tasks import TaskResults, evaluate_tasks

__all__ = [
    "__version__",
    # describe and run a cut
    "LayerSwapConfig",
    "RecoveryConfig",
    "SparsityConfig",
    "prune",
    "PruneResult",
    "prune_loaded_model",
    "load_model",
    # step by step
    "build_calibration",
    "CalibrationSet",
    "CalibrationShortfallWarning",
    "score_layers",
    "SwapReport",
    "select_layers",
    "search_select",
    "STRATEGIES",
    "NonFiniteScoresError",
    "NonFiniteScoresWarning",
    "remove_layers",
    "recover",
    "RecoveryReport",
    "sparsify",
    "SparsityReport",
    # measure
    "evaluate_perplexity",
    "PerplexityResult",
    "delta_ppl_percent",
    "generation_check",
    "evaluate_tasks",
    "TaskResults",
    "compare_criteria",
    # publish
    "save_for_hub",
    "push_to_hub",
    "PushRefusedError",
    "HubPushError",
    "save_gguf",
    "export_gguf",
    "GGUFLayoutError",
]

#: Names this namespace exported before it was the user API -> the module that owns each.
#: ``hf_layerswap.<name>`` keeps returning the owner's object, with a DeprecationWarning.
_MOVED = {
    "LayerSwapQuantizer": integration,
    "PairResult": report,
    "apply_plan": plan,
    "capture_residual_stream": plan,
    "check_surgery_invariants": surgery,
    "decoder_blocks": plan,
    "embedded_text": calibration,
    "masked_kl": scoring,
    "model_fingerprint": plan,
    "num_blocks": plan,
    "removal_kl": scoring,
    "render_card": card,
    "write_card_files": card,
}


def __getattr__(name: str):
    owner = _MOVED.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # ``from hf_layerswap import name`` looks the name up twice: the import system's check
    # whether it is a submodule (``_handle_fromlist``), then the import itself, which warns
    if _sys._getframe(1).f_code.co_name != "_handle_fromlist":
        _warnings.warn(
            f"hf_layerswap.{name} is deprecated (the top-level namespace is the user API, hf_layerswap.__all__): "
            f"use {owner.__name__}.{name} (from {owner.__name__} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
    return getattr(owner, name)
