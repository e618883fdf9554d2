"""Peeling itself: the references (closed-form linear map, gradient-trained block, deletion),
the substitution of a reference for a span of blocks through the layer plan, and
:func:`peel` (fit on calibration text, score on held-out text)."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..calibration import build_calibration
from ..utils.devices import input_device
from ..layerplan import apply_plan, capture_residual_stream, decoder_blocks, removal_plan, resolve_layer_indices
from ..utils.provenance import library_versions, report_identity
from ..recovery import ridge_toward_identity
from ..recovery.fit import Moments
from .data import build_evaluation, check_disjoint, sequence_nll
from .report import DEFAULT_RIDGE, DEFAULT_TAU, REFERENCES, TARGETS, PeelProbe, PeelReport


def _bootstrap(num: torch.Tensor, den: torch.Tensor, index: torch.Tensor) -> tuple[float, float]:
    """95% percentile CI of ``Σ num / Σ den`` over resampled sequences ``index`` (R, N)."""
    ratios = num[index].sum(dim=1) / den[index].sum(dim=1)
    q = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(q[0]), float(q[1])


# ----------------------------------------------------------------------------- references


class _LinearMap:
    """``ĥ = h W + b`` applied in float64, result in the stream's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        out = hidden.double() @ self.weight.to(hidden.device)
        if self.bias is not None:
            out = out + self.bias.to(hidden.device)
        return out.to(hidden.dtype)


def _deletion(hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return hidden


class _BlockReference:
    """A trained copy of a block's architecture, called like the block (cached kwargs)."""

    def __init__(self, block: nn.Module):
        self.block = block

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


def _fresh_copy(model: nn.Module, block: nn.Module, seed: int) -> nn.Module:
    """``copy.deepcopy(block)`` re-initialised with the model's own ``_init_weights`` rule."""
    ref = copy.deepcopy(block)
    for p in ref.parameters():
        p.requires_grad_(True)
        if hasattr(p, "_is_hf_initialized"):
            del p._is_hf_initialized
    init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for module in ref.modules():
            if hasattr(module, "_is_hf_initialized"):
                del module._is_hf_initialized
            if init is not None:
                init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return ref


def _train_block_reference(model, block, batches, *, steps: int, lr: float, seed: int) -> tuple[_BlockReference, dict]:
    """AdamW on ``Σ‖R(h_k) − h_t‖² / Σ‖h_t − h_k‖²`` over cached calibration batches.

    ``batches``: list of ``(x (B,T,H), y (B,T,H), keep (B,T) bool, kwargs)``.
    """
    ref = _fresh_copy(model, block, seed)
    ref.eval()  # no dropout: the fit is deterministic
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)

    def loss_of(x, y, keep, kwargs):
        out = ref(x, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        err = (out - y)[keep].double().pow(2).sum()
        return err / (y - x)[keep].double().pow(2).sum().clamp_min(1e-30)

    def full_loss() -> float:
        with torch.no_grad():
            num = sum(float(loss_of(*b) * (b[1] - b[0])[b[2]].double().pow(2).sum()) for b in batches)
            den = sum(float((b[1] - b[0])[b[2]].double().pow(2).sum()) for b in batches)
        return num / max(den, 1e-30)

    initial = full_loss()
    with torch.enable_grad():
        for step in range(steps):
            x, y, keep, kwargs = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y, keep, kwargs)
            loss.backward()
            opt.step()
    for p in ref.parameters():
        p.requires_grad_(False)
    return _BlockReference(ref), {"steps": steps, "lr": lr, "initial_loss": initial, "final_loss": full_loss()}


# ----------------------------------------------------------------------------- substitution


def _replace_output_hook(hidden: torch.Tensor):
    def hook(module, args, output):
        if isinstance(output, (tuple, list)):
            return (hidden,) + tuple(output[1:])
        return hidden

    return hook


def _substituted_logits(model, blocks, site: int, span: int, hidden: torch.Tensor, streams: dict, ids, mask):
    """Logits with blocks ``site..site+span-1`` removed and ``hidden`` at the cut (plan mechanism)."""
    num_blocks = len(blocks)
    plan = removal_plan(num_blocks, list(range(site, site + span)))
    if site < len(plan):  # a kept block follows the cut: inject its input
        with apply_plan(model, plan, start=site, start_hidden=hidden):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    # the cut reaches the last block: re-run the last kept block from its cached input, replace its output
    last = len(plan) - 1
    handle = blocks[plan[last]].register_forward_hook(_replace_output_hook(hidden))
    try:
        with apply_plan(model, plan, start=last, start_hidden=streams[plan[last]]):
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        handle.remove()


