"""Recovery methods behind one registry: what :func:`~hf_layerswap.recovery.recover` calls
for ``method=``. Adding a method is one module with one decorator on a
:class:`RecoveryMethod` subclass::

    @register_recovery_method("mine")
    class Mine(RecoveryMethod):
        default_epsilon = 1e-2
        def accumulate(self, moments, cut, rows, delta, tapped, keep): ...
        def solve(self, moments, cut, fit, epsilon): ...
        def apply(self, model, cuts, maps, host_modules): ...

The built-ins: ``"none"`` (plain removal; residuals only), ``"ghosted"`` (Ghosted Layers:
a kept operator on the stream), ``"fused"`` (ReplaceMe least squares, folded into
``down_proj`` or the input embedding) and ``"linearpatch"`` (LinearPatch: a Hadamard rotation
and a channel scaling, folded into the input embedding at a cut of block 0, a kept operator
on the stream elsewhere).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from accelerate.utils import has_offloaded_params

from ..utils.registry import NoOptions, Options, Registry, RegistryEntry, option
from .fit import MAX_EPSILON, block_down_proj, model_family, post_mlp_norm, probe_additive_write, quadratic_residual, select_rows, ridge_toward_identity
from .hadamard import hadamard_rotation
from ..surgery.operators import LOADER_NOTE, OPERATOR_METHODS, RECOVERY_FILE, attach_operator, attached_operators, operator_method

__all__ = [
    "DEFAULT_EPSILON",
    "METHODS",
    "PROBE_PROMPTS",
    "RECOVERY_METHODS",
    "RecoveryMethod",
    "fold_into_embedding",
    "get_recovery_method",
    "recovery_entry",
    "search_objectives",
    "register_recovery_method",
    "repair_options",
]

#: Default relative ridge per method, ``λ = ε · trace(XᵀX) / H`` (ridge toward the identity).
#: Chosen by held-out KL(dense || pruned), nats, on SmolLM2-135M (fit: 4,096 WikiText-2
#: validation tokens; KL: 8 WikiText-2 test paragraphs)::
#:
#:     removed    none    ghosted ε=0   1e-4   1e-3   1e-2    fused ε=1e-3   1e-1   0.3    1
#:     [20]       0.289   0.134        0.129  0.127  0.152    0.164          0.157  -      -
#:     [13, 20]   0.425   0.234        0.224  0.229  0.270    0.284          0.269  -      -
#:     [24, 25]   1.151   0.344        0.340  0.324  -        -              0.421  0.418  0.430
#:
#: Ghosted Layers' own absolute ε = 1e-6 is a no-op at these scales; a small relative
#: ridge tames the directions that only the attention-sink tokens excite. LinearPatch has no
#: ridge (its map is a rotation and a ratio of mean magnitudes): 0.
#: Prompts of the one batch a method's :meth:`RecoveryMethod.probe` checks the model on, at most.
PROBE_PROMPTS = 2

DEFAULT_EPSILON = {"none": 0.0, "ghosted": 1e-3, "fused": 1e-1, "linearpatch": 0.0}


def repair_options(title: str, default_epsilon: float, takes_epsilon: bool = True) -> type[Options]:
    """The typed options of a repair that fits (``num_tokens``, ``epsilon``; the arguments of
    :func:`~hf_layerswap.recovery.recover` and the fields of
    :class:`~hf_layerswap.RecoveryConfig`), with the method's default ridge in the help and,
    for a method without a ridge, ``epsilon`` bounded to 0."""
    ridge = (f"relative ridge toward the identity, lambda = epsilon * trace(X^T X) / H (None: {default_epsilon:g})"
             if takes_epsilon else "none: the fit has no ridge (None or 0)")
    spec = [("num_tokens", int | None, option(None, help="most real calibration tokens the fit reads (None: every "
                                                       "real token of the calibration set, at most 65,536)", ge=1)),
            ("epsilon", float | None, option(None, help=ridge, ge=0.0, le=MAX_EPSILON if takes_epsilon else 0.0))]
    return dataclasses.make_dataclass(title, spec, bases=(Options,), frozen=True)


class RecoveryMethod(RegistryEntry):
    """One way to repair a cut (a :class:`~hf_layerswap.utils.registry.RegistryEntry`: ``help``,
    :attr:`option_class` its typed options, made by :func:`repair_options` for a method that
    fits unless the class sets its own, :meth:`estimate` what
    :func:`~hf_layerswap.cost.estimate_cost` plans it with). Every hook has a do-nothing default; ``cut`` is a dict of
    :func:`~hf_layerswap.recovery.cut_boundaries` (``start``, ``end``, ``boundary``,
    ``host``, ``removed``), ``rows`` maps stream slots to ``(N, H)`` float64 rows of the real
    calibration tokens of one batch.

    Attributes:
        name: the ``method=`` value (set by :func:`register_recovery_method`).
        default_epsilon: the relative ridge used when ``epsilon=None``.
        fits: ``False`` for plain removal: nothing is solved, applied or recorded.
        takes_epsilon: the fit has a ridge; ``False``: an ``epsilon`` other than ``None``
            or 0 is refused (by :func:`~hf_layerswap.recovery.recover` and ``LayerSwapConfig``).
        attaches_at_load: the repair is (or can be) modules saved next to the weights that the
            loader re-attaches (``import hf_layerswap`` needed to load it; a folder without them
            is not published), not weights of plain transformers; :meth:`attaches` says it per
            record.
        stream_operators: its modules are the package's stream operators
            (:class:`~hf_layerswap.surgery.GhostedOperator`, saved in :data:`RECOVERY_FILE`,
            re-attached by :func:`~hf_layerswap.surgery.attach_saved_recovery`).
        search_objective: it serves as ``select_layers(strategy="search", objective=<name>)``:
            candidate sets are scored after this repair, with :meth:`cut_operator` acting on
            the residual stream entering the block after each cut.
        card_summary: the sentence the model card's summary adds for this repair.
        card_modules: what the card calls the saved modules (``attaches_at_load``).
        card_file: what the card's file list says of them.
    """

    name: str = ""
    help: str = ""
    default_epsilon: float = 0.0
    fits: bool = True
    takes_epsilon: bool = True
    attaches_at_load: bool = False
    stream_operators: bool = False
    search_objective: bool = False
    card_summary: str = ""
    card_modules: str = "repair modules"
    card_file: str = ""

    def estimate(self, cuts: list[dict], hidden: int, exact: bool) -> dict:
        """The entry's estimate for ``cuts``: ``probe_forwards`` (:meth:`probe_forwards`) and
        ``moment_bytes`` (:meth:`moment_bytes`); the fit's own passes are the batches up to
        the deepest stream slot it reads (:meth:`slots`), which the cost model counts."""
        return {"probe_forwards": self.probe_forwards(cuts), "moment_bytes": self.moment_bytes(cuts, hidden, exact)}

    def attached(self, model: nn.Module) -> list[int]:
        """Boundaries (pruned numbering) where this method's modules sit on ``model`` now."""
        return []

    def attaches(self, recovery: dict) -> bool:
        """Whether the repair the record ``config.layerswap["recovery"]`` describes has modules
        outside the transformers weights (default: :attr:`attaches_at_load`)."""
        return self.attaches_at_load

    def moment_bytes(self, cuts: list[dict], hidden: int, exact: bool) -> int:
        """Bytes of the float64 moments a fit of ``cuts`` holds (``exact=False``: the blocks are
        not chosen yet, each removed block may be a cut of its own), for
        :func:`~hf_layerswap.cost.estimate_cost`. Default: an ``(H, H)`` ``XᵀX`` and ``XᵀY`` per
        removed block and one more ``(H, H)`` per cut."""
        removed = sum(len(c["removed"]) for c in cuts)
        return 8 * hidden**2 * (2 * removed + (len(cuts) if exact else removed))

    def card_row(self, recovery: Mapping, indices) -> str:
        """The removal table's "Repair of the cut" cell for the record ``config.layerswap["recovery"]``
        (``indices``: the card's formatter of a list of blocks)."""
        return self.name

    def cut_operator(self, moments, removed, epsilon: float) -> torch.Tensor:
        """``(H, H)`` float64 operator for one cut of the consecutive blocks ``removed`` from
        per-block moments (``moments.gram[("h", p)]``, ``moments.cross[("h", p, p + 1)]``);
        needed when :attr:`search_objective` is set.

        Raises:
            NotImplementedError: the method is no search objective.
        """
        raise NotImplementedError(f"recovery method {self.name!r} is no search objective")

    def check(self, model: nn.Module, blocks: nn.ModuleList, cuts: list[dict]) -> None:
        """Refuse (``ValueError``) a model the method cannot repair, before any forward pass."""

    def check_hosts(self, model: nn.Module, blocks: nn.ModuleList, hosts) -> None:
        """Refuse (``ValueError``), from the blocks' structure alone (a meta-device model
        will do), an architecture the method cannot repair when a cut's last kept block is
        one of ``hosts`` (its ``host``): what a prune checks before its scoring, for every
        block a selected cut could end after (:func:`~hf_layerswap.config.check_against_model`)."""

    def probe(self, model, blocks, cuts, calibration, batch_size: int, num_tokens: int) -> None:
        """Check the model on real calibration rows before the fit (``ValueError`` to refuse)."""

    def probe_forwards(self, cuts: list[dict]) -> list[int]:
        """The forwards :meth:`probe` runs for ``cuts``, each as the number of blocks it runs,
        on the first batch of at most :data:`PROBE_PROMPTS` prompts (what
        :func:`~hf_layerswap.cost.estimate_cost` counts; default none)."""
        return []

    def slots(self, cut: dict) -> tuple[int, ...]:
        """Residual-stream slots read beyond the cut's ``start`` and ``end``."""
        return ()

    def taps(self, model, blocks, cuts) -> dict:
        """``{key: module}`` whose outputs each batch hands to :meth:`accumulate` as ``tapped[key]``."""
        return {}

    def accumulate(self, moments, cut: dict, rows: dict, delta: torch.Tensor, tapped: dict, keep: torch.Tensor) -> None:
        """Add one batch to ``moments`` (``delta = rows[end] - rows[start]``)."""

    def solve(self, moments, cut: dict, fit, epsilon: float):
        """``(squared residual after, map)`` for one cut, filling ``fit``'s ridge/condition
        fields and, for values of the method's own (a fitted scalar), ``fit.extra[name] =
        float`` (serialised with the fit and recorded per cut in
        ``config.layerswap["recovery"]["extra"]``); ``None`` = nothing to solve."""
        return None

    def apply(self, model: nn.Module, cuts: list[dict], maps: dict, host_modules: dict) -> None:
        """Put the solved ``maps`` (keyed by boundary) into the pruned model."""

    def record(self, fits: list) -> dict:
        """Extra entries of ``config.layerswap["recovery"]``."""
        return {}


