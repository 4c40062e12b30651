"""Device guard: the host/device mix-ups that fail or stall a GPU step, caught on a CPU run.

On CUDA an op that mixes a device tensor with a host one raises, and a tensor
factory without ``device=`` builds a host tensor that must then be copied over;
on CPU both pass silently, since every tensor is on the one device. With
``DISTFLOW_DEVICE_GUARD=PATH`` each worker runs its training steps under this
``TorchFunctionMode``, which records to ``PATH`` (JSON lines, one per distinct
violation and process) what would go wrong on a GPU:

- ``factory``: a tensor factory (``torch.zeros``, ``full``, ``arange``, ``tensor``,
  ``rand*``, ...; not ``*_like`` or ``Tensor.new_*``, which inherit a tensor's
  device) called without ``device=`` from distflow's stages, algorithms or engines;
- ``mix``: an op whose inputs hold both device-resident tensors and host tensors
  (a host tensor of 0 dimensions is a scalar to CUDA ops, and allowed).

Residency, without a second device to tell them apart: every tensor is tagged
device or host when distflow code creates or moves it, and an op's outputs take
the tags of its inputs (device if any input is on the device).

    device  created or moved with a ``torch.device`` equal to the step's device (the
            worker's ``self.device``, the data plane's wire device, ``x.device``)
    host    created without ``device=``, with the string ``"cpu"`` (host on purpose),
            or moved by ``.cpu()``; ``x.device`` of a host tensor returns a marked
            host device, so ``device=x.device`` keeps ``x`` on the host

Tensors made by other code (torch internals, transformers) stay untagged and
match either. A move that returns its input (``x.to(device)`` on CPU) returns a
view, so the tag of the tensor the caller still holds does not change.

Simplified on purpose: the guard runs the training steps only (not model loading
or evaluation), and the tag is an attribute on the Python tensor object.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

GUARD_ENV = "DISTFLOW_DEVICE_GUARD"
"""Path of the violations file; unset: no guard."""
SCOPE = ("distflow.stages", "distflow.algorithms", "distflow.engines")
"""Modules whose tensor factories must name their device."""
HOST_METADATA: frozenset[tuple[str, str]] = frozenset({
    ("distflow.engines.model_ops", "collate"),  # the attention mask, from the host's seq_lens
    ("distflow.engines.model_ops", "share_prompts"),  # the shared-prompt layout, from host lengths
    ("distflow.engines.model_ops", "_logits_to_keep_takes_a_mask"),  # a one-off probe of transformers
})
"""(module, function) whose implicit-device factories build metadata meant for the host: a
micro-batch's layout is built there from ``seq_lens`` and moved with the micro-batch."""
DEVICE, HOST = "device", "host"
_TAG = "_distflow_residency"
FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.linspace, torch.logspace, torch.eye, torch.empty_strided,
    torch.scalar_tensor,
})
TRANSFERS = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_,
                       torch.Tensor.type_as, torch.Tensor.__setitem__})
"""Ops that copy data between host and device on purpose (``x[i] = host`` too): never a mix."""


def tag_of(tensor) -> str | None:
    """``device``, ``host`` or None (made outside distflow)."""
    return getattr(tensor, _TAG, None)


