"""Swap-KL probes over a calibration set (No Free Swap, arXiv 2605.16234).

Every probe is a layer plan (:mod:`hf_layerswap.plan`) run through the model's own
forward with ``use_cache=False``. The engine (:func:`plan_kl`) does only the work each
probe needs:

- **Prefix reuse.** For each calibration batch the identity plan runs once; it yields the
  reference next-token distribution and the residual stream entering every slot a probe
  starts at. A probe whose plan first differs from identity at slot s starts from the
  cached stream entering s. Probes that start at the same slot and run the same blocks
  first (for an adjacent pair (i, i+1): replacement i<-i+1 and the interchange both run
  block i+1 at slot i) share that computation too: their plans form a prefix tree, and
  the stream at each branch point is captured during the first probe that passes it and
  injected into the others. All of it goes through the model's own forward
  (:func:`~hf_layerswap.plan.apply_plan` with a one-shot input hook), for every
  architecture the plan module supports.
- **Streamed KL.** Probes stop at the decoder output (the normalised final hidden state)
  and only real (non-pad) positions are kept. The output head then runs on blocks of
  ``kl_chunk`` positions x ``vocab_chunk`` vocabulary entries (a slice of the head's
  weight rows), and KL(p_M || p_probe) is accumulated per position with an online
  log-sum-exp, against the reference logits of the same block:

      KL = sum_v p_v (z_ref,v - z_v) + (lse(z) - lse(z_ref)) sum_v p_v,   p = softmax(z_ref)

  (an exact rearrangement of sum_v p_v (log p_v - log q_v); differences are taken before
  products and log-sum-exps are summed in float64, so it is more accurate than fp32
  ``log_softmax`` arithmetic). Neither logits nor log-probs are ever held for a whole
  batch, let alone the calibration set: peak memory is ``O(kl_chunk * vocab_chunk)``
  plus the residual streams of one batch, while the head GEMM keeps a large row count.
  Heads that cannot be sliced (quantized, accelerate-offloaded) run whole, on fewer
  positions per block.
- **Memory budget.** ``max_memory`` (bytes or ``"1.5GB"``) sizes the vocabulary slice (or
  the position chunk), how many probes' final hidden states are held before their heads
  run, and (with ``batch_size="auto"``) the batch.
- **Reduced precision.** ``dtype=torch.bfloat16`` (or float16) runs the model under
  ``torch.autocast``; the softmax and KL stay fp32. The weights are never cast.
- **Resumable.** ``checkpoint_path`` keeps completed (batch, probe) values in a folder,
  each part written atomically; a rerun with the same model, calibration and settings
  skips them and ends with the same numbers, bit for bit.
- **Scale-out.** Models dispatched by accelerate (``device_map``, CPU/disk offload) run
  as they are. Under ``torch.distributed`` (``torchrun`` / ``accelerate launch``) every
  rank takes a disjoint share of the probes and rank results are gathered.
- **Adaptive budget.** :class:`AdaptiveBudget` adds prompts in rounds until the set
  selected at a budget is stable under paired standard errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..calibration import CalibrationSet, build_calibration, check_token_ids
from ..plan import (
    ONE_BLOCK,
    _StopForward,
    apply_plan,
    decoder_blocks,
    first_difference,
    interchange_plan,
    model_fingerprint,
    num_blocks,
    removal_plan,
    replacement_plan,
)
from ..provenance import library_versions, report_identity
from ..report import PROTOCOLS, PairResult, SwapReport, atomic_path, write_json_atomic
from ..rule import greedy_select, resolve_protect

#: Former name of :func:`hf_layerswap.provenance.report_identity` (kept as an alias).
model_identity = report_identity

__all__ = [
    "AdaptiveBudget",
    "CheckpointMismatchError",
    "library_versions",
    "masked_kl",
    "model_identity",
    "plan_kl",
    "removal_kl",
    "score_layers",
    "selection_stability",
    "swap_plans",
]

#: Positions per chunk in :func:`masked_kl` (bounds temporary memory).
KL_CHUNK_POSITIONS = 256

#: Working memory (bytes, beyond the weights) that scoring plans for when ``max_memory``
#: is not given. A fixed number, not a fraction of free memory, so that the derived chunk
#: sizes (and hence the last bits of the results) do not depend on the machine's load.
DEFAULT_MAX_MEMORY = 1 << 30

#: Largest head chunk (positions per output-head GEMM); larger ones gain nothing.
MAX_KL_CHUNK = 1024

#: Share of ``max_memory`` a head/KL block (logits, log-probabilities) may take; the rest
#: covers the held final hidden states of probe groups, activations and allocator slack.
HEAD_BUDGET_FRACTION = 0.4

#: Fewest positions per head/KL block for which the whole vocabulary is kept in one slice
#: when the default block does not fit the budget; below it the vocabulary is sliced.
MIN_WHOLE_VOCAB_CHUNK = 128

#: Bytes of one row-block of log-softmax temporaries in the KL (kept cache-sized).
_KL_SUB_BYTES = 1 << 21

CHECKPOINT_FORMAT = "hf_layerswap.ScoringCheckpoint/1"

PREFIX_REUSE_MODES = ("shared", "start", "none")


class CheckpointMismatchError(ValueError):
    """A scoring checkpoint was written by a different run (model, calibration or settings)."""


# ----------------------------------------------------------------------------- KL
def _kl_rows(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p_ref || softmax(logits)) in fp32, clamped at 0. Shapes ``(C, V)`` -> ``(C,)``."""
    lq = torch.log_softmax(logits.float(), dim=-1)  # a new tensor: the in-place steps below are safe
    # in place, (log p - log q) * p summed: the same values as the out-of-place expression, bit
    # for bit, without two more (C, V) temporaries
    return lq.neg_().add_(ref_logprobs).mul_(ref_logprobs.exp()).sum(dim=-1).clamp_min_(0.0)


def _row_blocks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, _KL_SUB_BYTES // (4 * max(1, width)))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _lse64(logits: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp of fp32 logits ``(R, V)``, computed in float64."""
    out = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)
    for a, b in _row_blocks(*logits.shape):
        z = logits[a:b].double()
        m = z.amax(dim=-1, keepdim=True)
        out[a:b] = (m + (z - m).exp_().sum(dim=-1, keepdim=True).log_()).squeeze(-1)
    return out


class _VocabKL:
    """KL(p_ref || q) per row accumulated over vocabulary slices, exactly rearranged:

    sum_v p_v (log p_v - log q_v) = sum_v p_v (z_ref,v - z_v) + (lse(z) - lse(z_ref)) sum_v p_v

    with p = softmax(z_ref). Per slice a probe needs only its logits of that slice. The
    two terms nearly cancel when the distributions are close, so p, the products and the
    log-sum-exps are float64 (the logits stay fp32): the result is the KL of the fp32
    logits to ~1e-7 relative."""

    def __init__(self, rows: int, device):
        self.dot = torch.zeros(rows, dtype=torch.float64, device=device)
        self.lse = torch.full((rows,), -math.inf, dtype=torch.float64, device=device)

    def add(self, ref_logits: torch.Tensor, ref_probs: torch.Tensor, logits: torch.Tensor) -> None:
        logits = logits.float()
        for a, b in _row_blocks(*logits.shape):
            diff = (ref_logits[a:b] - logits[a:b]).double()
            self.dot[a:b] += diff.mul_(ref_probs[a:b]).sum(dim=-1)
        self.lse = torch.logaddexp(self.lse, _lse64(logits))

    def result(self, ref_lse: torch.Tensor, ref_mass: torch.Tensor) -> torch.Tensor:
        return (self.dot + (self.lse - ref_lse) * ref_mass).clamp_min(0.0)


