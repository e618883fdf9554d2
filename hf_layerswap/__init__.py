"""hf_layerswap: protocol-aware layer redundancy (replacement and interchange swap-KL),
decoder-layer removal at ``from_pretrained`` time, and publishing with the evidence.

Data flow: calibration text -> token batches (:func:`build_calibration`) -> probes (layer
plans) -> KL statistics (:func:`score_layers`) -> :class:`SwapReport` ->
:func:`select_layers` -> :func:`remove_layers` -> checkpoint + card; :func:`prune` runs
the whole chain from a :class:`LayerSwapConfig` (the one path behind ``from_pretrained``,
``hf-layerswap prune`` and the demo).
"""

from .calibration import CalibrationSet, CalibrationShortfallWarning, build_calibration, embedded_text
from .card import render_card, write_card_files
from .evaluation import PerplexityResult, delta_ppl_percent, evaluate_perplexity, generation_check
from .gguf_export import GGUFLayoutError, export_gguf, save_gguf
from .hub import HubPushError, PushRefusedError, push_to_hub, save_for_hub
from .integration import LayerSwapConfig, LayerSwapQuantizer, prune_loaded_model
from .models import load_model
from .pipeline import PruneResult, prune
from .provenance import __version__
from .plan import apply_plan, capture_residual_stream, decoder_blocks, model_fingerprint, num_blocks
from .recovery import RecoveryReport, recover
from .report import PairResult, SwapReport
from .scoring import masked_kl, removal_kl, score_layers
from .search import search_select
from .selection import STRATEGIES, select_layers
from .sparsity import SparsityReport, sparsify
from .surgery import check_surgery_invariants, remove_layers
from .tasks import TaskResults, evaluate_tasks

__all__ = [
    "__version__",
    "CalibrationSet",
    "CalibrationShortfallWarning",
    "GGUFLayoutError",
    "HubPushError",
    "PerplexityResult",
    "PushRefusedError",
    "RecoveryReport",
    "SparsityReport",
    "delta_ppl_percent",
    "evaluate_perplexity",
    "evaluate_tasks",
    "export_gguf",
    "generation_check",
    "load_model",
    "model_fingerprint",
    "push_to_hub",
    "recover",
    "render_card",
    "save_for_hub",
    "save_gguf",
    "write_card_files",
    "LayerSwapConfig",
    "LayerSwapQuantizer",
    "PairResult",
    "PruneResult",
    "STRATEGIES",
    "SwapReport",
    "TaskResults",
    "search_select",
    "apply_plan",
    "build_calibration",
    "capture_residual_stream",
    "check_surgery_invariants",
    "decoder_blocks",
    "embedded_text",
    "masked_kl",
    "num_blocks",
    "prune",
    "prune_loaded_model",
    "remove_layers",
    "removal_kl",
    "score_layers",
    "select_layers",
    "sparsify",
]
