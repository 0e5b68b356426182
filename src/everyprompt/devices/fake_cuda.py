"""Device discipline without a GPU: run CPU code as though its tensors lived on CUDA.

Inside `fake_cuda()`, a tensor made on `cuda:0` (a factory given the device, `.to("cuda:0")`, a module's
`.to("cuda:0")`) is a `FakeCudaTensor`: its `.device` says cuda:0, its values live in a CPU tensor, and every
operation on it really runs, so data-dependent code (a decode loop that stops on EOS) runs as it would on
a GPU. What a GPU would refuse or pay for is caught on the way:

- an operation that mixes a fake CUDA tensor with a CPU tensor of one or more dimensions raises
  `DeviceMismatch`, naming the operation, the tensors and the line of code that ran it. This is a little
  stricter than CUDA, which copies CPU index tensors over silently: in a hot loop that copy is a transfer
  each step, and the code should have made the index on the device;
- a host sync (`.item()`, `.tolist()`, `bool()` / `int()` / `float()` of a tensor, `.cpu()`, and the
  operations whose output size depends on values: `nonzero`, boolean-mask indexing, `masked_select`,
  `unique`) is counted per line of code in `FakeCuda.syncs`;
- a blocking upload (`cpu_tensor.to(cuda)` or `copy_` without `non_blocking=True`, and `torch.tensor(data,
  device="cuda")`) is counted per line of code in `FakeCuda.uploads`: on a GPU torch waits for the
  stream after each (`cudaStreamSynchronize`), a sync as costly as a read back.

Explicit transfers stay legal: `cpu_tensor.to(cuda)` and `cuda_tensor.copy_(cpu_tensor)` are how data is
meant to reach the device. Autocast on `cuda` is off on a CPU-only build (torch warns and disables it),
so the check runs the fp32 path. Inside the context `torch.cuda.is_available()` is False also on a machine
with a GPU: code that asks whether real CUDA kernels exist (FP8 matmuls, say) must not be told yes about
tensors that live on the CPU.

This is how tests prove that a path places every tensor where its inputs are (tests/devices/); it
proves placement, not speed, and not CUDA numerics.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

CUDA = torch.device("cuda", 0)
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))

# Python-level calls that read a tensor's values on the host (a device-to-host copy and a sync on CUDA)
_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}
_aten = torch.ops.aten
# operations whose output size depends on the values: CUDA must sync to know it
_VALUE_SHAPED = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
    _aten._local_scalar_dense.default,
}
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
# explicit host-to-device transfers: a CPU source is what they are for
_TRANSFERS = {_aten.copy_.default, _aten._to_copy.default, _aten.copy.default}
# the forms in which `host_tensor.to(cuda)` reaches the mode: `_to_copy` outside inference mode, `to` itself
# (undecomposed) inside it, the decode loop's case; `non_blocking` by keyword, or `to.device`'s fourth
# argument
_UPLOADS = {_aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device}


class DeviceMismatch(RuntimeError):
    """An operation met a fake CUDA tensor and a CPU tensor: on a GPU it would fail or copy every call."""


def caller() -> str:
    """`file:line: source` of the innermost frame outside torch and this module, the code that ran the op;
    when that is a library's (transformers'), also the innermost of the caller's own code that led there."""
    found = []
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH) or path.startswith(_HERE) or "/contextlib.py" in path:
            continue
        if found and "site-packages" in path:
            continue
        found.append(f"{_short(path)}:{frame.lineno}: {(frame.line or '').strip()}")
        if "site-packages" not in path:
            break
    return ", called from ".join(found) or "<unknown>"


def _short(path: str) -> str:
    for root in sys.path:
        if root and path.startswith(os.path.abspath(root) + os.sep):
            return os.path.relpath(path, root)
    return path


def describe(tensor: torch.Tensor) -> str:
    device = "cuda:0 (fake)" if isinstance(tensor, FakeCudaTensor) else str(tensor.device)
    return f"{device} tensor {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor (`values`) that says it lives on cuda:0. The wrapper's own storage is on `meta` (no
    memory); its dispatch keys are CUDA's, as a CUDA tensor's would be."""

    values: torch.Tensor

    @staticmethod
    def __new__(cls, real: torch.Tensor, requires_grad: bool | None = None):
        shell = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        grad = real.requires_grad if requires_grad is None else requires_grad
        return torch.Tensor._make_subclass(
            cls, shell, grad, dispatch_device=True, device_for_backend_keys=CUDA
        )

    def __init__(self, real: torch.Tensor, requires_grad: bool | None = None):
        self.values = real.detach()

    @property
    def device(self) -> torch.device:
        return CUDA

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            check = _active()
            if check is not None and func not in (torch.Tensor.__repr__, torch.Tensor.__format__):
                check.count_sync(func.__name__)
            return func(_unwrap(args[0]), *args[1:], **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and _to_host(func, args[1:], kwargs):
            if _from_torch():
                # torch's own code moving a tensor to a device it read from the C++ side, which sees the
                # CPU values here (clip_grad_norm_ groups gradients so): on a GPU that device is the
                # GPU and the call a no-op, so it is one here too
                return args[0]
            check = _active()
            if check is not None:
                check.count_sync("cpu" if func is torch.Tensor.cpu else "to(cpu)")
            return func(_unwrap(args[0]).clone(), *args[1:], **kwargs)
        if func is torch.Tensor.copy_ and not isinstance(args[1], FakeCudaTensor):
            # host to device, what copy_ is for
            check = _active()
            if check is not None and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                check.count_upload("copy_")
            _unwrap(args[0]).copy_(args[1], *args[2:], **kwargs)
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a fake CUDA tensor reached {func} outside fake_cuda()")


def _to_host(func, args, kwargs) -> bool:
    """Whether a `.cpu()` / `.to(...)` call moves a (fake CUDA) tensor to the host. The C++ side sees the
    fake tensor's CPU values, so it would take such a call for a no-op: it is answered here instead."""
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _from_torch() -> bool:
    """Whether the call being answered was made by torch's own code (not the caller's)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_HERE) or path.endswith(os.path.join("torch", "overrides.py")):
            continue
        return path.startswith(_TORCH)
    return False


def _unwrap(value):
    return value.values if isinstance(value, FakeCudaTensor) else value


def _is_cuda(device) -> bool:
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_host(value):
    return torch.device("cpu") if _is_cuda(value) else value


_ACTIVE: list[FakeCuda] = []


def _active() -> FakeCuda | None:
    """The innermost `fake_cuda()` context's check, if one is open."""
    return _ACTIVE[-1] if _ACTIVE else None