class DeviceGuard(TorchFunctionMode):
    """Records factory and mix violations (module docstring) while active.

    Args:
        step_device: the worker's device (CPU on the runs this is meant for).
        report: JSON-lines file the violations are appended to; None: kept in ``violations`` only.
    """

    def __init__(self, step_device: torch.device, report: str | Path | None = None):
        super().__init__()
        self.step_device = torch.device(step_device)
        self.host_device = torch.device("cpu")
        """The marked host device ``x.device`` returns for a host tensor."""
        self.report = Path(report) if report else None
        self.violations: list[dict] = []
        self._seen: set[tuple[str, str, str]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":
            return self._attribute(func, args)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func not in TRANSFERS and func not in FACTORIES:
            self._check_mix(func, inputs)
        result = func(*args, **kwargs)
        tag = self._result_tag(func, args, kwargs, inputs)
        if tag is None:
            return result
        if any(result is t for t in inputs) and tag_of(result) != tag:
            if type(result) is not torch.Tensor:
                return result
            result = result.view_as(result)  # a move that returned its input: keep the input's tag
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor) and not any(out is t for t in inputs):
                setattr(out, _TAG, tag)
        return result

    def _attribute(self, func, args):
        if func.__self__ is torch.Tensor.device and tag_of(args[0]) == HOST:
            return self.host_device
        result = func(*args)
        if isinstance(result, torch.Tensor) and tag_of(args[0]) is not None:  # .data, .grad, .T
            setattr(result, _TAG, tag_of(args[0]))
        return result

    def _result_tag(self, func, args, kwargs, inputs) -> str | None:
        """The tag of ``func``'s outputs; records a factory without a device."""
        if func in FACTORIES and not (func is torch.as_tensor and isinstance(args[0], torch.Tensor)):
            caller = _caller()
            if kwargs.get("device") is None:
                if caller[0].startswith(SCOPE) and caller[:2] not in HOST_METADATA:
                    self._record("factory", func, f"{_name(func)} without device=: give device=<the data's "
                                 "device> (e.g. x.device), or device='cpu' for metadata meant for the host")
                return HOST if caller[0].startswith("distflow") else None
            return self._residency(kwargs["device"], caller)
        if func in (torch.Tensor.to, torch.Tensor.type_as):
            target = _move_target(args, kwargs)
            if isinstance(target, torch.Tensor):
                return tag_of(target)
            if target is None:
                return tag_of(args[0])
            return self._residency(target, _caller())
        if func is torch.Tensor.cpu:
            return HOST if _caller()[0].startswith("distflow") else tag_of(args[0])
        if func is torch.Tensor.cuda:
            return DEVICE
        if func is torch.Tensor.copy_:
            return tag_of(args[0])
        tags = {tag_of(t) for t in inputs}
        return DEVICE if DEVICE in tags else HOST if HOST in tags else None

    def _residency(self, device, caller: tuple[str, str]) -> str | None:
        """The tag of a tensor made or moved with ``device`` by code in module ``caller[0]``."""
        if device is self.host_device or isinstance(device, str) and torch.device(device).type == "cpu":
            return HOST if caller[0].startswith("distflow") else None
        return DEVICE if torch.device(device) == self.step_device else HOST

    def _check_mix(self, func, inputs) -> None:
        on_device = any(tag_of(t) == DEVICE for t in inputs)
        on_host = [t for t in inputs if tag_of(t) == HOST and t.dim() > 0]
        if on_device and on_host:
            shapes = ", ".join(str(tuple(t.shape)) for t in on_host)
            self._record("mix", func, f"{_name(func)} mixes device tensors with host tensors of shapes {shapes}: "
                         "move the host ones to the device first (or build them there)")

    def _record(self, rule: str, func, message: str) -> None:
        where = _stack()
        key = (rule, _name(func), where)
        if key in self._seen:
            return
        self._seen.add(key)
        entry = {"rule": rule, "where": where, "message": message, "pid": os.getpid()}
        self.violations.append(entry)
        if self.report is not None:
            with self.report.open("a") as f:
                f.write(json.dumps(entry) + "\n")


def guard_from_environ(step_device: torch.device, environ=os.environ):
    """A ``DeviceGuard`` reporting to ``$DISTFLOW_DEVICE_GUARD`` (re-entered every step), or a no-op."""
    path = environ.get(GUARD_ENV)
    return DeviceGuard(step_device, path) if path else nullcontext()


def _move_target(args, kwargs):
    """What ``Tensor.to``/``type_as`` moves to: a tensor, a device (or its string), or None (dtype only)."""
    if "other" in kwargs or "device" in kwargs:
        return kwargs.get("other", kwargs.get("device"))
    for arg in args[1:]:
        if isinstance(arg, (torch.Tensor, torch.device, str)):
            return arg
    return None


def _frames():
    """Frames outside torch and this module, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == __name__ or module.startswith("torch")):
            yield frame, module
        frame = frame.f_back


def _caller() -> tuple[str, str]:
    """(module, function) of the innermost frame outside torch and this module."""
    for frame, module in _frames():
        return module, frame.f_code.co_name
    return "", ""


def _stack(depth: int = 3) -> str:
    """Where the violation happened: the innermost frames outside torch, ``module:function:line``."""
    out = []
    for frame, module in _frames():
        out.append(f"{module}:{frame.f_code.co_name}:{frame.f_lineno}")
        if len(out) == depth:
            break
    return " <- ".join(out)


def _name(func) -> str:
    """``torch.full``, ``Tensor.add``: how the code calls it, not torch's internal class names."""
    owner, _, name = (getattr(func, "__qualname__", None) or repr(func)).rpartition(".")
    return {"_VariableFunctionsClass": "torch", "TensorBase": "Tensor", "_TensorBase": "Tensor"}.get(owner, owner) \
        + "." + name if owner else name
