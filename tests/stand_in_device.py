"""A stand-in accelerator for machines without one: tensors on a device that is not the CPU
(`accel:0`, torch's PrivateUse1 device renamed), holding real values in host memory underneath.
Not named accelerator.py: DeepSpeed's real_accelerator.py tries `import accelerator` (a top-level
package of its source tree), which with tests/ on sys.path found this file and registered the
stand-in device in any pytest process that imported DeepSpeed (seen on an H200: the GPU suite's
pinned copies and every backward failed).

Why: the product's device paths (loading, restore, export, the loss, metrics and telemetry) were
only ever run on CPU tensors, where `.numpy()` on a target, a host copy or a sync per micro-batch
costs nothing and fails nothing. Under `FakeAccelerator()`:

- `torch.empty(..., device="accel")`, `t.to(device)`, `module.to(device)` make `DeviceTensor`s
  whose `device` is `accel:0`; every op is computed on the host copies (autograd included);
- what a GPU tensor refuses is refused: `.numpy()` raises;
- every host synchronization is counted (`syncs`), with the product frame that asked for it:
  `.item()`, `float(t)`, `.tolist()`, each copy from the device into host memory, and each copy
  into the device that a GPU makes the host wait for: from pageable memory, or without
  `non_blocking` (`pin_memory()` works here, on host copies it marks pinned);
- the device's module answers what the product asks of any accelerator through
  `torch.get_device_module(device)`: `max_memory_allocated` (the peak of live device bytes),
  `get_device_name` (an H100's, so MFU is computed), `synchronize`.

torch's FakeTensorMode also makes tensors on a device a CPU build lacks, but without values (a
test could not compare a loaded weight or a loss), and tensors that claim `cuda` cannot run
backward in a CPU build (autograd asks CUDA's device guard). PrivateUse1 takes a Python device
guard (`_setup_privateuseone_for_python_backend`), so this device trains. Process groups work
unchanged: gloo reduces the host copies in place.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import (
    _DummyBackendModule,
    _DummyPrivateUse1Hook,
    _setup_privateuseone_for_python_backend,
)

NAME = "accel"


class DeviceTensor(torch.Tensor):
    """A tensor on the stand-in device; `inner` holds its values on the host."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=DEVICE,
            requires_grad=inner.requires_grad,
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner
        if _active is not None:
            _active.allocated(self)

    def __repr__(self, *, tensor_contents=None):
        return f"DeviceTensor({self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return DeviceTensor(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a DeviceTensor outside FakeAccelerator()")


@dataclass
class Sync:
    # "scalar" (.item(), float(t)), "copy" (device -> host: .cpu(), .tolist()) or "upload" (host -> device, blocking)
    kind: str
    where: str  # the innermost raytrain/ frame that asked for it (else the test's)
    origin: str  # the package whose code made the call: raytrain, transformers, torch, tests


class _Module(_DummyBackendModule):
    """`torch.get_device_module(device)` of the stand-in: what raytrain asks of an accelerator.
    It is available only inside `FakeAccelerator()`: elsewhere in the test process (DCP's writer
    asks whether any accelerator is there) the machine is the CPU-only one it is."""

    def is_available(self) -> bool:
        return _active is not None

    def max_memory_allocated(self, device=None) -> int:
        return _active.peak_bytes if _active else 0

    def reset_peak_memory_stats(self, device=None) -> None:
        if _active:
            _active.peak_bytes = _active.live_bytes

    def get_device_name(self, device=None) -> str:
        return "NVIDIA H100 80GB HBM3 (stand-in)"

    def synchronize(self, device=None) -> None:
        if _active:
            _active.sync("scalar")

    def set_device(self, device) -> None:
        pass


class _Hook(_DummyPrivateUse1Hook):
    def is_available(self) -> bool:
        return _active is not None


if not hasattr(torch, NAME):  # once per process: torch renames PrivateUse1 only once
    _setup_privateuseone_for_python_backend(NAME, backend_module=_Module(), hook=_Hook())
DEVICE = torch.device(NAME, 0)


