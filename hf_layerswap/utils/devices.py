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

:class:`OffloadedTensor` reads row ranges of one offloaded weight from the offload's own
storage (the hook's weights map: the checkpoint's safetensors file, accelerate's ``.dat``
memmaps or tensors in CPU memory) without reading the rest, and :func:`sliced_calls` makes
an offloaded vocabulary-sized module compute from such reads: an ``nn.Embedding`` reads only
the rows of the token ids it is given, an ``nn.Linear`` (an output head) its output features
in slices. A head of 262k entries (Gemma-3's tied embedding and head: 62.5% of its weights)
is then never resident whole.

:class:`BlockPrefetcher` onloads blocks in a known order with the next one read ahead: on a
CUDA execution device its host copy is pinned (weights held in CPU memory are pinned once,
in place of their pageable copy; a block read from disk is read into pinned memory) and
copied on a side stream while the current block computes; on a CPU it reads the same order
synchronously (the code path tests run).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from accelerate.utils import (align_module_device, convert_file_size_to_int, has_offloaded_params, named_module_tensors,
                              OffloadedWeightsLoader, PrefixedDataset, set_module_tensor_to_device)
from safetensors import safe_open
from torch import nn

__all__ = [
    "BlockPrefetcher", "execution_device", "held_bytes", "host_share", "input_device", "leading_values", "model_devices",
    "OffloadedTensor", "offloaded_bytes", "offloaded_modules", "onloaded", "peak_memory", "process_share", "same_device",
    "sliced_calls",
]


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


def same_device(a, b) -> bool:
    """Whether two devices (``torch.device``, a name, an accelerator index as accelerate's
    ``max_memory`` keys give it) are one: ``"cuda"`` is ``"cuda:0"`` (the current device is
    not asked), ``"cpu:1"`` is ``"cpu"``."""
    accel = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    kind = accel.type if accel is not None else "cuda"
    a, b = (torch.device(kind, d) if isinstance(d, int) else torch.device(d) for d in (a, b))
    if a.type != b.type:
        return False
    return a.type in ("cpu", "meta") or (a.index or 0) == (b.index or 0)


def process_share(accelerators: int, processes: int, rank: int) -> list[int]:
    """The accelerator indices of launched process ``rank`` (its local rank) of ``processes``
    on one machine with ``accelerators``: an even split in consecutive blocks of
    ``accelerators // processes`` (a remainder stays idle), so that no two processes place
    a replica on the same accelerator.

    Raises:
        ValueError: fewer accelerators than processes (the message names both and what to
            launch instead), or a ``rank`` outside ``0 .. processes - 1``.
    """
    if not 0 <= rank < processes:
        raise ValueError(f"local rank {rank} is outside the {processes} launched processes of this machine")
    per = accelerators // processes
    if per < 1:
        raise ValueError(
            f"{processes} launched processes on this machine but {accelerators} accelerator(s): each process needs "
            f"one of its own for its model replica; launch at most {accelerators} process(es) "
            f"(`accelerate launch --num_processes {max(accelerators, 1)}`), or one process with device_map='auto' "
            "to spread one replica over every accelerator")
    return list(range(rank * per, (rank + 1) * per))


def host_share(limits: Mapping, processes: int) -> dict:
    """``limits`` (accelerate's ``max_memory``: a device -> bytes or a size such as ``"60GiB"``)
    with the host's entry (``"cpu"``) split evenly between the ``processes`` launched on this
    machine, in bytes: the processes share one host memory, so each one's map may fill only
    its share of it (the accelerators' entries are per device, and each process takes its own
    devices). The other entries are kept as given.

    Raises:
        ValueError: a ``"cpu"`` entry that is not a size (accelerate's parser names it).
    """
    out = dict(limits)
    if "cpu" in out and processes > 1:
        out["cpu"] = convert_file_size_to_int(out["cpu"]) // processes
    return out


def model_devices(model: nn.Module) -> list[torch.device]:
    """Every device ``model`` computes on, the input device first: the execution device of
    each module accelerate's device map hooked (a model split over GPUs: each GPU; modules
    offloaded to CPU memory or disk: the device their weights are brought to), else the
    devices of its parameters and buffers not on "meta"; ``[cpu]`` for a model with none.
    The working memory of a forward pass lands on each of them in turn."""
    found = [input_device(model)] if hasattr(model, "get_input_embeddings") else []
    hooked = [execution_device(m) for m in model.modules() if getattr(m, "_hf_hook", None) is not None]
    found += hooked or [t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
    out: list[torch.device] = []
    for dev in found or [torch.device("cpu")]:
        if not any(same_device(dev, d) for d in out):
            out.append(dev)
    return out


def held_bytes(model: nn.Module, device) -> int:
    """Bytes of ``model``'s parameters and buffers held on ``device`` (shape x element
    size; a tied weight once); offloaded weights ("meta" between calls) count nowhere."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen and t.device.type != "meta" and same_device(t.device, device):
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


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


class BlockPrefetcher:
    """Onloads offloaded modules in a known ``order``, the next one read ahead.

    ``load(i)`` (a context manager, what :func:`onloaded` is for one module) brings
    ``modules[i]``'s offloaded weights to its execution device and keeps them there until
    the context exits, and before it yields starts reading the module that follows ``i``
    in ``order``, so that read overlaps the work done inside. On a CUDA execution device
    the host copy is pinned (:meth:`host_copy`) and copied with ``non_blocking=True`` on
    a side CUDA stream; the compute stream waits on that copy's event before the module
    runs (and the tensors are recorded on it, so the allocator keeps them until it is
    done). On a CPU (``stream=None``) the same schedule runs synchronously: the values are
    accelerate's own (its weights map, ``set_module_tensor_to_device``; the hook's
    ``post_forward`` puts them back on "meta").

    Args:
        modules: the modules by index (decoder blocks).
        order: indices in the order they will be loaded.
        stream: the side stream of the reads (``torch.cuda.Stream``), or ``None``
            (default: a new side stream when the first module computes on CUDA).

    Attributes:
        log: ``("read", i)`` when module ``i``'s read is issued, ``("load", i)`` when it
            is installed (for tests and diagnostics).
        reads: modules read (each once per load).
    """

    def __init__(self, modules, order, *, stream="auto"):
        self.modules = modules
        self.order = list(order)
        self.next_of = {a: b for a, b in zip(self.order, self.order[1:])}
        first = modules[self.order[0]] if self.order else None
        self.device = execution_device(first) if first is not None else torch.device("cpu")
        if stream == "auto":
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stream = stream
        self.pin = self.device.type == "cuda"
        self.pending: dict[int, tuple[list, object]] = {}
        self.log: list[tuple[str, int]] = []
        self.reads = 0

    def host_copy(self, module: nn.Module, name: str) -> torch.Tensor:
        """The host tensor ``name`` of ``module``'s offload, pinned when the copies are
        asynchronous: a tensor held in CPU memory is pinned once and replaces its pageable
        copy in the weights map; one read from disk is read into pinned memory."""
        weights = module._hf_hook.weights_map
        value = weights[name]
        if not self.pin or value.is_pinned():
            return value
        pinned = value.pin_memory()
        store = weights.dataset if isinstance(weights, PrefixedDataset) else weights
        key = weights.prefix + name if isinstance(weights, PrefixedDataset) else name
        held = store.state_dict if isinstance(store, OffloadedWeightsLoader) else store
        if isinstance(held, dict) and key in held:
            held[key] = pinned
        return pinned

    def _read(self, i: int) -> None:
        """Issue the copies of module ``i``'s offloaded tensors to the execution device."""
        copies = []
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            for m in offloaded_modules(self.modules[i]):
                hook = m._hf_hook
                for name, _ in named_module_tensors(m, include_buffers=hook.offload_buffers,
                                                    recurse=hook.place_submodules, remove_non_persistent=True):
                    copies.append((m, name, self.host_copy(m, name).to(self.device, non_blocking=self.pin)))
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        self.pending[i] = (copies, event)
        self.reads += 1
        self.log.append(("read", i))

    @contextlib.contextmanager
    def load(self, i: int) -> Iterator[int]:
        """Module ``i`` onloaded (read ahead when it was next); the read of the module after
        it in ``order`` is issued before this yields. Yields the bytes moved
        (:func:`offloaded_bytes`)."""
        if i not in self.pending:
            self._read(i)
        copies, event = self.pending.pop(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for _, _, t in copies:
                t.record_stream(current)
        mods = offloaded_modules(self.modules[i])
        with contextlib.ExitStack() as stack:
            for m in mods:
                m._hf_hook.offload = False
                stack.callback(m._hf_hook.post_forward, m, None)  # back to "meta" (runs last)
                stack.callback(setattr, m._hf_hook, "offload", True)
            for m, name, t in copies:
                set_module_tensor_to_device(m, name, self.device, value=t)
            self.log.append(("load", i))
            nxt = self.next_of.get(i)
            if nxt is not None and nxt not in self.pending:
                self._read(nxt)
            del copies
            yield offloaded_bytes(self.modules[i])


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


class OffloadedTensor:
    """One tensor of an offloaded module (``module.<name>`` on "meta" between calls), read in
    row ranges from where accelerate keeps it: the hook's ``weights_map`` (a
    ``PrefixedDataset`` over an ``OffloadedWeightsLoader``, or a mapping of tensors in CPU
    memory). An entry of the checkpoint's safetensors file is read with
    ``safe_open(...).get_slice(name)[a:b]`` (a view of the file's pages of those rows only),
    an accelerate ``.dat`` file as a ``np.memmap`` of those rows, a tensor in memory as a view.
    Build it with :meth:`of`.

    Attributes:
        shape, dtype: the tensor's (the module's meta tensor).
        bytes_read: bytes of all rows returned so far (rows x row bytes at the tensor's dtype).
    """

    def __init__(self, loader: Mapping, key: str, shape: torch.Size, dtype: torch.dtype):
        self.loader, self.key, self.shape, self.dtype = loader, key, shape, dtype
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.bytes_read = 0

    @classmethod
    def of(cls, module: nn.Module, name: str = "weight") -> OffloadedTensor | None:
        """The reader of ``module``'s own tensor ``name`` when accelerate offloads it (an
        ``AlignDevicesHook`` with offload on and a weights map); None otherwise (held in
        memory, or no such tensor)."""
        return cls.named(module, name) if "." not in name else None

    @classmethod
    def named(cls, model: nn.Module, name: str) -> OffloadedTensor | None:
        """The reader of ``model``'s parameter or buffer ``name`` (dotted, as
        ``named_parameters`` gives it) when accelerate offloads it: the hook of the module
        that owns it, or of the nearest parent whose hook places its submodules; None when
        no such hook offloads it."""
        path = name.split(".")
        for k in range(len(path) - 1, -1, -1):
            module = model.get_submodule(".".join(path[:k]))
            hook = getattr(module, "_hf_hook", None)
            if not has_offloaded_params(module) or (k < len(path) - 1 and not hook.place_submodules):
                continue
            key = ".".join(path[k:])
            tensor = dict(named_module_tensors(module, include_buffers=True, recurse=True)).get(key)
            weights = getattr(hook, "weights_map", None)
            if weights is None or tensor is None or tensor.dim() == 0:
                return None
            loader = weights
            if isinstance(weights, PrefixedDataset):
                loader, key = weights.dataset, weights.prefix + key
            return cls(loader, key, tensor.shape, tensor.dtype)
        return None

    def first(self, count: int) -> torch.Tensor:
        """The first ``count`` values of the flattened tensor (fewer when it holds fewer),
        ``(count,)`` on the CPU at the tensor's dtype, read as the fewest leading rows."""
        row = max(1, int(np.prod(self.shape[1:], dtype=np.int64)))
        return self.rows([(0, min(int(self.shape[0]), -(-count // row)))])[0].reshape(-1)[:count]

    def rows(self, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Rows ``a:b`` for each ``(a, b)`` of ``ranges``, on the CPU at the tensor's dtype
        (``(b - a, *shape[1:])`` each); one open of the storage for all of them."""
        loader, key = self.loader, self.key
        if isinstance(loader, OffloadedWeightsLoader) and key not in loader.state_dict:
            info = loader.index[key]
            if info.get("safetensors_file") is not None:
                with safe_open(info["safetensors_file"], framework="pt", device="cpu") as f:
                    part = f.get_slice(info.get("weight_name", key))
                    out = [part[a:b] for a, b in ranges]
                out = [t.to(self.dtype) for t in out]  # accelerate's loader casts to the model's dtype too
            else:
                out = self._dat_rows(os.path.join(loader.save_folder, f"{key}.dat"), info, ranges)
        else:  # tensors in CPU memory
            whole = loader[key]
            out = [whole[a:b] for a, b in ranges]
        self.bytes_read += sum(b - a for a, b in ranges) * self.row_bytes
        return out

    @staticmethod
    def _dat_rows(path: str, info: dict, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Rows of an accelerate ``.dat`` memmap (``accelerate.utils.offload_weight``'s
        format: bfloat16 stored as int16, float8 as int8)."""
        dtype = info["dtype"]
        stored = "int16" if dtype == "bfloat16" else "int8" if dtype.startswith("float8_") else dtype
        array = np.memmap(path, dtype=stored, mode="r", shape=tuple(info["shape"]))
        out = [torch.from_numpy(np.array(array[a:b])) for a, b in ranges]
        del array
        return [t.view(getattr(torch, dtype)) for t in out] if stored != dtype else out

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (sorted unique ``(U,)`` int64) as one ``(U, *shape[1:])`` tensor,
        read as runs of consecutive indices."""
        idx = index.tolist()
        starts = [k for k in range(len(idx)) if k == 0 or idx[k] != idx[k - 1] + 1]
        ends = [*starts[1:], len(idx)]
        return torch.cat(self.rows([(idx[a], idx[b - 1] + 1) for a, b in zip(starts, ends)]))


def leading_values(model: nn.Module, name: str, count: int = 16) -> torch.Tensor | None:
    """The first ``count`` values of ``model``'s parameter ``name``, flattened (``(min(count,
    numel),)`` on the CPU, the parameter's dtype): read from the tensor itself, or, for a
    tensor accelerate offloads ("meta" between calls), from the offload's own storage
    (:class:`OffloadedTensor`: only the rows holding them), so a model gives the same values
    in memory, split or offloaded. None for a "meta" tensor with no offload behind it.

    Raises:
        AttributeError: ``model`` has no parameter ``name``.
    """
    tensor = model.get_parameter(name)
    if tensor.device.type != "meta":
        return tensor.detach().reshape(-1)[:count].cpu()
    reader = OffloadedTensor.named(model, name)
    return None if reader is None else reader.first(count)


@contextlib.contextmanager
def _swapped(module: nn.Module, **tensors: torch.Tensor | None) -> Iterator[None]:
    """``module``'s parameters named in ``tensors`` replaced (as frozen parameters) for the block."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        for name, t in tensors.items():
            module._parameters[name] = None if t is None else nn.Parameter(t, requires_grad=False)
        yield
    finally:
        module._parameters.update(saved)


@contextlib.contextmanager
def sliced_calls(module: nn.Module | None, slice_rows: int = 1 << 14) -> Iterator[OffloadedTensor | None]:
    """While inside, calls of an offloaded ``module`` read only parts of its weight from the
    offload (:class:`OffloadedTensor`) instead of the whole (accelerate's hook reads all of it
    at every call):

    - ``nn.Embedding`` on ids ``(...)``: the rows of the distinct ids only; the module's own
      forward runs on them with the ids renumbered (a scaled embedding keeps its scale);
    - ``nn.Linear`` on inputs ``(..., in)``: its output features in slices of ``slice_rows``
      weight rows (bias entries with them), the module's own forward per slice, the outputs
      concatenated ``(..., out)``; one slice is resident at a time.

    The values are those of the module's own call, exactly. Yields the weight's reader (its
    ``bytes_read`` counts what was read), or None with nothing changed: a module held in
    memory, one with offloaded buffers, an embedding with ``max_norm``, another module type.

    Raises:
        ValueError: ``slice_rows`` below 1.
    """
    if slice_rows < 1:
        raise ValueError(f"slice_rows={slice_rows}: must be >= 1")
    source = None if module is None else OffloadedTensor.of(module, "weight")
    ok = source is not None and (
        (type(module) is nn.Linear or isinstance(module, nn.Embedding) and module.max_norm is None)
        and not any(b.device.type == "meta" for b in module.buffers()))
    if not ok:
        yield None
        return
    hook, call = module._hf_hook, module.forward  # accelerate's wrapped forward: moves inputs and outputs
    bias = OffloadedTensor.of(module, "bias") if getattr(module, "bias", None) is not None else None
    device = execution_device(module)

    def embedding(ids, *args, **kwargs):
        wanted = torch.unique(ids.detach().cpu())
        pad = module.padding_idx
        if pad is not None:  # F.embedding checks padding_idx < num_embeddings
            wanted = torch.unique(torch.cat([wanted, torch.tensor([pad])]))
        rows = source.take(wanted).to(device)
        compact = torch.searchsorted(wanted, ids.detach().cpu()).to(ids.device)
        module.padding_idx = None if pad is None else int(torch.searchsorted(wanted, torch.tensor(pad)))
        try:
            with _swapped(module, weight=rows):
                return call(compact, *args, **kwargs)
        finally:
            module.padding_idx = pad

    def linear(x, *args, **kwargs):
        outs = []
        for a in range(0, source.shape[0], slice_rows):
            b = min(source.shape[0], a + slice_rows)
            (w,) = source.rows([(a, b)])
            bb = None if bias is None else bias.rows([(a, b)])[0].to(device)
            with _swapped(module, weight=w.to(device), bias=bb):
                outs.append(call(x, *args, **kwargs))
        return torch.cat(outs, dim=-1)

    hook.offload = False  # the hook only moves inputs and outputs meanwhile
    module.forward = embedding if isinstance(module, nn.Embedding) else linear
    try:
        yield source
    finally:
        module.forward = call
        hook.offload = True
