"""The registry of selection strategies: one name, one function, one module.

A strategy is ``fn(report, num_to_remove, **context) -> list[int]`` (0-based blocks,
ascending); :func:`register_strategy` adds one, :func:`get_strategy` looks one up.
Adding a method = one new module + one ``@register_strategy("name")``.

The entry (:class:`Strategy`, :func:`strategy_entry`) carries everything that differs
between strategies, so that the pipeline, the provenance record and the model card read
it instead of naming a strategy: the protocols it scores and reads, its spacing default,
the config fields it takes, the rule in words, and how its decision record (the dict it
appends to ``SwapReport.selections``) reads in the card.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ..scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS
from ..utils.registry import NoOptions, Options, Registry, RegistryEntry

__all__ = ["MODEL_STRATEGIES", "STRATEGIES", "STRATEGY_ENTRIES", "STRATEGY_OPTIONS", "Criterion", "Strategy", "check_options",
           "get_strategy", "keyword_options", "register_strategy", "strategies_taking", "strategy_entry"]


def _paper_and(protocol) -> tuple[str, ...]:
    """The paper's two protocols (the card shows both), and ``protocol`` when it is another registered one."""
    extra = (protocol,) if protocol in SWAP_PROTOCOLS and protocol not in PROTOCOLS else ()
    return PROTOCOLS + extra


def _no_scores(protocol) -> tuple[str, ...]:
    """``scores`` of a strategy that reads no swap-KL score (``guided_by=NO_PROTOCOL``): none."""
    return ()


def _objective_only(cfg) -> dict:
    return {"objective": cfg.objective} if getattr(cfg, "objective", None) else {}


def _named_rule(name: str):
    return lambda cfg: f"{name}, protect={cfg.protect}"


def _no_values(decision: Mapping) -> list:
    return []


@dataclass(frozen=True)
class Criterion:
    """How a strategy runs in the comparison harness (:func:`hf_layerswap.comparison.compare_criteria`).

    Attributes:
        run: ``fn(model, calibration, budgets, **options) -> {n: CriterionResult}`` (or one
            result for one budget).
        reads: the protocols whose swap-KL report it is given (``report=``); none: no report.
        resumes: an iterative criterion that continues from its result at a smaller budget
            (``resume=``) instead of restarting.
        batched: it takes ``batch_size`` (it reads the model on the calibration prompts).
    """

    run: Callable
    reads: tuple[str, ...] = ()
    resumes: bool = False
    batched: bool = True


def NO_PROTOCOL(decision, protocol) -> None:
    """``guided_by`` of a strategy that reads no swap-KL protocol (its own criterion on the
    model, e.g. angular distance or SLEB): no protocol guided its removal, whatever the
    config's ``protocol`` says."""
    return None