class FakeCuda(TorchDispatchMode):
    """The dispatch mode behind `fake_cuda()`; `syncs` counts host syncs by the line of code that made
    them."""

    def __init__(self):
        super().__init__()
        # under the fake-tensor mode key, torch's Python bindings do not initialise CUDA for a factory
        # given device="cuda:0" (they would fail on a CPU-only build); this mode answers those factories
        self._mode_key = torch._C._TorchDispatchModeKey.FAKE
        self.syncs: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()

    def count_sync(self, what: str) -> None:
        self.syncs[f"{what} at {caller()}"] += 1

    def count_upload(self, what: str) -> None:
        self.uploads[f"{what} at {caller()}"] += 1

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        fake = [x for x in leaves if isinstance(x, FakeCudaTensor)]
        # a CUDA device argument, by keyword (factories) or by position (`aten.to.device`, which reaches
        # the mode undecomposed in inference mode), is answered on the CPU
        to_cuda = any(_is_cuda(x) for x in tree_leaves((args, kwargs)))
        if to_cuda and func in _UPLOADS and not fake and not _non_blocking(func, args, kwargs):
            self.count_upload("to")
        if to_cuda:
            args, kwargs = tree_map(_on_host, (args, kwargs))
        if not fake and not to_cuda:
            return func(*args, **kwargs)
        if fake and func not in _TRANSFERS:
            self._check_mix(func, leaves)
        if fake and (func in _VALUE_SHAPED or (func in _INDEXING and _bool_index(args))):
            self.count_sync(str(func.overloadpacket.__name__))
        inputs = {id(x.values): x for x in fake}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is _aten._local_scalar_dense.default:
            return out

        # a view of a normal tensor taken in inference mode is a normal tensor (autograd shares its
        # version counter with its base), so its wrapper is made outside inference mode too
        normal_view = func.is_view and not all(x.is_inference() for x in fake)

        def wrap(value):
            if not isinstance(value, torch.Tensor) or isinstance(value, FakeCudaTensor):
                return value
            same = inputs.get(id(value))  # an in-place op returns its input
            if same is not None:
                return same
            with torch.inference_mode(False) if normal_view else contextlib.nullcontext():
                return FakeCudaTensor(value)

        return tree_map(wrap, out)

    def _check_mix(self, func, leaves) -> None:
        cpu = [
            x for x in leaves if not isinstance(x, FakeCudaTensor) and x.device.type == "cpu" and x.dim() > 0
        ]
        if cpu:
            others = ", ".join(describe(x) for x in cpu)
            raise DeviceMismatch(
                f"{func.overloadpacket.__name__} mixes cuda:0 (fake) tensors with {others} at {caller()}"
            )

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)


def _non_blocking(func, args, kwargs) -> bool:
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return func is _aten.to.device and len(args) > 3 and bool(args[3])


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _DataFactories(TorchFunctionMode):
    """`torch.tensor(data, device="cuda")` and its kin copy their data to the device inside their C++
    binding, out of the dispatch mode's sight: here they are made on the CPU and moved (through the mode)."""

    FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in self.FACTORIES and device is not None and torch.device(device).type == "cuda":
            return func(*args, **{**kwargs, "device": "cpu"}).to(device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda():
    """A context in which "cuda:0" is a fake CUDA device on the CPU (see the module docstring); yields the
    `FakeCuda` mode, whose `syncs` count the host syncs made inside."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    # Module.to swaps each parameter for its fake CUDA copy (the default `param.data = ...` cannot
    # change a tensor's type)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with (
            mock.patch.object(torch.cuda, "is_available", return_value=False),
            FakeCuda() as mode,
            _DataFactories(),
        ):
            yield mode
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def real(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU values of a fake CUDA tensor (the tensor itself otherwise), without counting a sync."""
    return _unwrap(tensor)