@dataclass
class FakeAccelerator:
    syncs: list[Sync] = field(default_factory=list)
    live_bytes: int = 0
    peak_bytes: int = 0
    _storages: dict = field(default_factory=dict)  # storage pointer -> live tensors on it
    _pinned: set = field(default_factory=set)  # storage pointers of pinned host tensors

    device = DEVICE

    def __enter__(self) -> "FakeAccelerator":
        global _active
        _active = self
        self._modes = [_Functions(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _active = None

    def where(self, origin: str | None = None) -> list[str]:
        """Where the syncs were asked for (of those one package's code made, if given)."""
        return [s.where for s in self.syncs if origin is None or s.origin == origin]

    # --- bookkeeping ---
    def sync(self, kind: str) -> None:
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith("stand_in_device.py")]
        ours = [f for f in frames if "/raytrain/" in f.filename] or [f for f in frames if "/tests/" in f.filename]
        where = f"{_short(ours[-1].filename)}:{ours[-1].name}" if ours else "?"
        caller = next((f.filename for f in reversed(frames) if "/torch/" not in f.filename), "")
        origin = next((p for p in ("raytrain", "transformers", "peft", "tests") if f"/{p}/" in caller), "torch")
        self.syncs.append(Sync(kind, where, origin))

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t.pin_memory()`: a copy in (what stands for) page-locked host memory."""
        out = t.clone()
        key = out.untyped_storage().data_ptr()
        self._pinned.add(key)
        weakref.finalize(out, self._pinned.discard, key)
        return out

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def allocated(self, t: DeviceTensor) -> None:
        storage = t.inner.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key not in self._storages:
            self._storages[key] = 0
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._storages[key] += 1
        # On the host copy, not on t: Module.to swaps parameters, which a weakref to them forbids.
        weakref.finalize(t.inner, self._released, key, nbytes)

    def _released(self, key: int, nbytes: int) -> None:
        self._storages[key] -= 1
        if not self._storages[key]:
            del self._storages[key]
            self.live_bytes -= nbytes


_active: FakeAccelerator | None = None


def _is_device(x) -> bool:
    return isinstance(x, torch.device) and x.type == NAME


class _Functions(TorchFunctionMode):
    """What torch does above the dispatcher: `torch.tensor(data, device=...)` copies its data
    below the dispatch modes (made on the host here, then moved like any tensor); `.tolist()`
    and `.numpy()` refuse tensor subclasses (here: a sync, and a GPU's refusal)."""

    def __init__(self, accelerator: FakeAccelerator):
        super().__init__()
        self.accelerator = accelerator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], DeviceTensor):
            if func is torch.Tensor.numpy:
                raise TypeError(
                    f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                    f"tensor to host memory first."
                )
            if func is torch.Tensor.tolist:
                self.accelerator.sync("copy")
                return args[0].inner.tolist()
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type == NAME:
            return func(*args, **{**kwargs, "device": "cpu"}).to(DEVICE)
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    """Every op: run on the host copies; a result is on the device if an input was (or the op
    was asked for the device); a copy off the device is a sync."""

    def __init__(self, accelerator: FakeAccelerator):
        super().__init__()
        self.accelerator = accelerator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [False]

        def unwrap(x):
            if isinstance(x, DeviceTensor):
                touched[0] = True
                return x.inner
            if _is_device(x):
                touched[0] = True
                return torch.device("cpu")
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        aten = torch.ops.aten
        if (
            func is aten._to_copy.default
            and isinstance(args[0], DeviceTensor)
            and torch.device(kwargs.get("device") or DEVICE).type == "cpu"
        ):
            self.accelerator.sync("copy")  # device -> host
            return func(*a, **k)
        if func is aten.copy_.default and not isinstance(args[0], DeviceTensor) and isinstance(args[1], DeviceTensor):
            self.accelerator.sync("copy")
            func(*a, **k)
            return args[0]
        if func is aten._local_scalar_dense.default and touched[0]:
            self.accelerator.sync("scalar")
            return func(*a, **k)
        if func is aten.is_pinned.default:
            return not touched[0] and self.accelerator.is_pinned(a[0])
        if func is aten._pin_memory.default:
            if touched[0]:
                raise RuntimeError("pin_memory: a device tensor is not in host memory")
            return self.accelerator.pin(a[0])
        if (
            func is aten._to_copy.default
            and not isinstance(args[0], DeviceTensor)
            and _is_device(kwargs.get("device"))
            and not (kwargs.get("non_blocking") and self.accelerator.is_pinned(args[0]))
        ):
            self.accelerator.sync("upload")  # host -> device from pageable memory (or blocking): waits for the stream
        out = func(*a, **k)
        if not touched[0]:
            return out
        mutated = _mutated_arguments(func, args)
        if mutated is not None:  # in-place ops return the tensors they were given
            return mutated
        return tree_map(lambda x: DeviceTensor(x) if type(x) is torch.Tensor else x, out)


def _mutated_arguments(func, args):
    """For an op that returns (write-)aliases of its arguments (`x.add_(y)`, `x.copy_(y)`), those
    arguments as the caller passed them; else None."""
    returns = func._schema.returns
    if (
        func.namespace == "c10d"
        or not returns
        or any(r.alias_info is None or not r.alias_info.is_write for r in returns)
    ):
        return None
    picked = []
    for r in returns:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.before_set == r.alias_info.before_set and i < len(args):
                picked.append(args[i])
                break
    if len(picked) != len(returns):
        return None
    return picked[0] if len(picked) == 1 else tuple(picked)


def _short(filename: str) -> str:
    """A frame's file as its path under raytrain/ (`loop.py`, `objectives/__init__.py`), else its name."""
    return filename.rsplit("/raytrain/", 1)[-1] if "/raytrain/" in filename else filename.rsplit("/", 1)[-1]