def _kwargs_grabber(store: dict, site: int):
    def hook(module, args, kwargs):
        store[site] = {k: v for k, v in kwargs.items()}

    return hook


# ----------------------------------------------------------------------------- peel


def _as_tuple(value, allowed, what) -> tuple:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not items or any(v not in allowed for v in items):
        raise ValueError(f"{what}={value!r}: allowed one or more of {list(allowed)}")
    return tuple(dict.fromkeys(items))


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}")
    return value


def _probe_list(num_blocks, spans, targets, references, sites) -> list[tuple[int, int, str, str]]:
    """``(site, span, reference, kind)`` for every probe, in report order."""
    probes = []
    own = targets in ("own", "own+later")
    later = targets in ("later", "own+later")
    for ref in references:
        if own:
            for span in spans:
                probes += [(k, span, ref, "own") for k in sites if k + span <= num_blocks]
        if later and ref != "gradient":
            probes += [(k, num_blocks - k, ref, "later") for k in sites if k > 0 and not (own and num_blocks - k in spans)]
    return probes


@torch.no_grad()
def peel(
    model: nn.Module,
    calibration=None,
    eval_text=None,
    *,
    spans: Sequence[int] = (1, 2),
    targets: str = "own+later",
    ridge: float = DEFAULT_RIDGE,
    tokenizer=None,
    reference: str | Sequence[str] = "linear",
    bias: bool = True,
    sites: Sequence[int] | None = None,
    num_prompts: int = 64,
    seq_len: int = 128,
    eval_prompts: int = 32,
    eval_seq_len: int = 128,
    batch_size: int = 8,
    bootstrap: int = 1000,
    tau: float = DEFAULT_TAU,
    seed: int = 0,
    gradient_steps: int = 100,
    gradient_lr: float = 1e-3,
    progress: bool = False,
) -> PeelReport:
    """Per-layer peeling reference bounds of one checkpoint (Eamaz et al., arXiv 2605.02853).

    For every site k and span m, fit a reference mapping the residual stream entering
    block k onto the stream leaving block k+m-1 (and, for the "later" targets, onto the
    stream leaving the last block), substitute it for those blocks and report the change
    in held-out cross-entropy. See the module docstring for the definitions.

    Args:
        model: a transformers causal LM (decoder-only; multimodal text towers included).
        calibration: text the references are fitted on: ``None``/``"embedded"`` (the
            embedded calibration prose), a text file, a list of strings, a
            ``datasets.Dataset``, an ``input_ids``/``attention_mask`` mapping or a
            :class:`CalibrationSet` (see :func:`~hf_layerswap.calibration.build_calibration`).
        eval_text: held-out text the hybrids are scored on (see :func:`build_evaluation`):
            ``None`` (default: ``embedded_text("evaluation")``), raw text, or any
            calibration source. Must not overlap the calibration text.
        spans: numbers of consecutive blocks replaced by one reference (each 1..L-1).
        targets: ``"own"`` (stream after the span), ``"later"`` (the final stream h_L from
            every site k >= 1) or ``"own+later"``.
        ridge: relative ridge of the linear fit, ``λ = ridge · trace(XᵀX) / n`` with n
            the number of regressors (H + 1 with ``bias``), toward the identity (>= 0;
            0 = ordinary least squares). Recorded per probe as ``fit["lambda"]``.
        tokenizer: needed for text sources (default: ``model.layerswap_tokenizer`` if set).
        reference: one or more of :data:`REFERENCES` (``"gradient"`` only for own
            targets; it trains a re-initialised copy of block k's architecture for
            ``gradient_steps`` AdamW steps at ``gradient_lr`` on the cached calibration
            streams, which are then all kept in memory).
        bias: fit an affine map (a constant input column) rather than a linear one.
        sites: 0-based sites to probe (default: all).
        num_prompts, seq_len: calibration budget; eval_prompts, eval_seq_len: evaluation budget.
        batch_size: prompts per forward pass.
        bootstrap: bootstrap resamples for the CIs (>= 100), seeded by ``seed``.
        tau: "matched" threshold on the CI's upper end, nats (>= 0).
        progress: show a progress bar.

    Returns:
        A :class:`PeelReport`.

    Raises:
        ValueError: a span outside ``1..L-1``, an unknown target or reference, a bad
            site, ``ridge < 0``, ``tau < 0``, ``bootstrap < 100``, overlapping calibration
            and evaluation text (:func:`check_disjoint`), or a singular normal system.
        TypeError: a text source without a tokenizer.
    """
    _, _, blocks = decoder_blocks(model)
    num_blocks = len(blocks)
    spans, references, site_list, probes = _check_peel_args(
        num_blocks, spans, targets, reference, ridge, tau, bootstrap, batch_size, gradient_steps, sites
    )
    if tokenizer is None:
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    calib = build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)
    evalset = build_evaluation(eval_text, tokenizer, num_prompts=eval_prompts, seq_len=eval_seq_len, seed=seed)
    check_disjoint(calib, evalset)

    trained = [(k, m) for k, m, ref, _ in probes if ref == "gradient"]
    results, base, fits, cal_tokens, hidden_size, timings = _fit_and_evaluate(
        model, blocks, calib, evalset, probes, batch_size=batch_size, bias=bias, ridge=float(ridge),
        gradient_steps=gradient_steps, gradient_lr=gradient_lr, seed=seed, progress=progress,
    )
    nll0, count = base
    n = count.numel()
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (bootstrap, n), generator=g)
    den = count.double()
    base_ce = float(nll0.sum() / den.sum())
    out_probes = _peel_probes(probes, results, fits, nll0, den, index, tau)
    settings = _peel_settings(spans, targets, references, ridge, bias, tau, bootstrap, seed, site_list,
                              (gradient_steps, gradient_lr) if trained else None)
    metadata = {
        "model": report_identity(model),
        "calibration": calib.spec(),
        "calibration_tokens_used": cal_tokens,
        "evaluation": evalset.spec(),
        "evaluation_predicted_tokens": int(count.sum()),
        "evaluation_sequences": n,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "fit_dtype": "float64",
        "ce_definition": "total next-token NLL / total predicted tokens (nats), fp32 log-softmax",
        "hidden_size": hidden_size,
        "library_versions": library_versions(),
        "method": "peeling reference bounds, per-site form (Eamaz, Yeganegi, Soltanalian, arXiv 2605.02853)",
        "timings": timings,
    }
    lo, hi = _bootstrap(nll0, den, index)
    return PeelReport(num_blocks, base_ce, (lo, hi), out_probes, settings, metadata)


