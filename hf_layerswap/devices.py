"""Where a module computes: the one answer every part of the library uses to place tensors.

A model loaded with ``device_map`` (several GPUs, CPU or disk offload) is wrapped by
accelerate in ``AlignDevicesHook``\\ s: each hooked module's weights come to its *execution
device* when it is called, and its parameters may sit on another device ("cpu") or on
"meta" (disk offload) between calls. ``next(model.parameters()).device`` is therefore the
wrong device for a split model and "meta" for an offloaded one; inputs go to the execution
device of the module that consumes them instead.

:func:`onloaded` keeps an offloaded module's weights on its execution device for a whole
stretch of calls (accelerate's own ``align_module_device``, with the hook's per-call
offload paused meanwhile), so that a block that runs many times in a row is read from CPU
memory or disk once: what the scoring engine's slot-major streaming does
(:mod:`hf_layerswap.scoring.slotmajor`).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

__all__ = ["execution_device", "input_device", "offloaded_bytes", "offloaded_modules", "onloaded", "peak_memory"]


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


def offloaded_modules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules that carry an accelerate ``AlignDevicesHook`` with
    offload on (weights on "meta" or in CPU memory between calls, read from the hook's
    weights map at each call): what a model dispatched with a "cpu"/"disk" device map (or
    ``max_memory`` below its weights) has. Empty for a module held in memory."""
    return [m for m in module.modules() if has_offloaded_params(m)]


def offloaded_bytes(module: nn.Module) -> int:
    """Bytes one onload of ``module`` moves: the parameters and buffers (shape x element
    size; "meta" tensors count at their dtype's size) of its offloaded submodules
    (:func:`offloaded_modules`). 0 for a module held in memory."""
    total, seen = 0, set()
    for m in offloaded_modules(module):
        hook = m._hf_hook
        tensors = [*m.parameters(recurse=hook.place_submodules)]
        if hook.offload_buffers:
            tensors += [*m.buffers(recurse=hook.place_submodules)]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@contextlib.contextmanager
def onloaded(module: nn.Module) -> Iterator[int]:
    """Bring an offloaded ``module``'s weights to its execution device once and keep them
    there until the context exits; calls of the module inside run without reading them
    again. Yields the bytes moved (:func:`offloaded_bytes`; 0 and nothing done for a
    module held in memory).

    accelerate's machinery does the moving: ``align_module_device`` on every offloaded
    submodule (the hook's ``pre_forward`` reads the weights from its weights map, CPU
    memory or the offload folder; its ``post_forward`` puts them back on "meta" on exit);
    inside, each hook's ``offload`` flag is off, so a call only aligns its inputs, as for
    a module held on its device. The flags are restored on exit, also on error.
    """
    mods = offloaded_modules(module)
    moved = offloaded_bytes(module)
    with contextlib.ExitStack() as stack:
        for m in mods:
            stack.enter_context(align_module_device(m))
        for m in mods:
            m._hf_hook.offload = False
            stack.callback(setattr, m._hf_hook, "offload", True)  # runs before the weights go back
        yield moved


def peak_memory() -> dict[str, int]:
    """Peak memory of this process so far, in bytes, per device: ``"cpu"`` the peak
    resident set size (``resource.getrusage``; kilobytes on Linux, bytes on macOS), and
    ``"cuda:<i>"`` ``torch.cuda.max_memory_allocated(i)`` for every CUDA device present."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"cpu": int(rss if sys.platform == "darwin" else rss * 1024)}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = int(torch.cuda.max_memory_allocated(i))
    return out