#: ``method=`` name -> :class:`RecoveryMethod` instance, in registration order (a
#: :class:`~hf_layerswap.utils.registry.Registry`).
RECOVERY_METHODS: Registry[RecoveryMethod] = Registry("recovery method", "method")


def register_recovery_method(name: str, help: str | None = None):
    """Class decorator: register an instance of a :class:`RecoveryMethod` subclass as ``name``;
    ``help``: one line for the command line and the docs (default: the class's ``help``, else
    the first line of its docstring).

    Raises:
        ValueError: ``name`` is empty or already registered. TypeError: not a RecoveryMethod subclass.
    """
    RECOVERY_METHODS.check_new(name)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, RecoveryMethod)):
            raise TypeError(f"register_recovery_method({name!r}) decorates a RecoveryMethod subclass, got {cls!r}")
        method = cls()
        method.name = name
        method.help = help or cls.help or (cls.__doc__ or name).strip().split("\n")[0]
        if "option_class" not in cls.__dict__:
            method.option_class = (repair_options(f"{cls.__name__}Options", method.default_epsilon, method.takes_epsilon)
                                   if method.fits else NoOptions)
        RECOVERY_METHODS.add(name, method)
        if method.stream_operators:
            OPERATOR_METHODS.add(name)
        return cls

    return decorate