def _peel_settings(spans, targets, references, ridge, bias, tau, bootstrap, seed, site_list, gradient) -> dict:
    """``PeelReport.settings``; ``gradient`` is ``(steps, lr)`` when a reference was trained."""
    settings = {
        "spans": list(spans),
        "targets": targets,
        "references": list(references),
        "ridge": float(ridge),
        "ridge_rule": "lambda = ridge * trace(X^T X) / (H + 1), X = [h_k, 1]; ridge toward the identity",
        "bias": bool(bias),
        "tau": float(tau),
        "bootstrap": bootstrap,
        "bootstrap_unit": "evaluation sequence (paired, percentile 95%)",
        "seed": seed,
        "sites": site_list,
    }
    if gradient is not None:
        settings.update({"gradient_steps": gradient[0], "gradient_lr": gradient[1], "gradient_init": "fresh"})
    return settings


def _check_peel_args(num_blocks, spans, targets, reference, ridge, tau, bootstrap, batch_size, gradient_steps, sites):
    """Validate :func:`peel`'s settings: ``(spans, references, sites, probes)``, each
    probe ``(site, span, reference, target kind)``; raises ``ValueError`` as it documents."""
    if num_blocks < 2:
        raise ValueError(f"the model has {num_blocks} block(s); peeling needs at least 2")
    spans = tuple(dict.fromkeys(spans))
    for m in spans:
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= num_blocks - 1:
            raise ValueError(f"span {m!r} in spans={list(spans)}: allowed ints 1..{num_blocks - 1} for {num_blocks} blocks")
    if not spans:
        raise ValueError("spans is empty: pass at least one span, e.g. (1, 2)")
    if targets not in TARGETS:
        raise ValueError(f"targets={targets!r}: allowed {list(TARGETS)}")
    references = _as_tuple(reference, REFERENCES, "reference")
    if references == ("gradient",) and targets == "later":
        raise ValueError("reference='gradient' fits own targets only; use targets='own' or 'own+later'")
    if not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge={ridge!r}: must be a finite float >= 0")
    if not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau={tau!r}: must be a finite float >= 0")
    _check_int(bootstrap, "bootstrap", 100)
    _check_int(batch_size, "batch_size", 1)
    _check_int(gradient_steps, "gradient_steps", 0)
    site_list = list(range(num_blocks)) if sites is None else resolve_layer_indices(list(sites), num_blocks)
    probes = _probe_list(num_blocks, spans, targets, references, site_list)
    if not probes:
        raise ValueError(f"no probe to run for sites={site_list}, spans={list(spans)}, targets={targets!r}")
    return spans, references, site_list, probes