@torch.no_grad()
def masked_kl(ref_logprobs: torch.Tensor, logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prompt mean KL(p_ref || p_mod) over real positions, in nats.

    Args:
        ref_logprobs: ``(B, T, V)`` float32 log-softmax of the reference logits.
        logits: ``(B, T, V)`` logits of the modified model (any float dtype; promoted to fp32).
        attention_mask: ``(B, T)``, 1 = real position.

    Returns:
        ``(B,)`` float64: for each prompt, the mean over its real positions of
        sum_v p_ref(v) (log p_ref(v) - log p_mod(v)). Per-position values are clamped at
        0 (they are >= 0 in exact arithmetic). NaN/inf propagate. Positions are processed
        in chunks of :data:`KL_CHUNK_POSITIONS`; per-position values are summed per prompt
        in float64, in position order.

    Raises:
        ValueError: shape mismatch or a prompt with no real position.
    """
    if ref_logprobs.shape != logits.shape or attention_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: ref {tuple(ref_logprobs.shape)}, logits {tuple(logits.shape)}, "
            f"mask {tuple(attention_mask.shape)}"
        )
    bsz, seqlen, vocab = logits.shape
    mask = attention_mask.bool()
    counts = mask.sum(dim=1).cpu()
    if bool((counts == 0).any()):
        raise ValueError("a prompt has no real position (all padding)")
    rows = mask.reshape(-1).nonzero().squeeze(1)
    ref_flat = ref_logprobs.reshape(-1, vocab)
    mod_flat = logits.reshape(-1, vocab)
    prompt_of_row = (rows // seqlen).cpu()
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), KL_CHUNK_POSITIONS):
        idx = rows[start : start + KL_CHUNK_POSITIONS]
        kl = _kl_rows(ref_flat.index_select(0, idx), mod_flat.index_select(0, idx))
        sums.index_add_(0, prompt_of_row[start : start + KL_CHUNK_POSITIONS], kl.double().cpu())
    return sums / counts.double()


# ----------------------------------------------------------------------------- settings
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory(value) -> int:
    """Bytes from an int or a string like ``"1.5GB"``/``"800MiB"`` (decimal and binary units).

    Raises:
        ValueError: anything else, or a value below 1 MiB.
    """
    if isinstance(value, bool):
        raise ValueError(f"max_memory={value!r}: give bytes (int) or a string such as '2GB'")
    if isinstance(value, int):
        out = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_memory={value!r}: give bytes (int) or a string such as '1.5GB' or '800MiB'")
        out = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise ValueError(f"max_memory={value!r}: give bytes (int) or a string such as '2GB'")
    if out < 1 << 20:
        raise ValueError(f"max_memory={value!r} is {out} bytes: at least 1 MiB is needed")
    return out


def _resolve_prefix_reuse(value) -> str:
    if value is True:
        return "shared"
    if value is False or value is None:
        return "none"
    if value in PREFIX_REUSE_MODES:
        return value
    raise ValueError(
        f"prefix_reuse={value!r}: allowed True/'shared' (share the longest common prefix), 'start' (reuse only "
        "the identity prefix), False/'none' (every probe runs the whole model)"
    )


def _resolve_dtype(dtype, model_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype, or None to run in the model's own dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        dtype = getattr(torch, aliases.get(name, name), None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype!r}: allowed None (the model's dtype), torch.bfloat16, torch.float16, torch.float32")
    if dtype == model_dtype:
        return None
    if dtype == torch.float32:
        raise ValueError(
            f"dtype=float32 asked for a {model_dtype} model: autocast cannot raise precision; load the model in float32"
        )
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- model plumbing
def _module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device for dispatched/offloaded
    modules, else the device of its first non-meta parameter (CPU if none)."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    for sub in getattr(hook, "hooks", ()) if dev is None else ():  # accelerate's SequentialHook
        dev = getattr(sub, "execution_device", None) or dev
    if dev is not None:
        return torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _param_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _text_config(model: nn.Module):
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        try:
            return cfg.get_text_config(decoder=True)
        except TypeError:
            return cfg.get_text_config()
    return cfg


class _Head:
    """The model's output head as a function of the decoder output: ``lm_head`` plus the
    final logit soft-capping that some families apply (Gemma 2). It is checked against
    the model's own logits on the first batch (see :meth:`_Engine._reference_pass`)."""

    def __init__(self, model: nn.Module):
        self.module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.softcap = getattr(_text_config(model), "final_logit_softcapping", None)
        weight = getattr(self.module, "weight", None)
        self.vocab = int(weight.shape[0]) if weight is not None else int(_text_config(model).vocab_size)

        m = self.module
        # a plain Linear with its weight in memory can be run on vocabulary slices; quantized,
        # hooked (accelerate offload) or custom heads run whole, on position chunks
        self.sliceable = (
            isinstance(m, nn.Linear)
            and type(m).forward is nn.Linear.forward
            and not hasattr(m, "_hf_hook")
            and m.weight.device.type != "meta"
            and m.weight.is_floating_point()
        )

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capping in place (``logits`` is always the head's own fresh output)."""
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._cap(self.module(hidden))

    def into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The whole head written into ``out`` ``(R, V)`` (a reused buffer: a fresh
        position x 262k-entry tensor per probe costs its page faults again); the same
        GEMM as the module's own forward, so the same values bit for bit. Plain
        sliceable fp32 heads only."""
        w, b = self.module.weight, self.module.bias
        if b is None:
            torch.matmul(hidden, w.t(), out=out)
        else:
            torch.addmm(b, hidden, w.t(), out=out)
        return self._cap(out)

    def vocab_slice(self, hidden: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """Logits of vocabulary entries ``v0:v1`` only: ``(R, v1 - v0)``."""
        bias = self.module.bias[v0:v1] if self.module.bias is not None else None
        return self._cap(nn.functional.linear(hidden, self.module.weight[v0:v1], bias))


def _decoder_output(output) -> torch.Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0]
    return hidden


@contextlib.contextmanager
def _hooks(handles: list):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- probes
@dataclass
class _Probe:
    key: tuple[int, ...]  # the plan
    start: int  # slot the run starts at (its stream is the identity's)
    run: tuple[int, ...]  # blocks run from ``start`` on

    @property
    def cost(self) -> int:
        return len(self.run)


def _make_probes(plans: Mapping[Hashable, Sequence[int]], num_layers: int):
    """Deduplicate plans: returns (name -> key, {key: _Probe} for non-identity plans, identity keys)."""
    key_of, probes, zero = {}, {}, set()
    for name, plan in plans.items():
        key = tuple(int(p) for p in plan)
        if not key:
            raise ValueError(f"plan {name!r} is empty: a plan must run at least one block")
        for p in key:
            if not 0 <= p < num_layers:
                raise ValueError(f"plan {name!r} has block {p}: allowed 0..{num_layers - 1}")
        key_of[name] = key
        start = first_difference(key, num_layers)
        if start >= len(key) and len(key) == num_layers:
            zero.add(key)
            continue
        start = min(start, len(key) - 1)  # trailing blocks dropped: re-run the last kept one
        probes.setdefault(key, _Probe(key, start, key[start:]))
    return key_of, probes, zero


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _schedule(probes: list[_Probe], mode: str) -> list[tuple[_Probe, int, list[int]]]:
    """Execution order with prefix sharing.

    Probes are sorted by (start slot, run); in this order the probes sharing a prefix of
    their runs are contiguous, so each node of the prefix tree is needed only by a run of
    consecutive probes. Returns ``(probe, depth0, capture_depths)``: the probe starts
    ``depth0`` blocks into its run, from the stream cached at that tree node (0: the
    identity stream entering its start slot), and captures the streams entering run
    positions ``capture_depths`` for the probes after it.
    """
    if mode == "none":
        return [(p, 0, []) for p in probes]
    order = sorted(probes, key=lambda p: (p.start, p.run))
    if mode == "start":
        return [(p, 0, []) for p in order]
    out = []
    available: set[tuple[int, tuple[int, ...]]] = set()
    for n, p in enumerate(order):
        prev = order[n - 1] if n > 0 and order[n - 1].start == p.start else None
        shared = min(_lcp(prev.run, p.run), len(p.run) - 1) if prev is not None else 0
        depth0 = max((d for d in range(1, shared + 1) if (p.start, p.run[:d]) in available), default=0)
        later = [q.run for q in order[n + 1 :] if q.start == p.start]
        depths = sorted({d for d in (_lcp(p.run, r) for r in later) if depth0 < d < len(p.run)})
        available.update((p.start, p.run[:d]) for d in depths)
        out.append((p, depth0, depths))
    return out


def _shard(probes: list[_Probe], world: int, rank: int) -> list[_Probe]:
    """Deterministic, cost-balanced share of the probes for one rank. Probes with the same
    start slot and first block stay together (they share computation)."""
    if world <= 1:
        return probes
    units: dict[tuple, list[_Probe]] = {}
    for p in sorted(probes, key=lambda p: (p.start, p.run)):
        units.setdefault((p.start, p.run[0]), []).append(p)
    load = [0] * world
    mine = []
    for _, members in sorted(units.items(), key=lambda kv: (-sum(p.cost + 8 for p in kv[1]), kv[0])):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += sum(p.cost + 8 for p in members)
        if r == rank:
            mine.extend(members)
    return mine


# ----------------------------------------------------------------------------- checkpoint
def _plans_digest(keys) -> str:
    h = hashlib.sha256()
    for key in sorted(keys):
        h.update((",".join(map(str, key)) + ";").encode())
    return h.hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _Checkpoint:
    """A folder of completed (batch, probe) values: ``manifest.json`` (what run it belongs
    to) and one ``part-*.pt`` file per completed probe group of a batch, each written to a
    temporary file and renamed (a killed process leaves whole parts only)."""

    def __init__(self, path, fingerprint: dict, *, is_main: bool, barrier=None):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"checkpoint_path={str(path)!r} exists and is not a folder")
        manifest = self.path / "manifest.json"
        if is_main:
            for stale in self.path.glob(".part-*.tmp") if self.path.is_dir() else ():
                stale.unlink()  # left by a process killed while writing
            if manifest.is_file():
                self._check(manifest, fingerprint)
            else:
                self.path.mkdir(parents=True, exist_ok=True)
                write_json_atomic({"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint}, manifest)
        if barrier is not None:
            barrier()
        if not is_main:
            self._check(manifest, fingerprint)

    def _check(self, manifest: Path, fingerprint: dict) -> None:
        with open(manifest, encoding="utf-8") as fh:
            stored = json.load(fh)
        if stored.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointMismatchError(
                f"{manifest} is not a scoring checkpoint (format={stored.get('format')!r}, expected {CHECKPOINT_FORMAT!r})"
            )
        want = _flatten({k: v for k, v in fingerprint.items() if k != "info"})
        have = _flatten({k: v for k, v in stored.get("fingerprint", {}).items() if k != "info"})
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if diff:
            details = "; ".join(f"{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}" for k in diff[:6])
            raise CheckpointMismatchError(
                f"checkpoint {str(self.path)!r} was written by a different scoring run ({details}). Resume only with "
                "the same model, calibration prompts, probes and settings; use a new checkpoint_path to start over."
            )

    def load(self) -> dict[tuple[int, tuple[int, ...]], torch.Tensor]:
        done = {}
        for part in sorted(self.path.glob("part-*.pt")):
            data = torch.load(part, map_location="cpu", weights_only=True)
            batch = int(data["batch"])
            for key, row in zip(data["plans"], data["values"]):
                done[(batch, tuple(int(x) for x in key))] = row.clone()
        return done

    def save(self, batch: int, rank: int, group: int, keys: list[tuple[int, ...]], values: torch.Tensor) -> None:
        name = f"part-b{batch:06d}-r{rank:04d}-g{group:05d}.pt"
        with atomic_path(self.path / name) as tmp, open(tmp, "wb") as fh:
            torch.save({"batch": batch, "plans": [list(k) for k in keys], "values": values.cpu()}, fh)
            fh.flush()
            os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- engine
def _dist_state(distributed) -> tuple[int, int]:
    """(rank, world_size) to shard over: torch.distributed if initialised (and not
    disabled by ``distributed=False``), else (0, 1)."""
    if distributed is False:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if distributed:
        raise ValueError(
            "distributed=True but torch.distributed is not initialised: launch with torchrun/accelerate launch and "
            "call torch.distributed.init_process_group (or accelerate.PartialState()) first"
        )
    return 0, 1


class _Engine:
    """Per-batch probe execution with prefix reuse, streamed KL, budget and checkpoints."""

    def __init__(
        self,
        model: nn.Module,
        calibration: CalibrationSet,
        plans: Mapping[Hashable, Sequence[int]],
        *,
        batch_size,
        prefix_reuse,
        stream_logits: bool,
        kl_chunk: int | None,
        vocab_chunk: int | None,
        max_memory,
        dtype,
        checkpoint_path,
        distributed,
        progress: bool,
        desc: str,
    ):
        self.model = model
        self.calib = calibration
        self.num_layers = num_blocks(model)
        self.key_of, self.probes, self.zero = _make_probes(plans, self.num_layers)
        self.mode = _resolve_prefix_reuse(prefix_reuse)
        self.stream_logits = bool(stream_logits)
        self.fallback_reason = None
        self.rank, self.world = _dist_state(distributed)
        self.param_dtype = _param_dtype(model)
        self.autocast = _resolve_dtype(dtype, self.param_dtype)
        self.compute_dtype = self.autocast or self.param_dtype
        self.budget = DEFAULT_MAX_MEMORY if max_memory is None else parse_memory(max_memory)
        self.input_device = _module_device(model.get_input_embeddings())
        check_token_ids(calibration.input_ids, model, "calibration input_ids")
        self.head = _Head(model)
        owner, _, _ = decoder_blocks(model)
        self.decoder = owner if owner is not model else None
        if self.decoder is None or self.head.module is None:
            self.stream_logits = False
            self.fallback_reason = "no separate decoder module and output head to stop between"
        cfg = _text_config(model)
        self.hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        self.batch_size = self._batch_size(batch_size, cfg)
        self.kl_chunk, self.vocab_chunk = self._kl_chunks(kl_chunk, vocab_chunk)
        self.my_probes = _shard(list(self.probes.values()), self.world, self.rank)
        self.progress = progress and self.rank == 0
        self.desc = desc
        self.done: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.checkpoint = None
        self.resumed = 0
        if checkpoint_path is not None:
            self.checkpoint = _Checkpoint(
                checkpoint_path, self.fingerprint(), is_main=self.rank == 0, barrier=self._barrier
            )
            self.done = self.checkpoint.load()
            self.resumed = len(self.done)
        self.computed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.stats = {"block_evaluations": 0, "model_calls": 0, "head_rows": 0, "reference_passes": 0}
        self.seconds = 0.0
        self.batches = list(range(math.ceil(calibration.num_prompts / self.batch_size)))
        self.verified_head = False
        self._logit_buf: torch.Tensor | None = None

    # -- sizing -----------------------------------------------------------------------
    def _activation_bytes(self, bsz: int, cfg) -> int:
        seq = self.calib.seq_len
        es = torch.finfo(self.compute_dtype).bits // 8
        inter = int(getattr(cfg, "intermediate_size", 4 * self.hidden) or 4 * self.hidden)
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        streams = (self.num_layers + 1) * bsz * seq * self.hidden * es
        forward = bsz * seq * (8 * self.hidden + 3 * inter) * es + bsz * heads * seq * seq * 4
        logits = 0 if self.stream_logits else 3 * bsz * seq * self.head.vocab * 4
        return streams + forward + logits

    def _batch_size(self, batch_size, cfg) -> int:
        if batch_size == "auto":
            cap = min(64, self.calib.num_prompts)
            best = 1
            for b in range(1, cap + 1):
                if self._activation_bytes(b, cfg) <= self.budget // 2:
                    best = b
            return best
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1 or 'auto'")
        return batch_size

    def _kl_chunks(self, kl_chunk, vocab_chunk) -> tuple[int, int]:
        """(positions, vocabulary entries) per head/KL block, kept under
        :data:`HEAD_BUDGET_FRACTION` of the budget:
        one slice (the whole vocabulary) holds reference log-probs and probe logits, 8
        bytes per position and entry; several hold fp32 reference logits, float64
        reference probabilities and fp32 probe logits, 16 bytes."""
        for name, v in (("kl_chunk", kl_chunk), ("vocab_chunk", vocab_chunk)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}: must be an int >= 1")
        vocab = self.head.vocab
        head_budget = int(HEAD_BUDGET_FRACTION * self.budget)
        rows = kl_chunk or min(MAX_KL_CHUNK, self.batch_size * self.calib.seq_len)
        if self.head.sliceable:
            if vocab_chunk is None:
                fit = head_budget // (8 * vocab)  # positions whose whole-vocabulary block fits
                if 8 * rows * vocab <= head_budget:
                    vocab_chunk = vocab
                elif kl_chunk is None and fit >= MIN_WHOLE_VOCAB_CHUNK:
                    # fewer positions, whole vocabulary: one head GEMM and one fp32 log-softmax per
                    # block, the arithmetic of the naive computation, instead of two passes over slices
                    rows, vocab_chunk = fit, vocab
                else:
                    width = max(1, head_budget // (16 * rows))
                    vocab_chunk = math.ceil(vocab / math.ceil(vocab / width))
            return rows, min(vocab, vocab_chunk)
        if vocab_chunk is not None and vocab_chunk < vocab:
            raise ValueError(
                f"vocab_chunk={vocab_chunk} needs a plain nn.Linear output head with its weight in memory; "
                f"this model's head ({type(self.head.module).__name__}) runs whole"
            )
        if kl_chunk is None:  # the whole vocabulary at once: fewer positions per block
            rows = max(1, min(rows, head_budget // (8 * vocab)))
        return rows, vocab

    def _group_size(self, real_rows: int) -> int:
        """Probes whose final hidden states are held before their heads run."""
        es = torch.finfo(self.compute_dtype).bits // 8
        per_probe = max(1, real_rows * self.hidden * es)
        return max(1, int(0.25 * self.budget) // per_probe)

    # -- provenance -----------------------------------------------------------------
    def settings(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "compute_dtype": _dtype_name(self.compute_dtype),
            "autocast": self.autocast is not None,
            "softmax_dtype": "float32",
            "stream_logits": self.stream_logits,
            "kl_chunk_positions": self.kl_chunk if self.stream_logits else KL_CHUNK_POSITIONS,
            "kl_chunk_vocab": self.vocab_chunk if self.stream_logits else self.head.vocab,
            "kl_streaming": self.kl_streaming,
        }

    @property
    def kl_streaming(self) -> str:
        if not self.stream_logits:
            return "model logits (B, T, V), positions in chunks"
        if self.vocab_chunk >= self.head.vocab:
            return "position chunks, whole vocabulary, fp32 log-softmax"
        return "position chunks x vocabulary slices, float64 online log-sum-exp"

    def fingerprint(self) -> dict:
        return {
            "model": {
                "class": type(self.model).__name__,
                "num_blocks": self.num_layers,
                "fingerprint": model_fingerprint(self.model),
            },
            "calibration": {
                "content_hash": self.calib.content_hash,
                "num_prompts": self.calib.num_prompts,
                "seq_len": self.calib.seq_len,
            },
            "probes": {"count": len(self.probes), "plans_sha256": _plans_digest(self.probes)},
            "settings": self.settings(),
            "libraries": {"torch": torch.__version__, "transformers": library_versions()["transformers"]},
            "info": {"model": model_identity(self.model), "calibration": self.calib.description},
        }

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.input_device.type, dtype=self.autocast)

    # -- passes -------------------------------------------------------------------------
    def _reference_pass(self, ids, mask, slots: set[int], rows: torch.Tensor):
        """Identity forward: streams entering ``slots`` and the final hidden state (or the
        reference log-probs when not streaming)."""
        _, _, blocks = decoder_blocks(self.model)
        streams: dict[int, torch.Tensor] = {}
        final: dict[str, torch.Tensor] = {}
        handles = []
        verify = self.stream_logits and not self.verified_head

        def pre_hook(slot):
            def hook(module, args, kwargs):
                streams[slot] = (args[0] if args else kwargs["hidden_states"]).detach()

            return hook

        for s in sorted(slots):
            handles.append(blocks[s].register_forward_pre_hook(pre_hook(s), with_kwargs=True))
        if self.stream_logits:

            def dec_hook(module, args, output):
                final["hidden"] = _decoder_output(output).detach()
                if not verify:
                    raise _StopForward

            handles.append(self.decoder.register_forward_hook(dec_hook))
        logits = None
        with _hooks(handles), self._autocast():
            kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
            try:
                if verify:
                    try:
                        logits = self.model(**kwargs, logits_to_keep=1).logits
                    except TypeError:
                        logits = self.model(**kwargs).logits[:, -1:]
                else:
                    logits = self.model(**kwargs).logits
            except _StopForward:
                pass
        self.stats["model_calls"] += 1
        self.stats["block_evaluations"] += self.num_layers
        self.stats["reference_passes"] += 1
        if not self.stream_logits:
            return streams, torch.log_softmax(logits.float(), dim=-1)
        hidden = final["hidden"]
        if verify:
            self._verify_head(hidden[:, -1:], logits)
            if not self.stream_logits:  # the check failed: recompute the reference the slow way
                return self._reference_pass(ids, mask, slots, rows)
        return streams, hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))

    def _verify_head(self, last_hidden, model_logits) -> None:
        rows = last_hidden.reshape(-1, last_hidden.shape[-1])
        bounds = _chunk_bounds(self.head.vocab, self.vocab_chunk)
        ours = torch.cat([self._logits(rows, v0, v1) for v0, v1 in bounds], dim=-1)
        ours = ours.reshape(*last_hidden.shape[:-1], -1)
        theirs = model_logits.float().to(ours.device)
        scale = 1.0 + float(theirs.abs().max())
        tol = 1e-4 if self.compute_dtype == torch.float32 else 2e-2
        if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tol * scale:
            self.stream_logits = False
            self.fallback_reason = (
                "the output head applied to the decoder output did not reproduce the model's logits; "
                "using the model's own full logits instead (more memory)"
            )
            warnings.warn(f"hf_layerswap scoring: {self.fallback_reason}", stacklevel=3)
        self._logit_buf = None
        self.verified_head = True

    def _probe_pass(self, probe: _Probe, depth0: int, start_hidden, ids, mask, captures: list[int]):
        """Run ``probe`` from ``depth0`` blocks into its run; returns (final hidden or
        logits, {depth: stream entering that run position})."""
        _, _, blocks = decoder_blocks(self.model)
        slot = probe.start + depth0
        plan = list(probe.key)
        kwargs = {"start": slot, "start_hidden": start_hidden} if slot > 0 else {}
        captured: dict[int, torch.Tensor] = {}
        final: dict[str, torch.Tensor] = {}
        handles = []
        with apply_plan(self.model, plan, **kwargs):
            if captures:
                counter = {"pos": depth0}
                wanted = set(captures)

                def count_hook(module, args, kwargs_):
                    pos = counter["pos"]
                    if pos in wanted:
                        captured[pos] = (args[0] if args else kwargs_["hidden_states"]).detach()
                    counter["pos"] = pos + 1

                for b in dict.fromkeys(probe.run[depth0:]):
                    handles.append(blocks[b].register_forward_pre_hook(count_hook, with_kwargs=True))
            if self.stream_logits:

                def dec_hook(module, args, output):
                    final["hidden"] = _decoder_output(output).detach()
                    raise _StopForward

                handles.append(self.decoder.register_forward_hook(dec_hook))
            out = None
            with _hooks(handles), self._autocast():
                try:
                    out = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                except _StopForward:
                    pass
        self.stats["model_calls"] += 1
        self.stats["block_evaluations"] += len(probe.key) - slot
        return (final["hidden"] if self.stream_logits else out), captured

    def _head_phase(self, ref_hidden, hiddens: list[torch.Tensor], prompt_of_row, counts, bsz,
                    done=None) -> list[torch.Tensor]:
        """Per-prompt mean KL for each probe's final hidden rows ``(R, H)``; ``done(n)`` is
        told the head rows each chunk ran (for the progress bar)."""
        sums = [torch.zeros(bsz, dtype=torch.float64) for _ in hiddens]
        for a, b in _chunk_bounds(ref_hidden.shape[0], self.kl_chunk):
            kls = self._kl_block(ref_hidden[a:b], [h[a:b] for h in hiddens], done or (lambda n: None))
            idx = prompt_of_row[a:b]
            for n, kl in enumerate(kls):
                sums[n].index_add_(0, idx, kl.double().cpu())
        self._logit_buf = None  # reused within the head phase only: the probe forwards need the memory
        return [s / counts for s in sums]

    def _logits(self, hidden, v0: int, v1: int) -> torch.Tensor:
        """fp32 logits of vocabulary entries ``v0:v1``: for the whole vocabulary of a plain
        fp32 head, the same GEMM as the head module's, written into the engine's reused
        buffer (the result is valid until the next call); otherwise the model's own head
        module (or its weight slice)."""
        whole = v0 == 0 and v1 == self.head.vocab
        if whole and self._buffered_head(hidden):
            rows = hidden.shape[0]
            if self._logit_buf is None or self._logit_buf.shape[0] < rows:
                self._logit_buf = None  # free the smaller one first
                self._logit_buf = torch.empty(rows, self.head.vocab, dtype=torch.float32, device=hidden.device)
            return self.head.into(hidden, self._logit_buf[:rows])
        with self._autocast():
            out = self.head(hidden) if whole else self.head.vocab_slice(hidden, v0, v1)
        return out.float()

    def _buffered_head(self, hidden) -> bool:
        """Whole-vocabulary fp32 logits can go to one reused buffer (each result is consumed
        before the next is made): a plain fp32 ``nn.Linear`` head on the hidden states'
        device, with no forward hooks and a plain tensor weight, and no autocast."""
        m = self.head.module
        w = getattr(m, "weight", None)
        return (self.head.sliceable and self.autocast is None and hidden.dtype == torch.float32
                and type(w.data) is torch.Tensor and w.dtype == torch.float32 and w.device == hidden.device
                and not m._forward_hooks and not m._forward_pre_hooks)

    def _kl_block(self, ref_rows, rows, done) -> list[torch.Tensor]:
        """Per-position KL of each probe over a block of positions; ``done(n)`` is told
        after each head GEMM how many whole-vocabulary head rows it was worth.

        With the whole vocabulary in one slice this is :func:`masked_kl`'s arithmetic (fp32
        log-softmax); with several slices, :class:`_VocabKL` (float64 accumulation, equal
        to it within the fp32 log-softmax's own rounding)."""
        bounds = _chunk_bounds(self.head.vocab, self.vocab_chunk)
        if len(bounds) == 1:
            self.stats["head_rows"] += ref_rows.shape[0] * (1 + len(rows))
            ref_lp = torch.log_softmax(self._logits(ref_rows, 0, self.head.vocab), dim=-1)
            done(ref_rows.shape[0])
            out = []
            for h in rows:
                logits = self._logits(h, 0, self.head.vocab)
                kl = torch.empty(logits.shape[0], device=logits.device)
                for a, b in _row_blocks(*logits.shape):
                    kl[a:b] = _kl_rows(ref_lp[a:b], logits[a:b])
                out.append(kl)
                done(ref_rows.shape[0])
                del logits  # else the next probe's logits are made while these are still held
            return out
        self.stats["head_rows"] += ref_rows.shape[0] * (2 + len(rows))
        # pass 1: the reference log-sum-exp over the whole vocabulary
        ref_lse = torch.logsumexp(torch.stack([_lse64(self._logits(ref_rows, v0, v1)) for v0, v1 in bounds]), dim=0)
        done(ref_rows.shape[0])
        mass = torch.zeros_like(ref_lse)
        acc = [_VocabKL(ref_rows.shape[0], ref_rows.device) for _ in rows]
        for v0, v1 in bounds:  # pass 2: every probe against the same reference slice
            share = ref_rows.shape[0] * (v1 - v0) / self.head.vocab
            z_ref = self._logits(ref_rows, v0, v1)
            probs = torch.empty(z_ref.shape, dtype=torch.float64, device=z_ref.device)
            for a, b in _row_blocks(*z_ref.shape):
                probs[a:b] = (z_ref[a:b].double() - ref_lse[a:b].unsqueeze(-1)).exp_()
            mass += probs.sum(dim=-1)
            done(share)
            for n, h in enumerate(rows):
                acc[n].add(z_ref, probs, self._logits(h, v0, v1))
                done(share)
            del z_ref, probs
        return [a.result(ref_lse, mass) for a in acc]

    # -- main loop ----------------------------------------------------------------------
    # -- progress, in the units of the work -------------------------------------------
    def _head_blocks(self) -> float:
        """What one output-head pass over a batch's positions costs in block passes:
        ``V * H`` multiply-adds per position against a block's parameter count (its
        multiply-adds per position, attention scores aside)."""
        if not hasattr(self, "_head_ratio"):
            _, _, blocks = decoder_blocks(self.model)
            params = sum(p.numel() for p in blocks[0].parameters())
            self._head_ratio = self.head.vocab * self.hidden / max(params, 1)
        return self._head_ratio

    def _batch_work(self, b: int, probes: Sequence[_Probe]) -> float:
        """Block passes (a block over the batch; head work converted, :meth:`_head_blocks`)
        that ``probes`` and the reference pass cost on batch ``b``: what the bar counts."""
        ids, mask = self._batch(b)
        positions = ids.numel()
        cache = self.__dict__.setdefault("_blocks_of", {})
        key = tuple(p.key for p in probes)
        if key not in cache:  # the schedule is the same for every batch
            cache[key] = sum(len(p.key) - (0 if self.mode == "none" else p.start + depth0)
                             for p, depth0, _ in _schedule(list(probes), self.mode))
        work = float(self.num_layers + cache[key])
        if not self.stream_logits:
            return work + self._head_blocks() * (1 + len(probes))
        rows = int(mask.sum())
        passes = 1 if len(_chunk_bounds(self.head.vocab, self.vocab_chunk)) == 1 else 2
        refs = math.ceil(len(probes) / self._group_size(rows)) * passes
        return work + self._head_blocks() * rows / positions * (refs + len(probes))

    def run_batches(self, batch_indices: Sequence[int]) -> None:
        """Compute (or take from the checkpoint) every probe of this rank on those batches.

        The progress bar counts block passes (one decoder block over one batch; output-head
        work converted by :meth:`_head_blocks`) and moves after every block's forward (a
        hook on each block while the bar is shown) and every head/KL chunk, so its rate and
        ETA follow the work actually done."""
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        total = sum(self._batch_work(b, self.my_probes) for b in batch_indices)
        bar = _WorkBar(total, self.desc, self.progress)
        _, _, blocks = decoder_blocks(self.model)
        counting = [blk.register_forward_hook(lambda *_: bar.advance(1)) for blk in blocks] if self.progress else []
        try:
            with torch.no_grad(), _hooks(counting):
                for b in batch_indices:
                    self._run_batch(b, bar)
        finally:
            bar.close()
            self.model.train(was_training)
            self.seconds += time.perf_counter() - t0

    def _batch(self, b: int):
        lo = b * self.batch_size
        ids = self.calib.input_ids[lo : lo + self.batch_size]
        mask = self.calib.attention_mask[lo : lo + self.batch_size]
        width = int(mask.sum(dim=1).max())
        return ids[:, :width], mask[:, :width]

    def _run_batch(self, b: int, bar) -> None:
        todo = [p for p in self.my_probes if (b, p.key) not in self.done]
        end = bar.pos + self._batch_work(b, self.my_probes)
        if not todo:
            bar.reach(end)
            return
        bar.advance(self._batch_work(b, self.my_probes) - self._batch_work(b, todo))  # resumed from the checkpoint
        ids, mask = self._batch(b)
        bsz, seqlen = ids.shape
        ids, mask = ids.to(self.input_device), mask.to(self.input_device)
        mask_cpu = mask.bool().cpu()
        counts = mask_cpu.sum(dim=1).double()
        rows = mask_cpu.reshape(-1).nonzero().squeeze(1)
        prompt_of_row = rows // seqlen
        slots = {p.start for p in todo} if self.mode != "none" else set()
        slots.discard(0)
        streams, ref = self._reference_pass(ids, mask, slots, rows)
        head = self._head_blocks()
        if not self.stream_logits:  # the model's own head ran inside the pass
            bar.advance(head)
        schedule = _schedule(todo, self.mode)
        group = self._group_size(rows.numel()) if self.stream_logits else len(schedule)
        nodes: dict[tuple, torch.Tensor] = {}
        pending: list[tuple[_Probe, torch.Tensor]] = []
        group_no = 0

        def flush():
            nonlocal group_no
            if not pending:
                return
            if self.stream_logits:
                values = self._head_phase(ref, [h for _, h in pending], prompt_of_row, counts, bsz,
                                          lambda n: bar.advance(head * n / (bsz * seqlen)))
            else:
                values = [h for _, h in pending]
            keys = [p.key for p, _ in pending]
            for key, v in zip(keys, values):
                self.computed[(b, key)] = v
            if self.checkpoint is not None:
                self.checkpoint.save(b, self.rank, group_no, keys, torch.stack(values))
            group_no += 1
            pending.clear()

        for n, (probe, depth0, captures) in enumerate(schedule):
            if depth0 > 0:
                start_hidden = nodes[(probe.start, probe.run[:depth0])]
            elif probe.start > 0 and self.mode != "none":
                start_hidden = streams[probe.start]
            else:
                start_hidden = None
            if self.mode == "none":
                out, captured = self._probe_pass(_Probe(probe.key, 0, probe.key), 0, None, ids, mask, [])
            else:
                out, captured = self._probe_pass(probe, depth0, start_hidden, ids, mask, captures)
            if not self.stream_logits:
                bar.advance(head)
            for d, stream in captured.items():
                nodes[(probe.start, probe.run[:d])] = stream
            # keep only the tree nodes the next probe can start from (sorted order: no later one needs others)
            nxt = schedule[n + 1][0] if n + 1 < len(schedule) else None
            nodes = {
                k: v for k, v in nodes.items()
                if nxt is not None and k[0] == nxt.start and nxt.run[: len(k[1])] == k[1]
            }
            if self.stream_logits:
                pending.append((probe, out.reshape(-1, out.shape[-1]).index_select(0, rows.to(out.device))))
            else:
                pending.append((probe, masked_kl(ref, out, mask)))
            del out
            if len(pending) >= group:
                flush()
        flush()
        bar.reach(end)  # float rounding aside, this is where the batch's work took it already

    # -- results -------------------------------------------------------------------------
    def gather(self) -> None:
        """Share computed values between ranks (every rank ends with all of them)."""
        if self.world <= 1:
            return
        local = {k: v.cpu() for k, v in self.computed.items()}
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (local, self.stats, self.seconds))
        stats = {k: 0 for k in self.stats}
        for part_values, part_stats, _ in parts:
            self.computed.update(part_values)
            for k in stats:
                stats[k] += part_stats[k]
        self.gathered_stats = stats
        self.seconds_max = max(p[2] for p in parts)

    def values(self, batch_indices: Sequence[int]) -> dict[Hashable, torch.Tensor]:
        out = {}
        cache: dict[tuple[int, ...], torch.Tensor] = {}
        for name, key in self.key_of.items():
            if key not in cache:
                parts = []
                for b in batch_indices:
                    if key in self.zero:
                        ids, _ = self._batch(b)
                        parts.append(torch.zeros(ids.shape[0], dtype=torch.float64))
                    else:
                        v = self.computed.get((b, key))
                        if v is None:
                            v = self.done[(b, key)]
                        parts.append(v)
                cache[key] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
            out[name] = cache[key]
        return out

    def summary(self, batch_indices: Sequence[int]) -> dict:
        stats = dict(getattr(self, "gathered_stats", self.stats))
        seconds = getattr(self, "seconds_max", self.seconds)
        out = {
            "forward_passes": 1 + len(self.key_of),
            "block_evaluations": stats["block_evaluations"],
            "model_calls": stats["model_calls"],
            "head_rows": stats["head_rows"],
            "seconds": seconds,
            "prefix_reuse": self.mode,
            "max_memory": self.budget,
            "world_size": self.world,
            "distinct_probes": len(self.probes),
            **self.settings(),
        }
        if self.fallback_reason:
            out["stream_logits_note"] = self.fallback_reason
        if self.checkpoint is not None:
            out["checkpoint"] = {"resumed_values": self.resumed}
        return out


def _chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    """``ceil(total / chunk)`` contiguous ranges of near-equal length (none longer than
    ``chunk``), so no small remainder chunk runs the head GEMM inefficiently."""
    n = max(1, math.ceil(total / chunk))
    edges = [round(k * total / n) for k in range(n + 1)]
    return [(edges[k], edges[k + 1]) for k in range(n) if edges[k + 1] > edges[k]]


class _WorkBar:
    """A tqdm bar over a float amount of work shown in whole units: fractions (head/KL
    chunks) are carried until they add up to a unit."""

    def __init__(self, total: float, desc: str, enabled: bool, unit: str = "block pass"):
        self.bar = tqdm(total=round(total), desc=desc, unit=f" {unit}", disable=not enabled, dynamic_ncols=True,
                        leave=None)
        self.pos = 0.0

    def advance(self, amount: float) -> None:
        self.pos += amount
        step = min(round(self.pos), self.bar.total) - self.bar.n  # never past the total, never back
        if step > 0:
            self.bar.update(step)

    def reach(self, pos: float) -> None:
        self.advance(pos - self.pos)

    def close(self) -> None:
        self.bar.close()


@torch.no_grad()
def plan_kl(
    model: nn.Module,
    calibration: CalibrationSet,
    plans: Mapping[Hashable, Sequence[int]],
    *,
    batch_size: int | str = 8,
    progress: bool = False,
    desc: str = "swap-KL",
    prefix_reuse: bool | str = True,
    stream_logits: bool = True,
    kl_chunk: int | None = None,
    vocab_chunk: int | None = None,
    max_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    distributed: bool | None = None,
) -> tuple[dict[Hashable, torch.Tensor], dict]:
    """Per-prompt KL(p_M || p_plan) for every plan: the probe engine.

    Args:
        model: a causal LM with L decoder blocks (accelerate-dispatched models included).
        calibration: the prompts (:func:`~hf_layerswap.calibration.build_calibration`).
        plans: probe name -> block plan (see :mod:`hf_layerswap.plan`). Equal plans are
            computed once; the identity plan gives exactly 0 without running.
        batch_size: prompts per forward pass, or ``"auto"`` (the largest, up to 64, whose
            estimated activations fit half of ``max_memory``).
        prefix_reuse: ``True``/``"shared"`` (default): start every probe at its first
            changed slot from the cached identity stream and share longer common prefixes
            between probes; ``"start"``: only the former; ``False``/``"none"``: every
            probe runs the whole model (for checks: the numbers are identical).
        stream_logits: ``True`` (default): stop at the decoder output and run the head
            and KL in blocks of real positions x vocabulary entries; ``False``: take the
            model's own full ``(B, T, V)`` logits and :func:`masked_kl` (more memory).
        kl_chunk: real positions per head/KL block. Default: ``min(1024, batch_size *
            seq_len)``; when that block of the whole vocabulary (8 bytes per position and
            entry) exceeds ``0.4 * max_memory``, the most positions that fit, if at least
            :data:`MIN_WHOLE_VOCAB_CHUNK` (always, for a head that cannot be sliced).
        vocab_chunk: vocabulary entries per block (sliceable heads only). Default: the
            whole vocabulary, unless even :data:`MIN_WHOLE_VOCAB_CHUNK` positions of it do
            not fit (or ``kl_chunk`` is given); then the vocabulary split into the fewest
            equal slices with ``16 * kl_chunk * vocab_chunk <= 0.4 * max_memory`` bytes
            (:data:`HEAD_BUDGET_FRACTION`).
        max_memory: working-memory budget in bytes (or ``"1.5GB"``) beyond the weights;
            default :data:`DEFAULT_MAX_MEMORY` (1 GiB).
        dtype: ``None`` (the model's dtype) or ``torch.bfloat16``/``torch.float16`` to run
            under ``torch.autocast``; softmax and KL are always fp32.
        checkpoint_path: folder for resumable runs (see :func:`score_layers`).
        distributed: ``None``: shard probes over ranks when torch.distributed is
            initialised; ``False``: never; ``True``: require it.

    Returns:
        ``(values, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of per-prompt
        mean KL in nats; ``stats`` has ``forward_passes`` (calibration-set sweeps: one
        reference plus one per plan), ``block_evaluations`` (block forward calls over all
        batches), ``model_calls``, ``head_rows`` (positions through the output head),
        ``seconds`` and the settings used.

    Raises:
        ValueError: a bad plan, batch size, chunk, memory or dtype value.
        CheckpointMismatchError: ``checkpoint_path`` holds another run's checkpoint.

    The model is left exactly as it was (blocks, ``layer_idx``, config, train/eval mode).
    """
    engine = _Engine(
        model, calibration, plans, batch_size=batch_size, prefix_reuse=prefix_reuse, stream_logits=stream_logits,
        kl_chunk=kl_chunk, vocab_chunk=vocab_chunk, max_memory=max_memory, dtype=dtype, checkpoint_path=checkpoint_path,
        distributed=distributed, progress=progress, desc=desc,
    )
    engine.run_batches(engine.batches)
    engine.gather()
    return engine.values(engine.batches), engine.summary(engine.batches)


# ----------------------------------------------------------------------------- scoring
def _mean_se(values: torch.Tensor) -> tuple[float, float | None]:
    mean = float(values.mean())
    if values.numel() < 2 or not math.isfinite(mean):
        return mean, None
    return mean, float(values.std(unbiased=True) / math.sqrt(values.numel()))


def _pair_list(num_layers: int, max_gap: int) -> list[tuple[int, int]]:
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or not 1 <= max_gap <= num_layers - 1:
        raise ValueError(f"max_gap={max_gap!r}: allowed 1..{num_layers - 1} (L-1 = all pairs) for {num_layers} blocks")
    return [(i, j) for i in range(num_layers) for j in range(i + 1, min(num_layers, i + max_gap + 1))]


def swap_plans(num_layers: int, max_gap: int = 1, protocols: Sequence[str] = PROTOCOLS) -> dict[tuple, list[int]]:
    """The probes of a swap sweep: ``{(kind, i, j): plan}`` for every pair
    ``1 <= j - i <= max_gap`` with kind ``replacement_ij`` (slot i runs block j),
    ``replacement_ji`` (slot j runs block i) and/or ``interchange``.

    Raises:
        ValueError: ``max_gap`` outside ``1..L-1`` or an unknown protocol.
    """
    if any(p not in PROTOCOLS for p in protocols):
        raise ValueError(f"protocols={tuple(protocols)!r}: allowed a non-empty subset of {list(PROTOCOLS)}")
    plans: dict[tuple, list[int]] = {}
    for i, j in _pair_list(num_layers, max_gap):
        if "replacement" in protocols:
            plans[("replacement_ij", i, j)] = replacement_plan(num_layers, i, j)
            plans[("replacement_ji", i, j)] = replacement_plan(num_layers, j, i)
        if "interchange" in protocols:
            plans[("interchange", i, j)] = interchange_plan(num_layers, i, j)
    return plans


def _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed) -> CalibrationSet:
    if tokenizer is None and not isinstance(calibration, (Mapping, CalibrationSet)):
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    return build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)


