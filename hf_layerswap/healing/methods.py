"""Healing methods behind one registry: what :func:`~hf_layerswap.healing.heal` calls for
``method=``. Adding a method is one decorator on a :class:`HealMethod` subclass, with its
typed options (:class:`~hf_layerswap.utils.registry.Options`)::

    @dataclass(frozen=True)
    class MineOptions(Options):
        depth: int = option(2, help="blocks trained", ge=1)

    @register_heal_method("mine", options=MineOptions)
    class Mine(HealMethod):
        def prepare(self, model, options): ...   # returns the module to train
        def finish(self, trained): ...          # returns the plain transformers model

The built-ins: ``"lora"`` (PEFT LoRA on the attention and MLP projections, merged back;
needs ``peft``, the ``heal`` extra; :class:`LoraOptions`),
``"adjacent"`` (the blocks on each side of every cut, plus norms) and ``"last_k"`` (the
last ``k`` blocks, the final norm and the head; :class:`LastKOptions`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn

from ..utils.extras import require
from ..layerplan import decoder_blocks
from ..utils.registry import Options, Registry, RegistryEntry, option, untyped_options

__all__ = ["HEAL_METHODS", "HealMethod", "LastKOptions", "LoraOptions", "cut_neighbours", "get_heal_method",
           "priced_heal_methods", "register_heal_method"]

#: ``{name: HealMethod subclass}`` (a :class:`~hf_layerswap.utils.registry.Registry`).
HEAL_METHODS: Registry[type[HealMethod]] = Registry("healing method", "method", sort_names=True)

#: The projections LoRA adapts (Llama / Qwen / Gemma names).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class LoraOptions(Options):
    """The options of ``method="lora"``."""

    lora_r: int = option(16, help="the LoRA rank of every adapter", ge=1, what="the LoRA rank")
    lora_alpha: float | None = option(None, help="the LoRA scaling numerator (default: 2 * lora_r)", gt=0)

    @property
    def alpha(self) -> float:
        """``lora_alpha``, or ``2 * lora_r`` when not given."""
        return 2 * self.lora_r if self.lora_alpha is None else self.lora_alpha


@dataclass(frozen=True)
class LastKOptions(Options):
    """The options of ``method="last_k"``."""

    k: int = option(3, help="the last k blocks are trained (with the final norm and the head)", ge=1)


def register_heal_method(name: str, options: type[Options] | tuple[str, ...] | None = None,
                         describe: str | None = None, learning_rates: tuple[float, ...] | None = None,
                         help: str | None = None):
    """Class decorator: register a :class:`HealMethod` subclass as ``method=name``;
    ``options``: its :class:`~hf_layerswap.utils.registry.Options` dataclass (typed, with help and
    bounds), or the names of the options it reads (any value), ``()``: none (any other option
    is refused), ``None``: the class's own :attr:`HealMethod.option_class`, or any option when
    it has none; ``describe``: what it trains and how the result lands in the weights, in
    words (the model card's "Method" row; ``None`` keeps :attr:`HealMethod.describe`);
    ``help``: one line for the command line and the docs (default: ``describe``);
    ``learning_rates``: the candidate rates of the learning-rate probe
    (:mod:`~hf_layerswap.healing.choice`; ``None`` keeps :attr:`HealMethod.learning_rates`).

    Raises:
        ValueError: ``learning_rates`` empty or holding a value that is not a finite number > 0;
            ``name`` empty or already registered.
    """
    if learning_rates is not None:
        rates = tuple(learning_rates)
        if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                                for r in rates):
            raise ValueError(f"learning_rates={learning_rates!r}: must be a non-empty sequence of finite numbers > 0")

    def wrap(cls):
        cls.name = name
        if isinstance(options, type) and issubclass(options, Options):
            cls.option_class = options
        elif options is not None:
            names = tuple(options)
            if cls.option_class.names() != names:
                cls.option_class = untyped_options(f"{cls.__name__}Options", names)
        if options is not None:
            cls.option_names = cls.option_class.names()
        if describe is not None:
            cls.describe = describe
        cls.help = help or (describe if describe is not None else cls.help or cls.describe)
        if learning_rates is not None:
            cls.learning_rates = tuple(sorted(float(r) for r in learning_rates))
        HEAL_METHODS.add(name, cls)
        return cls

    return wrap


def get_heal_method(name: str) -> HealMethod:
    """An instance of the method registered as ``name``.

    Raises:
        ValueError: unknown ``name``; the message lists the registered methods and the closest.
    """
    return HEAL_METHODS.lookup(name)()


class HealMethod(RegistryEntry):
    """One way to choose and train the student's weights (a
    :class:`~hf_layerswap.utils.registry.RegistryEntry`: :attr:`option_class` its typed options,
    :meth:`estimate` its trainable set for :func:`~hf_layerswap.cost.estimate_cost`)."""

    name: str = ""
    help: str = ""
    #: The names of the options the method reads (its :attr:`option_class`'s fields,
    #: :func:`register_heal_method`); ``None``: any.
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

    def estimate(self, shape, options: Mapping, removed: list[int], known: bool = True) -> tuple[int, int, int]:
        """The entry's estimate: :meth:`trainable` (what :func:`~hf_layerswap.cost.estimate_cost` prices)."""
        return self.trainable(shape, options, removed, known)

    def options_of(self, options: Mapping | Options | None) -> Options:
        """``options`` (a dict, as ``HealConfig.options`` holds them) as the method's
        :attr:`option_class`.

        Raises:
            ValueError: an option the method does not read (naming the allowed ones and the
                closest), or a value of the wrong type or out of bounds (naming the field).
        """
        return self.parse_options(options, owner=f"method={self.name!r}")

    def check_options(self, options: Mapping, blocks: int | None = None) -> None:
        """Refuse an option the method does not read (it would be recorded as if used) and a
        value its :attr:`option_class` does not allow; in a subclass, a value it cannot take
        on this model; ``blocks``: the pruned model's block count when known. Called by
        :func:`~hf_layerswap.healing.heal` before anything runs.

        Raises:
            ValueError: naming the option, its value and what is allowed.
        """
        if self.option_names is not None:
            self.options_of(options)

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