def _fit_and_evaluate(model, blocks, calib, evalset, probes, *, batch_size, bias, ridge, gradient_steps, gradient_lr,
                      seed, progress):
    """Fit every reference on the calibration streams (one pass; gradient references
    trained after it), then score each hybrid on the evaluation set, the model in eval
    mode throughout: ``(results, (base nll, counts), fits, calibration tokens, H, timings)``."""
    fitted = [(k, m) for k, m, ref, _ in probes if ref == "linear"]
    trained = [(k, m) for k, m, ref, _ in probes if ref == "gradient"]
    device = input_device(model)
    was_training = model.training
    model.eval()
    timings: dict = {}
    maps: dict = {}
    fits: dict = {}
    try:
        t0 = time.perf_counter()
        cal_tokens, hidden_size, cache = _fit_pass(
            model, blocks, calib, fitted, trained, batch_size, bias, ridge, maps, fits, device
        )
        timings["linear_fit_seconds"] = time.perf_counter() - t0
        if fitted and hidden_size is not None and cal_tokens < 4 * (hidden_size + 1):
            warnings.warn(
                f"linear references fitted on {cal_tokens} calibration tokens for {hidden_size + int(bias)} regressors: "
                "the ridge decides much of the map; use more calibration tokens (num_prompts/seq_len)",
                stacklevel=3,
            )
        for k, m in trained:
            t1 = time.perf_counter()
            maps[(k, m, "gradient")], fits[(k, m, "gradient")] = _train_block_reference(
                model, blocks[k], cache[(k, m)], steps=gradient_steps, lr=gradient_lr, seed=seed + 1000 * k + m
            )
            fits[(k, m, "gradient")]["train_seconds"] = time.perf_counter() - t1
        cache.clear()
        for k, m, ref, _ in probes:
            if ref == "deletion":
                maps[(k, m, ref)], fits[(k, m, ref)] = _deletion, {}
        results, base, timings["evaluation_base_seconds"] = _eval_pass(
            model, blocks, evalset, probes, maps, batch_size, device, progress
        )
    finally:
        model.train(was_training)
    return results, base, fits, cal_tokens, hidden_size, timings


def _peel_probes(probes, results, fits, nll0, den, index, tau) -> list[PeelProbe]:
    """One :class:`PeelProbe` per probe: ΔCE with its paired bootstrap CI, the explained
    variance and NMSE of the reference, the flag against ``tau``, the fit record."""
    out_probes = []
    for k, m, ref, kind in probes:
        r = results[(k, m, ref)]
        delta = r["nll"] - nll0
        dce = float(delta.sum() / den.sum())
        lo, hi = _bootstrap(delta, den, index)
        sst = r["u_sq"] - float((r["u_sum"] ** 2).sum()) / max(r["tokens"], 1)
        ev = 1.0 - r["sse"] / sst if sst > 0 else math.nan
        nmse = r["sse"] / r["u_sq"] if r["u_sq"] > 0 else math.nan
        flag = "beaten" if hi < 0 else ("matched" if hi <= tau else "")
        fit = dict(fits.get((k, m, ref), {}))
        seconds = r["seconds"] + float(fit.get("train_seconds", 0.0))
        out_probes.append(
            PeelProbe(k, m, ref, kind, dce, lo, hi, float(r["nll"].sum() / den.sum()), ev, nmse, flag, fit, seconds)
        )
    return out_probes