@dataclass(frozen=True)
class Strategy(RegistryEntry):
    """What one registered strategy is and how it is read back (a
    :class:`~hf_layerswap.utils.registry.RegistryEntry`; its :attr:`estimate` is :attr:`cost`).

    Attributes:
        name: the ``strategy=`` value.
        fn: ``fn(report, num_to_remove, **context) -> list[int]``.
        help: what it does, in one line (default: the first line of ``fn``'s docstring).
        option_class: the typed options among :attr:`options` (numbers and flags, with help
            and bounds; ``select_layers`` checks them before it runs); an option of
            :attr:`options` outside it (a callback, an object to reuse) passes as given.
        needs_model: it reads the model on the calibration prompts (``select_layers``
            refuses it without ``model=``).
        reads_calibration: the pipeline builds calibration prompts for it (default:
            ``needs_model``).
        spacing: its default ``spacing`` (minimum distance between removed blocks minus 1).
        scores: ``fn(protocol) -> protocols`` the pipeline scores before selecting
            (default: the paper's two, plus ``protocol`` when it is another registered one;
            none for a strategy registered with ``guided_by=NO_PROTOCOL``, which reads no
            swap-KL score: the prune then runs no swap-KL pass for it unless the config's
            ``score_protocols`` asks for the tables).
        reads: ``fn(protocol) -> protocols`` a given report must carry (default: none).
        resolve: ``fn(protocol) -> strategy name`` actually run for the config's
            ``protocol`` (default: this one).
        config_options: ``fn(config) -> dict`` of ``select_layers`` keywords taken from a
            :class:`~hf_layerswap.LayerSwapConfig` (default: its ``objective`` when set).
        describe: ``fn(config) -> str``: the rule in words, the removal step's ``selection``.
        provenance: ``fn(record) -> dict | None``: what of the decision record (the dict
            the strategy appended to ``SwapReport.selections``) the removal step keeps
            (:class:`~hf_layerswap.scoring.report.PruneProvenance` ``decision``; default: all of it).
        guided_by: ``fn(decision, protocol) -> str | None``: the protocol that guided the
            removal, for the card (``None``: no single one; default: ``protocol``).
        values: ``fn(decision) -> [(what, value)]``: the recorded values the chosen set
            rests on (a non-finite one refuses publishing); default none.
        ranks_by_scores: the set is the greedy rule on the guiding protocol's layer scores
            (a non-finite recorded score of a removed layer then refuses publishing).
        card_summary: phrase ending the card's first sentence when no protocol guided it.
        card_rule: ``fn(spacing, protect) -> str | None``: the card's rule line.
        card_reason: ``fn(record, kl, indices) -> str | None``: why the set was chosen
            (``record`` a :class:`~hf_layerswap.scoring.report.PruneProvenance`; ``kl`` and
            ``indices`` the card's formatters).
        card_candidates: ``fn(decision, report, removed, kl, indices) -> (rows, reason) |
            None``: the card's candidate rows (``{"protocol", "layers", "removal_kl"}``)
            and reason, when the decision carries them.
        takes_objective: it minimises a set objective, ``objective=`` (``removal_kl``,
            ``nll``, ...); a config that names an objective for a strategy without one is
            refused (:class:`~hf_layerswap.LayerSwapConfig`).
        check_config: ``fn(config, num_blocks) -> None``: refuses, before any forward pass,
            a :class:`~hf_layerswap.LayerSwapConfig` the strategy would refuse only after
            the scoring (raises ``ValueError``; default: nothing to check).
        criteria: ``{display name: Criterion}``: how it runs in the comparison harness, under
            the names the benchmark pages show (one strategy may run as several criteria, e.g.
            the paper's rule once per protocol).
        cost: ``fn(plan) -> dict``: the passes of the selection alone (after the scoring the
            pipeline runs for it), planned before the run from the model's shape and the
            calibration prompts; ``plan`` a :class:`~hf_layerswap.cost.SelectionPlan`; the
            dict has ``block_passes``, ``head_passes``, ``head_rows``, ``block_tokens``,
            ``exact`` (False: an upper bound) and ``note`` (how it was counted), as
            :meth:`~hf_layerswap.cost.SelectionPlan.counts` builds them.
            :func:`~hf_layerswap.cost.estimate_cost` (and ``hf-layerswap prune --dry-run``)
            refuses a strategy without one (default ``None``).
        keeps_reference: it keeps each batch's dense reference across its evaluator calls
            under the prune's working-memory budget (:attr:`~hf_layerswap.cost.SelectionPlan.memory_budget`,
            :class:`~hf_layerswap.scoring.reference.ReferenceCache`): the cost estimate counts
            those bytes in the selection's peak memory (default ``False``).
    """

    name: str
    fn: Callable
    needs_model: bool = False
    reads_calibration: bool | None = None
    spacing: int = 0
    scores: Callable[[str], tuple[str, ...]] = _paper_and
    reads: Callable[[str], tuple[str, ...]] = lambda protocol: ()
    resolve: Callable[[str], str] | None = None
    config_options: Callable = _objective_only
    describe: Callable | None = None
    provenance: Callable[[Mapping], dict | None] = lambda decision: dict(decision)
    guided_by: Callable = lambda decision, protocol: protocol
    values: Callable[[Mapping], list] = _no_values
    ranks_by_scores: bool = False
    card_summary: str | None = None
    card_rule: Callable | None = None
    card_reason: Callable | None = None
    card_candidates: Callable | None = None
    options: tuple[str, ...] | None = field(default=None)
    takes_objective: bool = False
    check_config: Callable = lambda config, num_blocks: None
    criteria: Mapping[str, Criterion] = field(default_factory=dict)
    cost: Callable | None = None
    keeps_reference: bool = False
    help: str = ""
    option_class: type[Options] = NoOptions
    #: Each plan's counts say whether they are exact (``SelectionPlan.counts(exact=...)``).
    estimate_exact = None

    @property
    def estimate(self) -> Callable | None:  # type: ignore[override]
        """The entry's estimate: :attr:`cost` (``fn(plan) -> dict`` with ``exact``)."""
        return self.cost

    def check_option_values(self, options: Mapping) -> None:
        """Refuse a value of a typed option (:attr:`option_class`) of the wrong type or out
        of bounds.

        Raises:
            ValueError: naming the option, its value and what is allowed.
        """
        typed = self.option_class.names()
        self.option_class.from_mapping({k: v for k, v in options.items() if k in typed},
                                       owner=f"strategy={self.name!r}")

    def strategy_for(self, protocol) -> str:
        """The strategy that runs for ``protocol`` (:attr:`resolve`)."""
        return self.name if self.resolve is None else self.resolve(protocol)

    def rule_text(self, cfg) -> str:
        """The rule in words for a config (:attr:`describe`)."""
        return (self.describe or _named_rule(self.name))(cfg)

    def calibrated(self) -> bool:
        """Whether the pipeline builds calibration prompts for it."""
        return self.needs_model if self.reads_calibration is None else self.reads_calibration