@dataclass
class AdaptiveBudget:
    """Add calibration prompts in rounds until the selection at a budget is stable.

    After each round the layers are selected as :func:`~hf_layerswap.select_layers`
    would (``num_layers``, ``protocol``, ``spacing``, ``protect``); the selection is
    *stable* when no single exchange of a selected layer a for an unselected eligible
    layer b (one the spacing rule would allow in a's place) is within the error bars:
    the paired per-prompt difference s_b(x) - s_a(x) has mean > ``z`` x its standard
    error (see :func:`selection_stability`). Scoring stops at the first stable round or
    when ``num_prompts`` of :func:`score_layers` (the maximum) is reached; the rounds and
    the reason are recorded in ``report.metadata["adaptive"]``.

    Attributes:
        num_layers: the removal budget n.
        protocol: ``"interchange"`` or ``"replacement"`` (must be scored).
        spacing, protect: the selection rule (see :func:`~hf_layerswap.select_layers`).
        z: error-bar width in standard errors (2.0 ~ 95 %).
        min_prompts: prompts in the first round; step: prompts added per round. Both are
            rounded up to whole batches, so the batches equal those of a full run and an
            adaptive run that reaches the maximum gives the full run's numbers.
    """

    num_layers: int
    protocol: str = "interchange"
    spacing: int = 1
    protect: tuple[int, ...] = (0, -1)
    z: float = 2.0
    min_prompts: int = 16
    step: int = 16

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"AdaptiveBudget protocol={self.protocol!r}: allowed {list(PROTOCOLS)}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"AdaptiveBudget num_layers={self.num_layers!r}: must be an int >= 1")
        if not (isinstance(self.z, (int, float)) and math.isfinite(self.z) and self.z > 0):
            raise ValueError(f"AdaptiveBudget z={self.z!r}: must be a finite number > 0")
        for name in ("min_prompts", "step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "min_prompts" else 1):
                raise ValueError(f"AdaptiveBudget {name}={v!r}: must be an int >= {2 if name == 'min_prompts' else 1}")
        self.protect = tuple(self.protect)


def _layer_choices(report: SwapReport, protocol: str) -> list[tuple | None]:
    """For each layer, the probe whose mean defines s(i): ``(kind, i, j)`` or None."""
    best: list[tuple | None] = [None] * report.num_layers
    best_val = [math.inf] * report.num_layers
    for r in report.pairs:
        if protocol == "interchange":
            val, kind = r.interchange, "interchange"
        else:
            a, b = r.replacement_ij, r.replacement_ji
            if a is None or b is None:
                continue
            val = r.replacement
            kind = "replacement_ij" if (math.isnan(a) or (not math.isnan(b) and a >= b)) else "replacement_ji"
        if val is None or math.isnan(val):
            continue
        for layer in (r.i, r.j):
            if val < best_val[layer]:
                best_val[layer], best[layer] = val, (kind, r.i, r.j)
    return best


def selection_stability(
    report: SwapReport,
    values: Mapping[tuple, torch.Tensor],
    num_layers: int,
    *,
    protocol: str = "interchange",
    spacing: int = 1,
    protect: Sequence[int] = (0, -1),
    z: float = 2.0,
) -> dict:
    """Is the set selected at budget ``num_layers`` distinguishable from its alternatives?

    Args:
        report: the swap-KL report (pair means).
        values: per-prompt probe values ``{(kind, i, j): (N,) tensor}`` with kind in
            ``replacement_ij``, ``replacement_ji``, ``interchange`` (what
            :func:`score_layers` computes).
        num_layers, protocol, spacing, protect: the selection rule.
        z: error-bar width in standard errors.

    Returns:
        ``{"selected", "stable", "closest"}``: ``closest`` is the exchange (selected a,
        alternative b) with the smallest ``margin / se`` of the paired difference
        s_b(x) - s_a(x), with ``margin`` and ``se`` in nats (None if no alternative).
        Stable means every such exchange has ``margin > z * se``. With fewer than 2
        prompts nothing is stable.
    """
    scores = report.layer_scores(protocol)
    selected = greedy_select(scores, num_layers, spacing=spacing, protect=protect)
    protected = resolve_protect(protect, report.num_layers)
    choice = _layer_choices(report, protocol)
    closest, stable = None, True
    for b in range(report.num_layers):
        if b in selected or b in protected or scores[b] is None or not math.isfinite(scores[b]) or choice[b] is None:
            continue
        for a in selected:
            rest = [k for k in selected if k != a]
            if any(abs(b - k) <= spacing for k in rest):
                continue
            diff = values[choice[b]] - values[choice[a]]
            margin = float(diff.mean())
            se = float(diff.std(unbiased=True) / math.sqrt(diff.numel())) if diff.numel() > 1 else math.inf
            ratio = margin / se if se > 0 else (math.inf if margin > 0 else -math.inf)
            if not (margin > z * se):
                stable = False
            if closest is None or ratio < closest["ratio"]:
                closest = {"selected": a, "alternative": b, "margin": margin, "se": se, "ratio": ratio}
    if closest is not None:
        closest.pop("ratio")
    return {"selected": selected, "stable": stable, "closest": closest}


def _build_report(num_layers, pairs, protocols, max_gap, values) -> list[PairResult]:
    results = []
    for i, j in pairs:
        kw = {}
        for kind in ("replacement_ij", "replacement_ji", "interchange"):
            if (kind, i, j) in values:
                kw[kind], kw[f"{kind}_se"] = _mean_se(values[(kind, i, j)])
        results.append(PairResult(i, j, **kw))
    return results


def _prefix_calibration(calib: CalibrationSet, n: int) -> CalibrationSet:
    if n >= calib.num_prompts:
        return calib
    return CalibrationSet(
        calib.input_ids[:n].clone(),
        calib.attention_mask[:n].clone(),
        f"{calib.description}; first {n} of {calib.num_prompts} prompts (adaptive budget)",
        calib.add_special_tokens,
        calib.texts[:n] if calib.texts is not None else None,
        shortfall=calib.shortfall,
    )


def score_layers(
    model: nn.Module,
    calibration=None,
    *,
    tokenizer=None,
    protocols: Sequence[str] = PROTOCOLS,
    max_gap: int = 1,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int | str = 8,
    progress: bool = True,
    seed: int = 0,
    prefix_reuse: bool | str = True,
    stream_logits: bool = True,
    kl_chunk: int | None = None,
    vocab_chunk: int | None = None,
    max_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    adaptive: AdaptiveBudget | None = None,
    distributed: bool | None = None,
) -> SwapReport:
    """Score block pairs with the replacement and/or interchange swap-KL.

    Implements No Free Swap (arXiv 2605.16234) Def. 1 / Remark 1: for each pair
    ``1 <= j - i <= max_gap``, replacement runs two probes (slot i runs block j; slot j
    runs block i) and interchange one (slots i and j exchange blocks). Each value is
    E_x KL(p_M || p_probe) in nats: the mean over real tokens of each prompt, then over
    prompts, from fp32 log-softmax, temperature 1. Each value has a standard error over
    prompts (``*_se``).

    Args:
        model: a transformers causal LM (decoder-only; multimodal text towers included;
            accelerate-dispatched with ``device_map``, CPU/disk offload included).
        calibration: ``None``/``"embedded"`` (default prose shipped with Python), a text
            file path, a list of strings, a ``datasets.Dataset`` with a text column, a
            mapping with ``input_ids``/``attention_mask`` ``(B, T)`` long tensors, or a
            :class:`~hf_layerswap.calibration.CalibrationSet`.
        tokenizer: required for text sources.
        protocols: any of ``("replacement", "interchange")``.
        max_gap: pair distance bound (1 = adjacent pairs, L-1 = all pairs).
        num_prompts, seq_len, seed: calibration budget and paragraph shuffle seed
            (with ``adaptive``, ``num_prompts`` is the maximum).
        batch_size: prompts per forward pass (int) or ``"auto"`` (fits ``max_memory``).
        progress: show a progress bar with an ETA.
        prefix_reuse, stream_logits, kl_chunk, vocab_chunk, max_memory, dtype: engine
            settings, see :func:`plan_kl`; all are recorded in ``report.metadata``.
        checkpoint_path: a folder. Completed (batch, probe) values are written there
            atomically as they finish; rerunning the same call after an interruption
            (a killed process included) skips them and returns a report with the same
            values as an uninterrupted run. The folder is tied to the model weights,
            the calibration prompts, the probes and the settings.
        adaptive: an :class:`AdaptiveBudget` to stop adding prompts once the selection
            at its budget is stable under the error bars.
        distributed: see :func:`plan_kl`: under ``torchrun``/``accelerate launch`` with
            an initialised process group every rank scores a disjoint share of the
            probes, and every rank returns the full report.

    Returns:
        A :class:`~hf_layerswap.report.SwapReport`.

    Raises:
        ValueError: an unknown protocol, ``max_gap`` outside ``1..L-1``, a model with
            fewer than 2 blocks, bad calibration input (see ``build_calibration``), or a
            bad engine setting.
        CheckpointMismatchError: ``checkpoint_path`` belongs to a different run.
    """
    if isinstance(protocols, str):
        raise ValueError(f"protocols={protocols!r}: give a list, e.g. [{protocols!r}], a non-empty subset of {list(PROTOCOLS)}")
    protocols = tuple(dict.fromkeys(protocols))
    if not protocols or any(p not in PROTOCOLS for p in protocols):
        raise ValueError(f"protocols={protocols!r}: allowed a non-empty subset of {list(PROTOCOLS)}")
    num_layers = num_blocks(model)
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} block(s); swap tests need at least 2, and {ONE_BLOCK}")
    pairs = _pair_list(num_layers, max_gap)
    if adaptive is not None:
        if not isinstance(adaptive, AdaptiveBudget):
            raise TypeError(f"adaptive must be an AdaptiveBudget, got {type(adaptive).__name__}")
        if adaptive.protocol not in protocols:
            raise ValueError(f"adaptive.protocol={adaptive.protocol!r} is not among the scored protocols {list(protocols)}")
    calib = _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    plans = swap_plans(num_layers, max_gap, protocols)
    engine = _Engine(
        model, calib, plans, batch_size=batch_size, prefix_reuse=prefix_reuse, stream_logits=stream_logits,
        kl_chunk=kl_chunk, vocab_chunk=vocab_chunk, max_memory=max_memory, dtype=dtype, checkpoint_path=checkpoint_path,
        distributed=distributed, progress=progress, desc="swap-KL probes",
    )
    adaptive_record = None
    if adaptive is None:
        used = engine.batches
        engine.run_batches(used)
        engine.gather()
        values = engine.values(used)
    else:
        bs = engine.batch_size
        first = min(len(engine.batches), math.ceil(adaptive.min_prompts / bs))
        step = max(1, math.ceil(adaptive.step / bs))
        rounds, done_batches, target = [], 0, first
        while True:
            engine.run_batches(range(done_batches, target))
            engine.gather()
            done_batches = target
            used = list(range(done_batches))
            values = engine.values(used)
            partial = SwapReport(num_layers, _build_report(num_layers, pairs, protocols, max_gap, values),
                                 protocols=protocols, max_gap=max_gap)
            n_used = int(values[next(iter(values))].numel())
            check = selection_stability(
                partial, values, adaptive.num_layers, protocol=adaptive.protocol, spacing=adaptive.spacing,
                protect=adaptive.protect, z=adaptive.z,
            )
            rounds.append({"num_prompts": n_used, **check})
            if check["stable"]:
                reason = f"stable: the selection at budget {adaptive.num_layers} is separated by more than z={adaptive.z} standard errors from every alternative"
                stopped = "stable"
                break
            if done_batches >= len(engine.batches):
                reason = f"reached the maximum of {calib.num_prompts} prompts before the selection was stable under z={adaptive.z} standard errors"
                stopped = "max_prompts"
                break
            target = min(len(engine.batches), done_batches + step)
        adaptive_record = {**asdict(adaptive), "rounds": rounds, "stopped": stopped, "reason": reason}
        adaptive_record["protect"] = list(adaptive.protect)
    used_calib = _prefix_calibration(calib, int(values[next(iter(values))].numel()))
    results = _build_report(num_layers, pairs, protocols, max_gap, values)
    summary = engine.summary(used)
    metadata = {
        "model": {**model_identity(model), "fingerprint": model_fingerprint(model)},
        "calibration": used_calib.spec(),
        "num_prompts": used_calib.num_prompts,
        "num_tokens": used_calib.num_tokens,
        "seq_len": used_calib.seq_len,
        "dtype": _dtype_name(engine.param_dtype),
        "seed": seed,
        "token_averaging": "mean over real tokens per prompt, then mean over prompts",
        "kl_direction": "KL(original || modified)",
        "library_versions": library_versions(),
        **summary,
    }
    if adaptive_record is not None:
        metadata["adaptive"] = adaptive_record
    return SwapReport(num_layers, results, protocols=protocols, max_gap=max_gap, metadata=metadata)