@register_heal_method("lora", options=LoraOptions,
                      describe="LoRA adapters on every kept block's attention and MLP projections, merged back "
                               "into the weights",
                      learning_rates=(3e-4, 1e-3, 3e-3))  # adapters starting at zero take about 10x a full-weight rate
class LoRA(HealMethod):
    """PEFT LoRA (``lora_r``, default 16, and ``lora_alpha``, default ``2 * lora_r``,
    options) on every kept block's projections."""

    adds_parameters = True

    def trainable(self, shape, options, removed, known=True):
        """LoRA's A and B (fp32, rank ``lora_r``) on every kept block's projections."""
        rank = self.options_of(options).lora_r
        lins = [m for n, m in shape.blocks[0].named_modules()
                if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LORA_TARGETS]
        kept = shape.num_blocks - len(removed)
        return kept * sum(rank * (m.in_features + m.out_features) for m in lins), kept * 2 * len(lins), 4

    def check_options(self, options, blocks=None):
        super().check_options(options, blocks)
        require("peft", "healing with method='lora'")  # refused before any training

    def prepare(self, model, options):
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        targets = [t for t in LORA_TARGETS if t in names]
        if not targets:
            raise ValueError(f"method='lora' found none of {LORA_TARGETS} in the model's linear layers")
        opts = self.options_of(options)
        peft = require("peft", "healing with method='lora'")
        config = peft.LoraConfig(r=opts.lora_r, lora_alpha=opts.alpha, lora_dropout=0.0, target_modules=targets)
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


@register_heal_method("last_k", options=LastKOptions,
                      describe="the last k blocks, the final norm and the output head, trained in place")
class LastK(HealMethod):
    """The last ``k`` blocks (option ``k``, default 3), the final norm and the head."""

    def check_options(self, options, blocks=None):
        k = options.get("k", 3) if isinstance(options, Mapping) else getattr(options, "k", 3)
        if blocks is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= blocks):
            raise ValueError(f"k={k!r}: must be an int in 1..{blocks} (the model's block count)")
        super().check_options(options, blocks)

    def trainable(self, shape, options, removed, known=True):
        """The last ``k`` blocks' full weights, the final norm and the output head.

        Raises:
            ValueError: ``k`` outside 1..(kept blocks)."""
        kept = shape.num_blocks - len(removed)
        k = options.get("k", 3) if isinstance(options, Mapping) else getattr(options, "k", 3)
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
        k = self.options_of(options).k
        head = model.get_output_embeddings()
        final_norm = getattr(model.get_decoder(), "norm", None)
        extra = [m for m in (head, final_norm) if m is not None]
        return _train_only(model, list(blocks[-k:]) + extra)
