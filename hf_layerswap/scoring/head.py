"""The model plumbing scoring needs: devices and dtypes of modules, the text config, and
the output head as a function of the decoder output, soft-capping included."""

from __future__ import annotations

import contextlib

import torch
from torch import nn



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


def _autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device_type``, or no context for ``None``
    (the model's own dtype)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@contextlib.contextmanager
def _hooks(handles: list):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


#: The output head as a function of the decoder output (``lm_head`` + logit soft-capping).
Head = _Head
