"""Device mismatch: inputs vs a module's own parameters, optimizer state vs its parameters, loss operands.

Reported from a forward pre-hook, a step pre-hook and the functional losses,
i.e. *before* PyTorch raises its generic "Expected all tensors to be on the
same device" (or, for ``meta`` weights, silently computes garbage).

Cost model: host-only, no device work at all. Per module call: two dict
lookups on the module's *direct* parameters/buffers (modules without any, like
``Sequential`` or ``ReLU``, return at once) and one ``device`` comparison per
tensor argument. Per optimizer step: one state entry per parameter group
(the whole state on the optimizer's first step).
"""
from __future__ import annotations

import functools

import inspect
from typing import Any, Dict, Iterator, Tuple

import torch
from torch.nn.utils.rnn import PackedSequence

from ..tensors import iter_named_tensors
from .base import Check
from ._notes import NOTE_PREFIX, add_guard_note
from .._weak import WeakIdMap

#: functional losses watched for operands on different devices (nn.*Loss modules call these)
LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div")

_HOST = ("cpu", "meta")


def norm_device(d: torch.device) -> Tuple[str, int]:
    """(type, index) with the current device filled in, so ``cuda`` == ``cuda:0`` on device 0."""
    if d.index is not None or d.type in _HOST:
        return d.type, d.index or 0
    idx = 0
    if d.type == "cuda":
        try:
            if torch.cuda.is_available():
                idx = torch.cuda.current_device()
        except Exception:  # a CPU build under FakeTensorMode, a broken driver: index 0 is what tensors report
            idx = 0
    return d.type, idx


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when `a` and `b` name the same device (``cuda`` vs ``cuda:0`` included)."""
    return a == b or norm_device(a) == norm_device(b)


def _mixable(t: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: PyTorch lets it combine with tensors on any device."""
    return t.dim() == 0 and t.device.type == "cpu"


def _accel(d: torch.device) -> bool:
    return d.type not in _HOST


def _named_inputs(args: tuple, kwargs: dict) -> Iterator[Tuple[str, torch.Tensor]]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            yield f"args[{i}]", a
        elif isinstance(a, PackedSequence):  # batch_sizes is always on the CPU, by design
            yield f"args[{i}].data", a.data
        elif a is not None and not isinstance(a, (int, float, bool, str)):
            yield from iter_named_tensors(a, f"args[{i}]")
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, PackedSequence):
                yield f"{k}.data", v.data
            else:
                yield from iter_named_tensors(v, k)


def _arg_label(module: Any, name: str) -> str:
    """``args[0]`` -> ``input (args[0])`` using the forward signature (report time only)."""
    if not name.startswith("args["):
        return name
    try:
        end = name.index("]")
        idx, rest = int(name[5:end]), name[end + 1:]
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if idx < len(params) and params[idx].kind is not inspect.Parameter.VAR_POSITIONAL:
            return f"{params[idx].name}{rest} ({name})"
    except Exception:
        pass
    return name


def _mod_label(path: str, module: Any) -> str:
    t = type(module).__name__
    return path if path == t else f"{path} ({t})"


def _where_words(d_in: torch.device, d_model: torch.device, what: str = "input") -> str:
    if d_in.type == "cpu" and _accel(d_model):
        return f"the {what} is on the CPU and the model is on an accelerator ({d_model}). "
    if _accel(d_in) and d_model.type == "cpu":
        return f"the {what} is on an accelerator ({d_in}) and the model is on the CPU. "
    return ""


MADE_HINT = ("A tensor made inside `forward` lands on the default device (the CPU) or on the device written in the "
             "code, not where the model is: make it on the input's device, `torch.ones(..., device=x.device)` or "
             "`x.new_ones(...)`, or keep a constant as a buffer, `self.register_buffer(name, t, persistent=False)`, "
             "which `model.to(device)` moves.")

COPY_HINT = ("`tensor.cuda()` / `tensor.to(device)` returns a copy and leaves the tensor where it was: assign it, "
             "`x = x.to(device)` (unlike `model.to(device)`, which moves the model in place).")