def removal_kl(
    model: nn.Module,
    calibration,
    removed: Sequence[int] | Sequence[Sequence[int]],
    *,
    tokenizer=None,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int | str = 8,
    seed: int = 0,
    progress: bool = False,
    max_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
):
    """Joint removal KL d_skip(S) = E_x KL(p_M || p_{M-S}) in nats.

    Args:
        removed: one set of 0-based block indices, or a list of sets (then a list of
            floats is returned, one per set, sharing the reference forward passes).
        calibration, tokenizer, num_prompts, seq_len, seed, batch_size: as in
            :func:`score_layers`.
        max_memory, dtype: engine settings, see :func:`plan_kl`.

    Returns:
        A float (one set) or a list of floats. The empty set gives exactly 0.0.

    Raises:
        ValueError: bad indices (out of range, duplicates) or a set leaving no block.
    """
    num_layers = num_blocks(model)
    single = not any(isinstance(x, Iterable) and not isinstance(x, str) for x in removed)
    sets = [list(removed)] if single else [list(s) for s in removed]
    plans = {n: removal_plan(num_layers, s) for n, s in enumerate(sets)}
    calib = _calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    values, _ = plan_kl(
        model, calib, plans, batch_size=batch_size, progress=progress, desc="removal KL",
        max_memory=max_memory, dtype=dtype,
    )
    out = [float(values[n].mean()) for n in range(len(sets))]
    return out[0] if single else out


# ----------------------------------------------------------------------------- engine names
# The engine's building blocks under documented names, for benchmarks and tests that
# measure or check them directly; the verbs above are the user-facing API.

#: The output head as a function of the decoder output (``lm_head`` + logit soft-capping).
Head = _Head
#: Per-row KL(p_ref || softmax(logits)) in fp32: ``(C, V), (C, V) -> (C,)``.
kl_rows = _kl_rows
#: Row blocks ``[(start, stop), ...]`` of a ``(rows, width)`` fp32 array kept cache-sized.
row_blocks = _row_blocks
#: Deduplicated probes of a set of plans: ``(name -> key, {key: probe}, identity keys)``.
make_probes = _make_probes
#: Execution order of probes with prefix sharing (``mode`` one of :data:`PREFIX_REUSE_MODES`).
schedule = _schedule
#: Deterministic, cost-balanced share of the probes for one rank.
shard = _shard
#: The folder of completed (batch, probe) values behind ``checkpoint_path``.
ScoringCheckpoint = _Checkpoint