def _fit_pass(model, blocks, calib, fitted, trained, batch_size, bias, ridge, maps, fits, device):
    """One calibration pass: float64 moments for the linear fits, cached tensors for gradient fits."""
    slots = {k for k, _ in fitted + trained} | {k + m for k, m in fitted + trained}
    moments = Moments()
    cache: dict = {pair: [] for pair in trained}
    kw_store: dict = {}
    handles = [blocks[k].register_forward_pre_hook(_kwargs_grabber(kw_store, k), with_kwargs=True)
               for k in sorted({k for k, _ in trained})]
    tokens, hidden_size = 0, None
    try:
        if not slots:
            return 0, None, cache
        for ids, mask in calib.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, _ = capture_residual_stream(model, ids, mask, slots=sorted(slots))
            keep = mask.bool()
            tokens += int(keep.sum())
            rows = {}
            for s in {k for k, _ in fitted} | {k + m for k, m in fitted}:
                x = streams[s].to(device)[keep].double()
                hidden_size = x.shape[1]
                rows[s] = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1) if bias else x
            for k in {k for k, _ in fitted}:
                moments.add_gram(k, rows[k])
            for k, m in fitted:
                moments.add_cross((k, m), rows[k], rows[k + m])
            for k, m in trained:
                hidden_size = streams[k].shape[-1]
                cache[(k, m)].append((streams[k], streams[k + m], keep, kw_store[k]))
    finally:
        for h in handles:
            h.remove()
    for k, m in fitted:
        w, lam, cond = ridge_toward_identity(moments.gram[k], moments.cross[(k, m)], ridge)
        h = w.shape[0] - int(bias)
        maps[(k, m, "linear")] = _LinearMap(w[:h, :h].clone(), w[h, :h].clone() if bias else None)
        fits[(k, m, "linear")] = {"lambda": lam, "condition": cond}
    return tokens, hidden_size, cache


def _eval_pass(model, blocks, evalset, probes, maps, batch_size, device, progress):
    """Score every probe on the evaluation set; returns per-probe accumulators and base NLL."""
    results = {
        (k, m, ref): {"nll": [], "sse": 0.0, "u_sq": 0.0, "u_sum": None, "tokens": 0, "seconds": 0.0}
        for k, m, ref, _ in probes
    }
    gradient_sites = sorted({k for k, _, ref, _ in probes if ref == "gradient"})
    kw_store: dict = {}
    nll0, count0 = [], []
    base_seconds = 0.0
    num_batches = math.ceil(evalset.num_prompts / batch_size)
    bar = tqdm(total=num_batches * (1 + len(probes)), desc="peeling probes", unit="probe",
               disable=not progress, dynamic_ncols=True)
    try:
        for ids, mask in evalset.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            handles = [blocks[k].register_forward_pre_hook(_kwargs_grabber(kw_store, k), with_kwargs=True)
                       for k in gradient_sites]
            t0 = time.perf_counter()
            try:
                streams, logits = capture_residual_stream(model, ids, mask, compute_logits=True)
            finally:
                for h in handles:
                    h.remove()
            nll, count = sequence_nll(logits, ids, mask)
            base_seconds += time.perf_counter() - t0
            del logits
            nll0.append(nll)
            count0.append(count)
            keep = mask.bool()
            bar.update(1)
            for k, m, ref, _ in probes:
                acc = results[(k, m, ref)]
                t1 = time.perf_counter()
                x, y = streams[k], streams[k + m].to(streams[k].device)
                hidden = maps[(k, m, ref)](x, kw_store.get(k, {}))
                logits = _substituted_logits(model, blocks, k, m, hidden, streams, ids, mask)
                nll, _ = sequence_nll(logits, ids, mask)
                acc["seconds"] += time.perf_counter() - t1
                del logits
                acc["nll"].append(nll)
                u = (y - x)[keep.to(x.device)].double()
                acc["sse"] += float((hidden.to(y.device) - y)[keep.to(y.device)].double().pow(2).sum())
                acc["u_sq"] += float(u.pow(2).sum())
                acc["u_sum"] = u.sum(0) if acc["u_sum"] is None else acc["u_sum"] + u.sum(0)
                acc["tokens"] += u.shape[0]
                bar.update(1)
            del streams
    finally:
        bar.close()
    for acc in results.values():
        acc["nll"] = torch.cat(acc["nll"])
    return results, (torch.cat(nll0), torch.cat(count0)), base_seconds
