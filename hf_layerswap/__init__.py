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
it (docs/architecture.md).
"""

# integration registers the quantizer plugin with transformers
from . import integration  # noqa: F401
from .comparison import compare_criteria
from .calibration import CalibrationSet, CalibrationShortfallWarning, build_calibration
from .config import HealConfig, LayerSwapConfig, RecoveryConfig, SparsityConfig
from .cost import CostEstimate, estimate_cost
from .evaluation import PerplexityResult, delta_ppl_percent, evaluate_perplexity, generation_check
from .gguf_export import GGUFLayoutError, export_gguf, save_gguf
from .healing import HealReport, heal
from .hub import HubPushError, PushRefusedError, push_to_hub, save_for_hub
from .integration import prune_loaded_model
from .models import load_model
from .pipeline import PruneResult, prune
from .utils.provenance import __version__
from .recovery import RecoveryReport, recover
from .scoring.report import SwapReport
from .scoring import score_layers
from .scoring.rule import NonFiniteScoresError, NonFiniteScoresWarning
from .selection import STRATEGIES, search_select, select_layers
from .sparsity import SparsityReport, sparsify
from .surgery import remove_layers
from .evaluation.tasks import TaskResults, evaluate_tasks

__all__ = [
    "__version__",
    # describe and run a cut
    "LayerSwapConfig",
    "RecoveryConfig",
    "SparsityConfig",
    "HealConfig",
    "prune",
    "PruneResult",
    "prune_loaded_model",
    "load_model",
    "estimate_cost",
    "CostEstimate",
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
    "heal",
    "HealReport",
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
