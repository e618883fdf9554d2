"""The model plumbing scoring needs: devices and dtypes of modules, the text config, and
the output head as a function of the decoder output, soft-capping included."""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

from ..devices import execution_device, OffloadedTensor

__all__ = ["decoder_output", "Head", "hooks_removed", "maybe_autocast", "param_dtype", "text_config"]


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


class Head:
    """The model's output head as a function of the decoder output: ``lm_head`` plus the
    final logit soft-capping that some families apply (Gemma 2). It is checked against
    the model's own logits on the first batch (see :meth:`Engine._reference_pass`).

    Numeric contract: a plain ``nn.Linear`` head always gives **fp32 logits computed in
    fp32**: the final hidden state ``(R, H)`` is upcast to fp32 and multiplied by the
    head's weight upcast to fp32 (one fp32 ``H x V`` GEMM per block of positions), so
    bf16/fp16 models are not scored on logits rounded to 8 (or 11) mantissa bits. The
    upcast weight is made once per head phase (:meth:`weight32`; ``4 H V`` bytes, freed by
    :meth:`release`); an fp32 head uses its own weight, so nothing changes there. Other
    heads (quantized or custom modules, or heads with forward hooks) run their own forward
    and their logits are upcast.

    An offloaded plain ``nn.Linear`` head (accelerate disk or CPU offload: Gemma-3's tied
    embedding and head is 62.5% of its weights) is *streamed*: :meth:`weight_slice` reads
    only the vocabulary entries asked for from the offload's storage
    (:class:`~hf_layerswap.devices.OffloadedTensor`), so the head/KL phase holds one slice
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
        #: (:class:`~hf_layerswap.devices.OffloadedTensor`), never whole
        self.source = OffloadedTensor.of(m, "weight") if self.linear else None
        self._bias_source = OffloadedTensor.of(m, "bias") if self.source is not None and m.bias is not None else None
        self.streamed = self.source is not None
        # a plain Linear with its weight in memory (also under an accelerate hook that does not
        # offload it: a "cpu" entry of a CPU device map; a fresh logit tensor per probe there
        # fragments the heap by about one logit block per probe), or streamed from the offload,
        # can be run on vocabulary slices; quantized or custom heads run whole
        self.sliceable = self.streamed or (self.linear and not has_offloaded_params(m)
                                           and m.weight.device.type != "meta")
        self._w32: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes of a streamed head's weight (and bias) read from the offload so far (0 in memory)."""
        return sum(s.bytes_read for s in (self.source, self._bias_source) if s is not None)

    def weight32(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight (V, H), bias (V,) or None)`` of a head in memory in fp32: the head's own
        tensors when they are fp32, else an fp32 copy kept until :meth:`release`."""
        w, b = self.module.weight, self.module.bias
        if w.dtype == torch.float32 and (b is None or b.dtype == torch.float32):
            return w, b
        if self._w32 is None:
            self._w32 = (w.detach().float(), None if b is None else b.detach().float())
        return self._w32

    def weight_slice(self, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 ``(weight (v1 - v0, H), bias (v1 - v0,) or None)`` of vocabulary entries
        ``v0:v1``: views of :meth:`weight32` for a head in memory; for a streamed head those
        rows read from the offload (only them) onto the head's execution device."""
        if not self.streamed:
            w, b = self.weight32()
            return w[v0:v1], None if b is None else b[v0:v1]
        device = execution_device(self.module)
        (w,) = self.source.rows([(v0, v1)])
        b = None if self._bias_source is None else self._bias_source.rows([(v0, v1)])[0].to(device, torch.float32)
        return w.to(device, torch.float32), b

    def release(self) -> None:
        """Free the fp32 copy of a half-precision head's weight."""
        self._w32 = None

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
            w, b = m.weight, m.bias
            out = nn.functional.linear(hidden.to(w.device, torch.float32), w.float(), None if b is None else b.float())
        return self._cap(out)

    def into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The whole head written into ``out`` ``(R, V)`` fp32 (a reused buffer: a fresh
        position x 262k-entry tensor per probe costs its page faults again); for an fp32
        head the same GEMM as the module's own forward, so the same values bit for bit.
        Sliceable heads only."""
        w, b = self.weight32()
        hidden = hidden.float()
        if b is None:
            torch.matmul(hidden, w.t(), out=out)
        else:
            torch.addmm(b, hidden, w.t(), out=out)
        return self._cap(out)

    def vocab_slice(self, hidden: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """fp32 logits of vocabulary entries ``v0:v1`` only: ``(R, v1 - v0)``."""
        return self.slice_logits(hidden, *self.weight_slice(v0, v1))

    def slice_logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits ``(R, W)`` of hidden rows ``(R, H)`` against a :meth:`weight_slice`
        ``(W, H)`` (soft-capped)."""
        return self._cap(nn.functional.linear(hidden.to(weight.device, torch.float32), weight, bias))


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
