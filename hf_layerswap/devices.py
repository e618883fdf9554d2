"""Where a module computes: the one answer every part of the library uses to place tensors.

A model loaded with ``device_map`` (several GPUs, CPU or disk offload) is wrapped by
accelerate in ``AlignDevicesHook``\\ s: each hooked module's weights come to its *execution
device* when it is called, and its parameters may sit on another device ("cpu") or on
"meta" (disk offload) between calls. ``next(model.parameters()).device`` is therefore the
wrong device for a split model and "meta" for an offloaded one; inputs go to the execution
device of the module that consumes them instead.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["execution_device", "input_device"]


def execution_device(module: nn.Module) -> torch.device:
    """The device ``module`` computes on.

    accelerate's ``module._hf_hook.execution_device`` where a hook is attached (also inside
    a ``SequentialHook``), else the device of its first parameter or buffer not on "meta",
    else the CPU.
    """
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    for sub in getattr(hook, "hooks", ()) if dev is None else ():  # accelerate's SequentialHook
        dev = getattr(sub, "execution_device", None) or dev
    if dev is not None:
        return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def input_device(model: nn.Module) -> torch.device:
    """The device token ids ``(B, T)`` go to: the execution device of the input embeddings."""
    return execution_device(model.get_input_embeddings())
