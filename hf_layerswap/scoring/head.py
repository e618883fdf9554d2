"""The model plumbing scoring needs: devices and dtypes of modules, the text config, and
the output head as a function of the decoder output, soft-capping included."""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

from ..utils.devices import execution_device, OffloadedTensor

__all__ = [
    "decoder_output", "Head", "hooks_removed", "linear32", "maybe_autocast", "mixed_gemm", "param_dtype", "split_bf16",
    "text_config", "UPCAST_PIECE_BYTES",
]


# ----------------------------------------------------------------------------- model plumbing
def param_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (``torch.float32`` when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def text_config(model: nn.Module):
    """The decoder's text config (``get_text_config(decoder=True)`` where the config has one, else the config)."""
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        try:
            return cfg.get_text_config(decoder=True)
        except TypeError:
            return cfg.get_text_config()
    return cfg


# ----------------------------------------------------------------------------- fp32 logits
#: fp32 bytes of one piece of a half-precision weight upcast at a time, where the device has no
#: GEMM with fp32 output from half-precision inputs (a CPU): never a whole fp32 copy of the head
UPCAST_PIECE_BYTES = 32 << 20

_MIXED_GEMM: dict[tuple[str, torch.dtype], bool] = {}


def mixed_gemm(device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs on ``device`` for ``dtype``
    (bf16 or fp16) inputs: a GEMM that multiplies in the inputs' dtype, accumulates in fp32 and
    writes fp32 (CUDA in torch 2.13; not the CPU, whose bf16 GEMM rounds its output to bf16).
    Asked once per device type and dtype, on a 1 x 1 product."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _MIXED_GEMM:
        try:
            one = torch.ones(1, 1, dtype=dtype, device=device)
            ok = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
        except (NotImplementedError, RuntimeError, TypeError):
            ok = False
        _MIXED_GEMM[key] = ok
    return _MIXED_GEMM[key]


def split_bf16(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` (fp32, or any dtype upcast to it) as three bf16 terms ``[hi, mid, lo]`` whose fp32
    sum is ``x`` exactly (bf16 keeps fp32's exponent range; each term takes the next 8 bits of
    the significand, and the remainders are exact in fp32): three bf16 GEMMs with fp32 output
    then give the fp32 hidden state's logits against a bf16 weight with no fp32 copy of it."""
    x = x.float()
    hi = x.bfloat16()
    rest = x - hi.float()
    mid = rest.bfloat16()
    return [hi, mid, (rest - mid.float()).bfloat16()]


def linear32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits ``(R, W)`` of hidden rows ``(R, H)`` against a head weight ``(W, H)`` (and
    bias), written into ``out`` when given; the numeric contract of :class:`Head`:

    - an **fp32 weight**: the hidden rows upcast to fp32 and one fp32 GEMM (``matmul``, or
      ``addmm`` with a bias: the same call as ``nn.Linear``'s forward), as before;
    - a **bf16 or fp16 weight** on a device with a GEMM that accumulates and writes fp32
      (:func:`mixed_gemm`: CUDA): ``torch.mm(..., out_dtype=torch.float32)`` on the weight as
      it is. Every product of two bf16 (or fp16) numbers is exact in fp32, so this is the
      fp32 GEMM of the upcast tensors up to the order of the fp32 sums. Hidden rows in
      another dtype against a bf16 weight are split into three bf16 terms
      (:func:`split_bf16`, exact) and their three fp32 products summed (smallest first);
      an fp32 bias is added after;
    - otherwise (a CPU; fp16 weights with hidden rows of another dtype): the fp32 GEMM of the
      upcast hidden rows and the weight upcast in pieces of at most
      :data:`UPCAST_PIECE_BYTES`, so no fp32 copy of the whole weight is ever made.
    """
    rows, width = hidden.shape[0], weight.shape[0]
    if weight.dtype == torch.float32:
        hidden = hidden.to(weight.device, torch.float32)
        bias = None if bias is None else bias.float()
        if out is None:
            return nn.functional.linear(hidden, weight, bias)
        if bias is None:
            return torch.matmul(hidden, weight.t(), out=out)
        return torch.addmm(bias, hidden, weight.t(), out=out)
    hidden = hidden.to(weight.device)
    if out is None:
        out = torch.empty(rows, width, dtype=torch.float32, device=weight.device)
    terms = None
    if mixed_gemm(weight.device, weight.dtype):
        if hidden.dtype == weight.dtype:
            terms = [hidden]
        elif weight.dtype == torch.bfloat16:
            terms = split_bf16(hidden)[::-1]  # smallest first
    if terms is not None:
        out.copy_(torch.mm(terms[0], weight.t(), out_dtype=torch.float32))
        for t in terms[1:]:
            out.add_(torch.mm(t, weight.t(), out_dtype=torch.float32))
    else:
        hidden = hidden.float()
        step = max(1, UPCAST_PIECE_BYTES // (4 * max(1, weight.shape[1])))
        for v0 in range(0, width, step):
            torch.matmul(hidden, weight[v0:v0 + step].float().t(), out=out[:, v0:v0 + step])
    if bias is not None:
        out.add_(bias.float())
    return out


class Head:
    """The model's output head as a function of the decoder output: ``lm_head`` plus the
    final logit soft-capping that some families apply (Gemma 2). It is checked against
    the model's own logits on the first batch (see :meth:`Engine._reference_pass`).

    Numeric contract: a plain ``nn.Linear`` head always gives **fp32 logits with every
    product exact and fp32 sums** (:func:`linear32`), so bf16/fp16 models are not scored on
    logits rounded to 8 (or 11) mantissa bits. An fp32 head runs the fp32 GEMM of the
    upcast hidden rows and its own weight (bit for bit what it computed before). A bf16 or
    fp16 head is never copied to fp32: where the device has a GEMM with fp32 output from
    half-precision inputs (CUDA) it runs on the weight as it is (a product of two bf16 or
    fp16 numbers is exact in fp32, so this is the fp32 GEMM of the upcast tensors up to the
    order of the fp32 sums; fp32 hidden rows against a bf16 weight as three exact bf16
    terms), elsewhere (a CPU) the fp32 GEMM runs on the weight upcast in pieces of
    :data:`UPCAST_PIECE_BYTES`. Other heads (quantized or custom modules, or heads with
    forward hooks) run their own forward and their logits are upcast.

    An offloaded plain ``nn.Linear`` head (accelerate disk or CPU offload: Gemma-3's tied
    embedding and head is 62.5% of its weights) is *streamed*: :meth:`weight_slice` reads
    only the vocabulary entries asked for from the offload's storage
    (:class:`~hf_layerswap.utils.devices.OffloadedTensor`), so the head/KL phase holds one slice
    of it at a time (:class:`~hf_layerswap.scoring.streamed.StreamedKL`).
    """

    def __init__(self, model: nn.Module):
        self.module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.softcap = getattr(text_config(model), "final_logit_softcapping", None)
        weight = getattr(self.module, "weight", None)
        self.vocab = int(weight.shape[0]) if weight is not None else int(text_config(model).vocab_size)

        m = self.module
        #: a plain Linear: its logits are computed here, in fp32, from its weight
        self.linear = (
            isinstance(m, nn.Linear)
            and type(m).forward is nn.Linear.forward
            and m.weight.is_floating_point()
        )
        #: an offloaded plain Linear: its weight is read from the offload in vocabulary slices
        #: (:class:`~hf_layerswap.utils.devices.OffloadedTensor`), never whole
        self.source = OffloadedTensor.of(m, "weight") if self.linear else None
        self._bias_source = OffloadedTensor.of(m, "bias") if self.source is not None and m.bias is not None else None
        self.streamed = self.source is not None
        # a plain Linear with its weight in memory (also under an accelerate hook that does not
        # offload it: a "cpu" entry of a CPU device map; a fresh logit tensor per probe there
        # fragments the heap by about one logit block per probe), or streamed from the offload,
        # can be run on vocabulary slices; quantized or custom heads run whole
        self.sliceable = self.streamed or (self.linear and not has_offloaded_params(m)
                                           and m.weight.device.type != "meta")

    @property
    def bytes_read(self) -> int:
        """Bytes of a streamed head's weight (and bias) read from the offload so far (0 in memory)."""
        return sum(s.bytes_read for s in (self.source, self._bias_source) if s is not None)

    def weight_slice(self, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight (v1 - v0, H), bias (v1 - v0,) or None)`` of vocabulary entries ``v0:v1``
        in the head's own dtype (:func:`linear32` makes the fp32 logits): views of the
        head's tensors for a head in memory; for a streamed head those rows read from the
        offload (only them) onto the head's execution device."""
        if not self.streamed:
            w, b = self.module.weight, self.module.bias
            return w[v0:v1], None if b is None else b[v0:v1]
        device = execution_device(self.module)
        (w,) = self.source.rows([(v0, v1)])
        b = None if self._bias_source is None else self._bias_source.rows([(v0, v1)])[0].to(device)
        return w.to(device), b

    def working_bytes(self, rows: int) -> int:
        """Bytes the head's GEMM holds beside the logits for ``rows`` vocabulary entries at a
        time: the rows read from the offload (a streamed head) and, for a half-precision weight
        on a device without a GEMM with fp32 output, one upcast piece
        (:data:`UPCAST_PIECE_BYTES` at most); never an fp32 copy of the whole weight."""
        w = self.module.weight
        hidden = int(w.shape[1])
        read = rows * hidden * w.element_size() if self.streamed else 0
        device = execution_device(self.module) if self.streamed else w.device
        if w.dtype == torch.float32 or mixed_gemm(device, w.dtype):
            return read
        return read + min(4 * rows * hidden, UPCAST_PIECE_BYTES)

    def release(self) -> None:
        """Nothing to free: the head's weight is never copied (kept for the engine's phase end)."""

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capping in place (``logits`` is always the head's own fresh output)."""
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    @property
    def own_forward(self) -> bool:
        """Whether the head runs its own forward: not a plain Linear, or one with forward
        hooks (which only its own call runs)."""
        m = self.module
        return not self.linear or bool(m._forward_hooks or m._forward_pre_hooks)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``(R, V)`` of final hidden rows ``(R, H)``: fp32 for a plain Linear head
        (see the class docstring), else (:attr:`own_forward`) the module's own output."""
        m = self.module
        if self.own_forward:
            return self._cap(m(hidden))
        if self.sliceable:
            return self.vocab_slice(hidden, 0, self.vocab)
        with align_module_device(m):  # accelerate brings offloaded weights to the execution device
            out = linear32(hidden, m.weight, m.bias)
        return self._cap(out)

    def into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The whole head written into ``out`` ``(R, V)`` fp32 (a reused buffer: a fresh
        position x 262k-entry tensor per probe costs its page faults again; :func:`linear32`);
        for an fp32 head the same GEMM as the module's own forward, so the same values bit
        for bit. Sliceable heads in memory only."""
        return self._cap(linear32(hidden, self.module.weight, self.module.bias, out=out))

    def vocab_slice(self, hidden: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """fp32 logits of vocabulary entries ``v0:v1`` only: ``(R, v1 - v0)``."""
        return self.slice_logits(hidden, *self.weight_slice(v0, v1))

    def slice_logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits ``(R, W)`` of hidden rows ``(R, H)`` against a :meth:`weight_slice`
        ``(W, H)`` (:func:`linear32`, soft-capped)."""
        return self._cap(linear32(hidden, weight, bias))


def decoder_output(output) -> torch.Tensor:
    """The final hidden state ``(B, T, H)`` of a decoder's output (``last_hidden_state`` or its first element)."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0]
    return hidden


def maybe_autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device_type``, or no context for ``None``
    (the model's own dtype)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@contextlib.contextmanager
def hooks_removed(handles: list):
    """Context manager that removes the hook ``handles`` when the block exits, also on error."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()