#: Selection strategy name -> function ``(report, n, **context) -> list[int]``; see
#: :func:`register_strategy`. Each built-in strategy is a module of this package.
STRATEGIES: dict[str, Callable] = {}
#: Strategies that read the model and calibration prompts (not only the report).
MODEL_STRATEGIES: set[str] = set()
#: Strategy name -> its :class:`Strategy` entry (see :func:`strategy_entry`; a
#: :class:`~hf_layerswap.utils.registry.Registry`).
STRATEGY_ENTRIES: Registry[Strategy] = Registry("selection strategy", "strategy", sort_names=True)
#: Strategy name -> the option names it accepts (``select_layers(..., **options)``), or
#: ``None`` where the strategy did not declare them (its options are passed as given).
STRATEGY_OPTIONS: dict[str, tuple[str, ...] | None] = {}


def register_strategy(name: str, *, needs_model: bool = False, options: Collection[str] | None = None, **entry):
    """Decorator: register ``fn(report, num_to_remove, **context) -> list[int]`` as a selection
    strategy. ``entry``: the other fields of its :class:`Strategy` (``spacing``,
    ``scores``, ``reads``, ``describe``, ``provenance``, the ``card_*`` hooks, ...). ``context`` holds ``protocol``, ``spacing``, ``protect``, ``model``,
    ``calibration`` (a :class:`~hf_layerswap.calibration.CalibrationSet` when
    ``needs_model``), ``batch_size``, ``objective`` and ``options`` (a dict).
    ``options``: the option names the strategy accepts (``()``: none; default: the
    function's ``options`` attribute if it has one, else its ``option_class``'s fields);
    ``select_layers`` refuses any other before it runs. ``None``: not declared, passed as
    given. ``entry["option_class"]``: the typed ones (:class:`~hf_layerswap.utils.registry.Options`);
    ``entry["help"]``: one line (default: the first line of ``fn``'s docstring).

    Raises:
        ValueError: the name is already registered.
        TypeError: an ``entry`` keyword that is not a :class:`Strategy` field.
    """
    unknown = sorted(set(entry) - set(Strategy.__dataclass_fields__) - {"name", "fn", "needs_model", "options"})
    if unknown:
        raise TypeError(f"register_strategy({name!r}): unknown entry field(s) {unknown}; allowed "
                        f"{sorted(set(Strategy.__dataclass_fields__) - {'name', 'fn', 'needs_model', 'options'})}")

    def wrap(fn):
        if name in STRATEGIES:
            raise ValueError(f"selection strategy {name!r} is already registered")
        declared = getattr(fn, "options", None) if options is None else options
        if declared is None and "option_class" in entry:
            declared = entry["option_class"].names()
        fields = dict(entry)
        fields.setdefault("help", (fn.__doc__ or name).strip().split("\n")[0])
        if fields.get("guided_by") is NO_PROTOCOL:  # it reads no swap-KL score: none scored for it by default
            fields.setdefault("scores", _no_scores)
        made = Strategy(name, fn, needs_model=needs_model, options=None if declared is None else tuple(sorted(declared)),
                        **fields)
        STRATEGY_ENTRIES.pop(name, None)  # the entry of a strategy taken out of STRATEGIES since
        STRATEGY_ENTRIES.add(name, made)
        STRATEGIES[name] = fn
        STRATEGY_OPTIONS[name] = made.options
        if needs_model:
            MODEL_STRATEGIES.add(name)
        return fn

    return wrap


def keyword_options(fn: Callable, fixed: Collection[str]) -> tuple[str, ...] | None:
    """The keyword parameters of ``fn`` a caller may set, less ``fixed`` (those the
    strategy passes itself); ``None`` when ``fn`` takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(sorted(p.name for p in params if p.kind in kinds and p.name not in fixed))


def strategies_taking(option: str) -> list[str]:
    """The registered strategies that accept the option ``option`` (declared in their
    ``options``), sorted by name."""
    return sorted(n for n, e in STRATEGY_ENTRIES.items() if option in (e.options or ()))


def check_options(name: str, options: Collection[str]) -> None:
    """Raise TypeError naming each option of ``options`` that strategy ``name`` does not
    accept, and the ones it does (:data:`STRATEGY_OPTIONS`)."""
    accepted = STRATEGY_OPTIONS.get(name)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    if unknown:
        allowed = f"it accepts {list(accepted)}" if accepted else "it takes no options"
        raise TypeError(f"strategy={name!r} does not take the option(s) {unknown}: {allowed}")


def get_strategy(name: str) -> Callable:
    """The registered strategy ``name``.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise STRATEGY_ENTRIES.unknown(name, STRATEGIES)  # the allowed names and the closest
    return STRATEGIES[name]


def strategy_entry(name) -> Strategy:
    """The :class:`Strategy` entry of ``name``; for a name registered without one (or no
    longer registered, as in a record read back from a checkpoint) an entry with the
    defaults, so that a record of any strategy reads in the card (also a value that is no
    name, e.g. a list in a hand-edited record: the config refuses it by name afterwards)."""
    key = name if isinstance(name, str) else str(name)  # a list is no registry key (nor does its text name one)
    entry = STRATEGY_ENTRIES.get(key)
    fn = STRATEGIES.get(key)
    if entry is not None and (fn is None or entry.fn is fn):
        return entry
    return Strategy(key, fn, needs_model=key in MODEL_STRATEGIES, options=STRATEGY_OPTIONS.get(key))