def get_recovery_method(name) -> RecoveryMethod:
    """The registered method ``name`` (``None`` = ``"none"``).

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    return RECOVERY_METHODS.lookup("none" if name is None else name)


def recovery_entry(name) -> RecoveryMethod | None:
    """The registered method ``name``, or ``None`` for no name or an unregistered one (a
    record read back from a checkpoint made with a method this process does not know)."""
    return RECOVERY_METHODS.get(name) if isinstance(name, str) else None


def search_objectives() -> tuple[str, ...]:
    """The registered methods that serve as a search objective (:attr:`RecoveryMethod.search_objective`)."""
    return tuple(n for n, m in RECOVERY_METHODS.items() if m.search_objective)


# ----------------------------------------------------------------------------- built-ins
@register_recovery_method("none", help="plain removal: the fit residuals are reported, nothing is repaired")
class PlainRemoval(RecoveryMethod):
    """Plain removal: the fit residuals of removal are reported, nothing is repaired."""

    default_epsilon = DEFAULT_EPSILON["none"]
    fits = False


@register_recovery_method("ghosted", help="Ghosted Layers: one ridge operator per cut on the residual stream, saved next to the weights")
class Ghosted(RecoveryMethod):
    """Ghosted Layers: one ridge map per removed block, multiplied into one operator per cut,
    kept on the model as a forward hook (saved next to the weights)."""

    default_epsilon = DEFAULT_EPSILON["ghosted"]
    attaches_at_load = True
    stream_operators = True
    search_objective = True
    card_summary = " The cut is repaired with Ghosted Layers operators (load with `import hf_layerswap`, see below)."
    card_modules = "Ghosted Layers operators"
    card_file = "Ghosted Layers operators (float32 (H, H) per boundary), applied by `hf_layerswap`"

    def attached(self, model):
        return [b for b, _ in attached_operators(model)] if operator_method(model) == self.name else []

    def card_row(self, recovery, indices):
        return (f"Ghosted Layers closed-form operator I + M at boundaries {indices(recovery.get('boundaries', []))} "
                f"(pruned numbering), stored in `{recovery.get('file')}`")

    def cut_operator(self, moments, removed, epsilon):
        return self._product(moments, removed, epsilon)[0]

    @staticmethod
    def _product(moments, removed, epsilon):
        total, lams, conds = None, [], []
        for p in removed:
            w, lam, cond = ridge_toward_identity(moments.gram[("h", p)], moments.cross[("h", p, p + 1)], epsilon)
            total = w if total is None else total @ w
            lams.append(lam)
            conds.append(cond)
        return total, lams, conds

    def slots(self, cut):
        return tuple(range(cut["start"], cut["end"] + 1))

    def accumulate(self, moments, cut, rows, delta, tapped, keep):
        s, e = cut["start"], cut["end"]
        for p in cut["removed"]:
            moments.add_gram(("h", p), rows[p])
            moments.add_cross(("h", p, p + 1), rows[p], rows[p + 1])
        if e != s + 1:
            moments.add_cross(("h", s, e), rows[s], rows[e])

    def solve(self, moments, cut, fit, epsilon):
        s, e = cut["start"], cut["end"]
        total, lams, conds = self._product(moments, cut["removed"], epsilon)
        fit.ridge.extend(lams)
        cross = moments.cross[("h", s, e)] if e != s + 1 else moments.cross[("h", s, s + 1)]
        after = quadratic_residual(total, moments.gram[("h", s)], cross, moments.sq[("y", e)])
        fit.condition_number = max(conds)
        return after, total.to(torch.float32)

    def apply(self, model, cuts, maps, host_modules):
        for cut in cuts:
            attach_operator(model, cut["boundary"], maps[cut["boundary"]])

    def record(self, fits):
        return {"file": RECOVERY_FILE, "loader": LOADER_NOTE.format(method=self.name, file=RECOVERY_FILE)}


@register_recovery_method("fused", help="ReplaceMe least squares folded into down_proj (the input embedding at a cut of block 0): plain weights")
class Fused(RecoveryMethod):
    """ReplaceMe least squares folded into ``mlp.down_proj`` of the last kept block (into
    the input embedding for a cut at block 0): a plain transformers checkpoint."""

    default_epsilon = DEFAULT_EPSILON["fused"]
    card_summary = " The cut is repaired with a least-squares map folded into the weights."

    def card_row(self, recovery, indices):
        """Where each map was folded, as the record says (``folded_into``, one module per
        boundary: a block's ``down_proj``, or the input embedding for a cut at block 0)."""
        boundaries, folded = list(recovery.get("boundaries", [])), recovery.get("folded_into")
        if isinstance(folded, list) and len(folded) == len(boundaries) and boundaries:
            where = ", ".join(f"`{module}` before boundary {b}" for module, b in zip(folded, boundaries))
        else:  # a record that does not say where: no module is named
            where = f"the weights before boundaries {indices(boundaries)} (the record does not name the modules)"
        return f"ReplaceMe-style least-squares map folded into {where} (pruned numbering): plain transformers weights"

    def check(self, model, blocks, cuts):
        self.check_hosts(model, blocks, [cut["host"] for cut in cuts if cut["host"] is not None])
        if any(cut["host"] is None for cut in cuts):
            _refuse_offloaded_fold(model.get_input_embeddings(), "the input embedding (a cut at block 0)")

    def check_hosts(self, model, blocks, hosts):
        for host in hosts:
            _refuse_offloaded_fold(block_down_proj(model, blocks, host), f"block {host}'s mlp.down_proj")
            norm = post_mlp_norm(blocks[host])
            if norm:
                raise ValueError(
                    f"fused recovery needs blocks that add the mlp.down_proj output to the residual stream "
                    f"unchanged; {model_family(model)} block {host} does not (post-norm blocks: the MLP output "
                    f"passes through {norm} before it is added), so a map folded into down_proj is not a map "
                    "on the stream; use method='ghosted'")

    def probe(self, model, blocks, cuts, calibration, batch_size, num_tokens):
        first = next(select_rows(calibration, min(batch_size, PROBE_PROMPTS), num_tokens))
        for cut in cuts:
            if cut["host"] is not None:
                probe_additive_write(model, blocks, cut["host"], first[0], first[1])

    def probe_forwards(self, cuts):
        """Two forwards to the slot after each cut's host block (:func:`~hf_layerswap.recovery.fit.probe_additive_write`)."""
        return [c["host"] + 1 for c in cuts if c["host"] is not None for _ in range(2)]

    def taps(self, model, blocks, cuts):
        return {c["host"]: block_down_proj(model, blocks, c["host"]) for c in cuts if c["host"] is not None}

    def accumulate(self, moments, cut, rows, delta, tapped, keep):
        s, e = cut["start"], cut["end"]
        if cut["host"] is None:
            moments.add_gram(("h", s), rows[s])
            moments.add_cross(("h", s, e), rows[s], rows[e])
        else:
            m = tapped[cut["host"]][keep].double()
            moments.add_gram(("m", s), m)
            moments.add_cross(("m", s), m, delta)

    def solve(self, moments, cut, fit, epsilon):
        s, e = cut["start"], cut["end"]
        if cut["host"] is None:
            w, lam, cond = ridge_toward_identity(moments.gram[("h", s)], moments.cross[("h", s, e)], epsilon)
            after = quadratic_residual(w, moments.gram[("h", s)], moments.cross[("h", s, e)], moments.sq[("y", e)])
            fit.ridge, fit.condition_number, fit.folded_into = [lam], cond, "embed_tokens"
            return after, w
        gram, cross = moments.gram[("m", s)], moments.cross[("m", s)]
        # T = I + K with (mᵀm + λI) K = mᵀΔ: the same solve with XᵀY := mᵀΔ + mᵀm
        t, lam, cond = ridge_toward_identity(gram, cross + gram, epsilon)
        k = t - torch.eye(t.shape[0], dtype=t.dtype)
        after = quadratic_residual(k, gram, cross, moments.sq[("delta", s)])
        fit.ridge, fit.condition_number = [lam], cond
        fit.folded_into = f"layers.{cut['boundary'] - 1}.mlp.down_proj"
        return after, t

    def apply(self, model, cuts, maps, host_modules):
        _fold(model, cuts, maps, host_modules)

    def record(self, fits):
        return {"folded_into": [f.folded_into for f in fits]}


@torch.no_grad()
def fold_into_embedding(model: nn.Module, t: torch.Tensor) -> None:
    """Fold the ``(H, H)`` map ``h ↦ h t`` on the stream entering block 0 into the input
    embedding (``E ← E t``, a float64 product cast to the weight dtype), untying a tied
    output head first (``tie_word_embeddings=False``) so that the head keeps its weights.
    Exact for every architecture that adds nothing to the embedding before block 0 but a
    scale (a scalar commutes with ``t``)."""
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if out is not None and out.weight is emb.weight:
        out.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
        for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
            cfg.tie_word_embeddings = False
    w = emb.weight
    w.copy_((w.double() @ t.to(device=w.device, dtype=torch.float64)).to(w.dtype))


def _refuse_offloaded_fold(module: nn.Module, what: str) -> None:
    """Refuse to fold a map into ``module`` when an accelerate device map offloads its weights
    (to the CPU or disk between calls): the in-place write would not reach the weights that
    are saved, so the checkpoint would keep the unrepaired weights."""
    if has_offloaded_params(module):
        raise ValueError(
            f"fused recovery folds its map into {what}, whose weights are offloaded by the device map: the "
            "fold would not reach the saved weights; load the model without offloading (no --offload-folder, "
            "a --max-memory that holds it), or use method='ghosted'"
        )


@torch.no_grad()
def _fold(model, cuts, maps, host_modules) -> None:
    """Fold fused maps into weights (float64 products, cast to the weight dtype)."""
    for cut in cuts:
        t = maps[cut["boundary"]]
        host = host_modules[cut["boundary"]]
        if host is None:
            fold_into_embedding(model, t)
            continue
        down = host.mlp.down_proj
        w = down.weight  # (H, d_ff): output = z Wᵀ; new output = z Wᵀ T = z (Tᵀ W)ᵀ
        tt = t.T.to(w.device)
        w.copy_((tt @ w.double()).to(w.dtype))
        if down.bias is not None:
            down.bias.copy_((tt @ down.bias.double()).to(down.bias.dtype))


@register_recovery_method("linearpatch", help="LinearPatch: a Hadamard rotation and a channel scaling per cut, no ridge")
class LinearPatch(RecoveryMethod):
    """LinearPatch (Chen et al., arXiv 2505.24680): one symmetric map ``P = R · D · Rᵀ`` per
    cut, ``R`` an orthonormal Hadamard rotation of the hidden size
    (:func:`~hf_layerswap.recovery.hadamard.hadamard_rotation`) and ``D`` the per-channel ratio
    of mean magnitudes across the cut in the rotated basis, ``D_j = mean|h_e R|_j / mean|h_s R|_j``
    over the real calibration tokens. Folded into the input embedding at a cut of block 0 (a plain
    transformers weight); elsewhere kept on the stream as an operator, saved next to the weights
    like Ghosted Layers' (an anisotropic map on the full stream changes the per-token RMS every
    later norm reads, so it cannot be folded there). The paper's optional distillation of P is
    not run."""

    default_epsilon = DEFAULT_EPSILON["linearpatch"]
    takes_epsilon = False
    attaches_at_load = True
    stream_operators = True
    card_summary = " The cut is repaired with LinearPatch maps (a Hadamard rotation and a channel scaling)."
    card_modules = "LinearPatch operators"
    card_file = "LinearPatch operators (float32 (H, H) per boundary not folded into the weights), applied by `hf_layerswap`"

    def check(self, model, blocks, cuts):
        self.check_hosts(model, blocks, [cut["host"] for cut in cuts if cut["host"] is not None])

    def check_hosts(self, model, blocks, hosts):
        """Refuse post-norm blocks (Gemma-2/3, OLMo-2) as the last kept block of a cut.

        Their stream carries a few massive channels on every token (on Gemma-3-270M one channel
        holds about half of each token's energy at block 7). The rotation spreads such a channel
        over every rotated coordinate, and a non-uniform ``D`` maps it back into every channel:
        noise as large as the rest of the token, on every token, which a fit residual dominated
        by the massive channel does not show (blocks 7-8 of Gemma-3-270M: residual 0.394 against
        plain removal's 0.424, perplexity 41 -> 8.8e13). A cut of block 0 (folded into the
        input embedding) stays allowed.

        Raises:
            ValueError: a host block with a norm on its MLP output (named), before any forward.
        """
        for host in hosts:
            norm = post_mlp_norm(blocks[host])
            if norm:
                raise ValueError(
                    f"linearpatch recovery cannot repair a cut after {model_family(model)} block {host} (post-norm "
                    f"blocks: the MLP output passes through {norm} before it is added): the stream of such models "
                    "carries massive channels on every token, which the Hadamard rotation and a non-uniform channel "
                    "scaling spread into every channel, breaking the model; use method='ghosted'")

    def attaches(self, recovery):
        return bool(recovery.get("boundaries"))

    def attached(self, model):
        return [b for b, _ in attached_operators(model)] if operator_method(model) == self.name else []

    def card_row(self, recovery, indices):
        parts = []
        folded = list(recovery.get("folded_boundaries") or [])
        if folded:
            parts.append(f"folded into `embed_tokens` at boundary {indices(folded)}: plain transformers weights")
        if recovery.get("boundaries") or not folded:
            parts.append(f"operators at boundaries {indices(recovery.get('boundaries', []))}, stored in "
                         f"`{recovery.get('file')}`")
        rotation = f" ({recovery['rotation']})" if recovery.get("rotation") else ""
        return f"LinearPatch H·D·Hᵀ{rotation}, " + "; ".join(parts) + " (pruned numbering)"

    def moment_bytes(self, cuts, hidden, exact):
        # XᵀX and XᵀY (the fit residual) and two (H,) magnitude sums per cut
        removed = sum(len(c["removed"]) for c in cuts)
        return 8 * (2 * hidden**2 + 2 * hidden) * (len(cuts) if exact else removed)

    def accumulate(self, moments, cut, rows, delta, tapped, keep):
        s, e = cut["start"], cut["end"]
        x, y = rows[s], rows[e]
        rotation = hadamard_rotation(x.shape[-1])[0].to(x.device)
        moments.add_gram(("h", s), x)
        moments.add_cross(("h", s, e), x, y)
        moments.add_sum(("abs_in", s), (x @ rotation).abs())
        moments.add_sum(("abs_out", s), (y @ rotation).abs())

    def solve(self, moments, cut, fit, epsilon):
        s, e = cut["start"], cut["end"]
        gram, cross = moments.gram[("h", s)], moments.cross[("h", s, e)]
        rotation, how = hadamard_rotation(gram.shape[0])
        into, out = moments.sums[("abs_in", s)].cpu(), moments.sums[("abs_out", s)].cpu()
        scale = torch.where(into > 0, out / into.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(into))
        patch = (rotation * scale) @ rotation.T
        after = quadratic_residual(patch, gram, cross, moments.sq[("y", e)])
        fit.rotation = how
        fit.folded_into = "embed_tokens" if cut["host"] is None else None
        return after, patch

    def apply(self, model, cuts, maps, host_modules):
        for cut in cuts:
            if cut["host"] is None:
                fold_into_embedding(model, maps[cut["boundary"]])
            else:
                attach_operator(model, cut["boundary"], maps[cut["boundary"]])

    def record(self, fits):
        folded = [f.boundary for f in fits if f.folded_into is not None]
        hooked = [f.boundary for f in fits if f.folded_into is None]
        out = {
            "boundaries": hooked,
            "folded_boundaries": folded,
            "folded_into": ["embed_tokens"] * len(folded),
            "rotation": next((f.rotation for f in fits if f.rotation), None),
            "epsilon_rule": "none: LinearPatch has no ridge (D is a ratio of mean magnitudes)",
            "cut_boundaries": [f.boundary for f in fits],
        }
        if hooked:
            out.update(file=RECOVERY_FILE, loader=LOADER_NOTE.format(method=self.name, file=RECOVERY_FILE))
        return out


#: The registered method names now (``"none"`` = plain removal, residuals only), a live view
#: of :data:`RECOVERY_METHODS`: a method registered later is in it.
METHODS = RECOVERY_METHODS.names
