"""Healing methods behind one registry: what :func:`~hf_layerswap.healing.heal` calls for
``method=``. Adding a method is one decorator on a :class:`HealMethod` subclass::

    @register_heal_method("mine", options=("depth",))  # the options it reads (None: any)
    class Mine(HealMethod):
        def prepare(self, model, options): ...   # returns the module to train
        def finish(self, trained): ...          # returns the plain transformers model

The built-ins: ``"lora"`` (PEFT LoRA on the attention and MLP projections, merged back;
needs ``peft``, the ``heal`` extra),
``"adjacent"`` (the blocks on each side of every cut, plus norms) and ``"last_k"`` (the
last ``k`` blocks, the final norm and the head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace

from torch import nn

from ..utils.extras import require
from ..layerplan import decoder_blocks

__all__ = ["HEAL_METHODS", "HealMethod", "cut_neighbours", "get_heal_method", "priced_heal_methods",
           "register_heal_method"]

#: ``{name: HealMethod subclass}``.
HEAL_METHODS: dict[str, type[HealMethod]] = {}

#: The projections LoRA adapts (Llama / Qwen / Gemma names).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def register_heal_method(name: str, options: tuple[str, ...] | None = None, describe: str | None = None,
                         learning_rates: tuple[float, ...] | None = None):
    """Class decorator: register a :class:`HealMethod` subclass as ``method=name``;
    ``options``: the names of the options it reads (any other is refused), ``None``: any;
    ``describe``: what it trains and how the result lands in the weights, in words (the
    model card's "Method" row; ``None`` keeps :attr:`HealMethod.describe`);
    ``learning_rates``: the candidate rates of the learning-rate probe
    (:mod:`~hf_layerswap.healing.choice`; ``None`` keeps :attr:`HealMethod.learning_rates`).

    Raises:
        ValueError: ``learning_rates`` empty or holding a value that is not a finite number > 0.
    """
    if learning_rates is not None:
        rates = tuple(learning_rates)
        if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                                for r in rates):
            raise ValueError(f"learning_rates={learning_rates!r}: must be a non-empty sequence of finite numbers > 0")

    def wrap(cls):
        cls.name = name
        cls.option_names = None if options is None else tuple(options)
        if describe is not None:
            cls.describe = describe
        if learning_rates is not None:
            cls.learning_rates = tuple(sorted(float(r) for r in learning_rates))
        HEAL_METHODS[name] = cls
        return cls

    return wrap


def get_heal_method(name: str) -> HealMethod:
    """An instance of the method registered as ``name``.

    Raises:
        ValueError: unknown ``name``; the message lists the registered methods.
    """
    if name not in HEAL_METHODS:
        raise ValueError(f"method={name!r}: unknown healing method; registered: {sorted(HEAL_METHODS)}")
    return HEAL_METHODS[name]()


class HealMethod:
    """One way to choose and train the student's weights."""

    name: str = ""
    #: The options the method reads (:func:`register_heal_method`); ``None``: any.
    option_names: tuple[str, ...] | None = None
    #: What the method trains, in words, for the model card (:func:`register_heal_method`).
    describe: str = "the method's own choice of weights, trained in place"
    #: Its trainable parameters are new tensors beside the weights (adapters, merged back by
    #: :meth:`finish`), held in addition to them; ``False``: it trains the model's own weights.
    adds_parameters: bool = False

    def trainable(self, shape, options: Mapping, removed: list[int], known: bool = True) -> tuple[int, int, int]:
        """What :meth:`prepare` will train, planned before the run for
        :func:`~hf_layerswap.cost.estimate_cost` (nothing is built).

        Args:
            shape: the model before the cut, as :class:`~hf_layerswap.cost.steps.ModelShape`
                reads it (``model``, ``blocks``, ``num_blocks``, ``block_params``, ``es``: bytes
                per weight element).
            options: the method's options (``HealConfig.options``).
            removed: the 0-based blocks the cut removes (original numbering).
            known: ``removed`` is the cut itself; ``False``: a worst case for the passes (the
                blocks are chosen at run time), and the method counts the most it could train.

        Returns:
            ``(parameters, tensors, bytes per element)`` of the trainable set on the pruned model.

        Raises:
            ValueError: the method plans no trainable set (this default: a registered method
                that does not override it cannot be priced), or an option value it cannot take.
        """
        raise ValueError(f"heal method={self.name!r} plans no trainable set (HealMethod.trainable), so "
                         f"estimate_cost cannot price it; it prices {sorted(priced_heal_methods())}")
    #: The learning-rate probe's candidates, ascending (:mod:`~hf_layerswap.healing.choice`):
    #: for a method that trains full weights, a factor of 10 around 1e-4, the usual range of
    #: full fine-tuning with AdamW (:func:`register_heal_method` sets a method's own).
    learning_rates: tuple[float, ...] = (3e-5, 1e-4, 3e-4)

    def check_options(self, options: Mapping, blocks: int | None = None) -> None:
        """Refuse an option the method does not read (it would be recorded as if used) and,
        in a subclass, a value it cannot take; ``blocks``: the pruned model's block count
        when known. Called by :func:`~hf_layerswap.healing.heal` before anything runs.

        Raises:
            ValueError: naming the option, its value and what is allowed.
        """
        unknown = [key for key in options if self.option_names is not None and key not in self.option_names]
        if unknown:
            allowed = f"its options are {', '.join(self.option_names)}" if self.option_names else "it takes none"
            raise ValueError(f"method={self.name!r} has no option {', '.join(map(repr, unknown))}: {allowed}")

    def prepare(self, model: nn.Module, options: dict) -> nn.Module:
        """Set ``requires_grad`` and return the module the trainer trains."""
        raise NotImplementedError

    def finish(self, trained: nn.Module) -> nn.Module:
        """The plain transformers model after training."""
        return trained

    def undo(self, trained: nn.Module) -> nn.Module:
        """The plain transformers model without what :meth:`prepare` added (training failed)."""
        return trained


def priced_heal_methods() -> list[str]:
    """The registered healing methods whose entry plans its trainable set
    (:meth:`HealMethod.trainable`), in registration order."""
    return [name for name, cls in HEAL_METHODS.items() if cls.trainable is not HealMethod.trainable]


def _norm_params(block: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``block``'s norms (modules whose class name says norm)."""
    return [p for m in block.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(recurse=False)]


def _train_only(model: nn.Module, modules: list[nn.Module]) -> nn.Module:
    for param in model.parameters():
        param.requires_grad_(False)
    for module in modules:
        for param in module.parameters():
            param.requires_grad_(True)
    return model


def _norms(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    return [m for block in blocks for name, m in block.named_modules() if "norm" in type(m).__name__.lower()]


def cut_neighbours(model: nn.Module) -> list[int]:
    """Current 0-based indices of the kept blocks next to a cut recorded in
    ``model.config.layerswap`` (``kept_layers`` in the original numbering).

    Raises:
        ValueError: the model records no removal.
    """
    record = getattr(model.config, "layerswap", None) or {}
    kept = record.get("kept_layers")
    original = record.get("original_num_hidden_layers")
    if not kept or not record.get("removed_layers") or original is None:
        raise ValueError("method='adjacent' needs a pruned model: model.config.layerswap records no removed blocks")
    edges = [-1, *kept, original]
    return sorted(
        {i for i in range(len(kept)) if edges[i + 1] - edges[i] > 1 or edges[i + 2] - edges[i + 1] > 1}
    )


@register_heal_method("lora", options=("lora_r", "lora_alpha"),
                      describe="LoRA adapters on every kept block's attention and MLP projections, merged back "
                               "into the weights",
                      learning_rates=(3e-4, 1e-3, 3e-3))  # adapters starting at zero take about 10x a full-weight rate
class LoRA(HealMethod):
    """PEFT LoRA (``lora_r``, default 16, and ``lora_alpha``, default ``2 * lora_r``,
    options) on every kept block's projections."""

    adds_parameters = True

    def trainable(self, shape, options, removed, known=True):
        """LoRA's A and B (fp32, rank ``lora_r``) on every kept block's projections."""
        rank = options.get("lora_r", 16)
        lins = [m for n, m in shape.blocks[0].named_modules()
                if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LORA_TARGETS]
        kept = shape.num_blocks - len(removed)
        return kept * sum(rank * (m.in_features + m.out_features) for m in lins), kept * 2 * len(lins), 4

    def check_options(self, options, blocks=None):
        super().check_options(options, blocks)
        require("peft", "healing with method='lora'")  # refused before any training
        rank = options.get("lora_r", 16)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lora_r={rank!r}: must be an int >= 1 (the LoRA rank)")
        alpha = options.get("lora_alpha", 2 * rank)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"lora_alpha={alpha!r}: must be a finite number > 0")

    def prepare(self, model, options):
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        targets = [t for t in LORA_TARGETS if t in names]
        if not targets:
            raise ValueError(f"method='lora' found none of {LORA_TARGETS} in the model's linear layers")
        rank = options.get("lora_r", 16)
        peft = require("peft", "healing with method='lora'")
        config = peft.LoraConfig(r=rank, lora_alpha=options.get("lora_alpha", 2 * rank), lora_dropout=0.0, target_modules=targets)
        return peft.get_peft_model(model, config)

    def finish(self, trained):
        return trained.merge_and_unload()

    def undo(self, trained):
        return trained.unload()


@register_heal_method("adjacent", options=(),
                      describe="the kept blocks on each side of every cut and every block's norms, trained in place")
class Adjacent(HealMethod):
    """The kept blocks on each side of every cut, plus the norms of every block."""

    def trainable(self, shape, options, removed, known=True):
        """The full weights of the blocks next to each cut (not ``known``: two neighbours per
        removed block, the most there can be) and the norms of the other kept blocks."""
        total = shape.num_blocks
        kept = total - len(removed)
        record = {"kept_layers": [i for i in range(total) if i not in removed], "removed_layers": removed,
                  "original_num_hidden_layers": total}
        chosen = (len(cut_neighbours(SimpleNamespace(config=SimpleNamespace(layerswap=record)))) if known
                  else min(2 * len(removed), kept))
        norms = _norm_params(shape.blocks[0])
        return (chosen * shape.block_params + (kept - chosen) * sum(p.numel() for p in norms),
                chosen * len(list(shape.blocks[0].parameters())) + (kept - chosen) * len(norms), shape.es)

    def prepare(self, model, options):
        _, _, blocks = decoder_blocks(model)
        chosen = [blocks[i] for i in cut_neighbours(model)]
        return _train_only(model, chosen + _norms(model, list(blocks)))


@register_heal_method("last_k", options=("k",),
                      describe="the last k blocks, the final norm and the output head, trained in place")
class LastK(HealMethod):
    """The last ``k`` blocks (option ``k``, default 3), the final norm and the head."""

    def check_options(self, options, blocks=None):
        super().check_options(options, blocks)
        k = options.get("k", 3)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= (k if blocks is None else blocks):
            raise ValueError(f"k={k!r}: must be an int " + (">= 1" if blocks is None else
                                                            f"in 1..{blocks} (the model's block count)"))

    def trainable(self, shape, options, removed, known=True):
        """The last ``k`` blocks' full weights, the final norm and the output head.

        Raises:
            ValueError: ``k`` outside 1..(kept blocks)."""
        kept = shape.num_blocks - len(removed)
        k = options.get("k", 3)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= kept:
            raise ValueError(f"heal option k={k!r}: must be an int in 1..{kept} (the pruned model's block count)")
        extra = [m for m in (shape.model.get_output_embeddings(), getattr(shape.model.get_decoder(), "norm", None))
                 if m is not None]
        extra_params = [p for m in extra for p in m.parameters()]
        return (k * shape.block_params + sum(p.numel() for p in extra_params),
                k * len(list(shape.blocks[0].parameters())) + len(extra_params), shape.es)

    def prepare(self, model, options):
        _, _, blocks = decoder_blocks(model)
        self.check_options(options, len(blocks))
        k = options.get("k", 3)
        head = model.get_output_embeddings()
        final_norm = getattr(model.get_decoder(), "norm", None)
        extra = [m for m in (head, final_norm) if m is not None]
        return _train_only(model, list(blocks[-k:]) + extra)