class DeviceMismatch(Check):
    name = "device-mismatch"
    kinds = {
        "device-mismatch": ("error", "inputs and a module's parameters on different devices"),
    }
    description = "inputs vs module parameters, optimizer state vs parameters, loss operands on different devices"
    patches = {f"dev_{n}": f"torch.nn.functional.{n}" for n in LOSSES}

    def watches(self, module) -> bool:
        return bool(module._parameters or module._buffers)  # only a module's own tensors are compared

    def steady(self, module, output) -> bool:
        # Each layer's first call is compared (where a `.cuda()`-not-reassigned shows). Later calls pay
        # nothing: a mismatch appearing then (a new batch left on the CPU) raises in PyTorch, and the
        # explain check adds the cause and fix to that error.
        return False

    def __init__(self, guard):
        super().__init__(guard)
        # module type -> strict: a torch.nn built-in, whose every tensor input must match
        self._strict: Dict[type, bool] = {}
        self._opt_seen = WeakIdMap()  # optimizers whose every state tensor was compared once
        self._note: Any = None  # (where, step, message, hint) of the last finding, for the exception's note
        # (args, kwargs) of the outermost model call in progress: tells a batch that was not moved from a
        # tensor made inside forward. Held only during that call (a graph it carries must not outlive it).
        self._root_in: Any = None

    def _emit(self, where: str, message: str, hint: str, **kw) -> None:
        self._note = (where, self.g.step, message, hint)
        self.emit("device-mismatch", where, message, hint, **kw)

    def on_exception(self, exc):
        """PyTorch's device error escapes after guard reported it: add the finding as a note to the traceback."""
        if self._note is None or not isinstance(exc, RuntimeError) or "device" not in str(exc):
            return
        self._root_in = None
        where, step, message, hint = self._note
        self._note = None
        add_guard_note(exc, f"{NOTE_PREFIX}device-mismatch at {where} (step {step}): {message}\n  fix: {hint}")

    # ------------------------------------------------------------------ module inputs
    def _info(self, module) -> Tuple[bool, bool]:
        """(strict, skip) for a module whose inputs look mismatched (slow path only)."""
        strict = self._strict.get(type(module))
        if strict is None:
            strict = self._strict[type(module)] = type(module).__module__.startswith("torch.nn.")
        # accelerate's offload hooks and FSDP's CPU offload move inputs/weights inside forward: not final here
        return strict, hasattr(module, "_hf_hook") or type(module).__module__.startswith("torch.distributed.")

    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if is_root:
            self._root_in = (args, kwargs)
        params, bufs = module._parameters, module._buffers
        if not params and not bufs:
            return
        pname, dev = None, None
        for n, p in params.items():
            if p is not None:
                pname, dev = n, p.device
                break
        if dev is None:
            for n, b in bufs.items():
                if b is not None:
                    pname, dev = n, b.device
                    break
            if dev is None:
                return
        if not kwargs:
            for a in args:  # the common case, plain tensor arguments: no generator, no names
                if not isinstance(a, torch.Tensor):
                    break
                if a.device != dev and not _mixable(a) and not same_device(a.device, dev):
                    break
            else:
                return
        strict = None
        for name, t in _named_inputs(args, kwargs):
            d = t.device
            if d == dev or _mixable(t):
                continue
            if same_device(d, dev):
                continue
            if strict is None:
                strict, skip = self._info(module)
                if skip:
                    return
            if not strict and not (t.is_floating_point() or t.is_complex()):
                continue  # custom modules may take CPU index/length tensors on purpose
            self._report_input(module, path, name, d, pname, dev, is_root)
            return

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if is_root:
            self._root_in = None

    def _root_devices(self) -> set:
        """Devices of the tensors the outermost model call got (report time only)."""
        if self._root_in is None:
            return set()
        args, kwargs = self._root_in
        return {t.device for _, t in _named_inputs(args, kwargs or {}) if not _mixable(t)}

    def _report_input(self, module, path: str, arg: str, d_in: torch.device, pname: str, d_mod: torch.device,
                      is_root: bool = True):
        p = module._parameters.get(pname)
        if p is None:
            p = module._buffers.get(pname)
        full = self.g.param_name(p) if p is not None and pname in module._parameters else (
            f"{path}.{pname}" if path != type(module).__name__ else pname)
        label = _arg_label(module, arg)
        kind_word = "parameter" if pname in module._parameters else "buffer"
        words = _where_words(d_in, d_mod)
        roots = set() if is_root else self._root_devices()
        # Not the model's own input, and no input of the model is on that device: made inside forward.
        made = not is_root and not any(same_device(d, d_in) for d in roots)
        if made:
            hint, source = MADE_HINT, self.g.source()  # the line in forward that passed it
            on = ", ".join(sorted(map(str, roots)))
            made_words = (f" (made inside forward: the model's inputs are on {on})" if roots
                          else " (made inside forward: the model got no tensor input)")
        elif _accel(d_in) and d_mod.type == "cpu":
            hint, source, made_words = ("The model was never moved: call `model.to(device)` (before creating the "
                                        "optimizer), or keep the data on the CPU."), self.g.root_source, ""
        else:
            hint, source, made_words = COPY_HINT, self.g.root_source, ""
        details = {"module": type(module).__name__, "argument": label, "input_device": str(d_in),
                   kind_word: full, "module_device": str(d_mod)}
        if made:
            details["made_in_forward"] = True
        self._emit(path,
                  f"{words}{_mod_label(path, module)} got {label} on {d_in}{made_words}, but its {kind_word} "
                  f"{full} is on {d_mod}; PyTorch would fail with 'Expected all tensors to be on the same device'",
                  hint, source=source or self.g.root_source, details=details)

    # ------------------------------------------------------------------ optimizer state
    def on_step_pre(self, optimizer):
        full = id(optimizer) not in self._opt_seen.data
        if full:
            self._opt_seen[optimizer] = True
        state = optimizer.state
        if not state:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                s = state.get(p)
                if not s:
                    continue
                pdev = p.device
                for key, v in s.items():
                    # inlined `_mixable` and a plain comparison first: three state tensors a step, all fine
                    if isinstance(v, torch.Tensor) and (d := v.device) != pdev \
                            and not (d.type == "cpu" and v.dim() == 0) and not same_device(d, pdev):
                        self._report_state(optimizer, p, key, d)
                        return
                if not full:
                    break  # later steps: one representative per group

    def _report_state(self, optimizer, p, key: str, d_state: torch.device) -> None:
        name = self.g.param_name(p)
        words = _where_words(d_state, p.device, "optimizer state")
        self._emit(name,
                  f"{words}{type(optimizer).__name__} state {key!r} of parameter {name} is on {d_state}, "
                  f"but the parameter is on {p.device}; optimizer.step() would fail",
                  "The optimizer state was created or loaded while the parameters were on another device and "
                  "`model.to(device)` ran afterwards: move the model first, then build the optimizer and call "
                  "`optimizer.load_state_dict(...)` (it moves the state to the parameters' device).",
                  source=self.g.source(),
                  details={"optimizer": type(optimizer).__name__, "state": key, "state_device": str(d_state),
                           "parameter": name, "parameter_device": str(p.device)})

    # ------------------------------------------------------------------ losses
    def _on_loss(self, fn: str, args: tuple, kwargs: dict) -> None:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("target")
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return
        da, db = a.device, b.device
        if da == db or _mixable(a) or _mixable(b) or same_device(da, db):
            return
        words = _where_words(db, da, "target")
        self._emit("loss",
                  f"{words}{fn}() got its input on {da} and its target on {db}",
                  "Move the targets with the inputs: `y = y.to(device)` (Tensor.to returns a copy and must be "
                  "assigned, unlike `model.to(device)`).",
                  source=self.g.source(),
                  details={"loss": fn, "input_device": str(da), "target_device": str(db)})


for _fn in LOSSES:  # one handler per loss; a partial, not a wrapper function (no second Python call)
    setattr(DeviceMismatch, f"on_dev_{_fn}", functools.partialmethod(DeviceMismatch._on_loss, _fn))
