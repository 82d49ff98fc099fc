"""``F.dropout(x, p)`` inside a module's ``forward`` without ``training=``: dropout stays on in ``model.eval()``.

``torch.nn.functional.dropout`` (and ``dropout1d/2d/3d``) default to
``training=True``; unlike ``nn.Dropout`` they know nothing of the module's mode,
so after ``model.eval()`` validation and inference stay random. Reported once per
source line, naming the module whose ``forward`` made the call.

Observed through declared patches of the four functions. A call that passes
``training`` (positionally or by name: ``nn.Dropout`` always does, as do
``training=self.training`` and deliberate Monte Carlo dropout) costs one length
test. Only for a call without it, the caller's frame is looked at on the host:
a call from torch's own code (``multi_head_attention_forward`` passes a ``p``
that is already 0 in eval) or from outside any module's ``forward`` is not
reported, nor is ``p == 0``, nor a call that only training reaches (``if self.training:`` around it, read
from the source). Also ``F.scaled_dot_product_attention(..., dropout_p > 0)`` called under ``no_grad`` from the
forward of a module in eval mode (it has no ``training`` argument). Nothing on the device.
"""
from __future__ import annotations

import linecache
import re
import sys
from typing import Optional, Tuple

import torch
from torch import nn

from .._frames import short_path as _short
from ._modes import forward_caller
from .base import Check

_grad_on = torch.is_grad_enabled
_PASSES_MODE = re.compile(r"\btraining\b|\btrain(?:ing)?_?mode\b|\b(?:is_)?train\s*=")  # not `x_train`, `trainer`


_BRANCH = re.compile(r"^\s*(?:if|elif)\b(?!\s+not\b)(.*)$")


def _training_only(code, lineno: int) -> bool:
    """Whether the line `lineno` of `code` runs only in training mode: under an ``if`` (or ``elif``) whose condition
    reads the mode (``if self.training:``, ``if training and p > 0:``), or as a conditional expression on the mode
    (``F.dropout(h, p) if self.training else h``)."""
    path = code.co_filename
    line = linecache.getline(path, lineno).split("#")[0]
    if re.search(r"\bif\s+[^:]*\btraining\b[^:]*\belse\b", line):
        return True
    indent = len(line) - len(line.lstrip())
    for k in range(lineno - 1, max(code.co_firstlineno, lineno - 60) - 1, -1):
        text = linecache.getline(path, k).split("#")[0]
        if not text.strip():
            continue
        ind = len(text) - len(text.lstrip())
        if ind < indent:
            indent = ind
            m = _BRANCH.match(text)
            if m and re.search(r"\btraining\b", m.group(1)):
                return True
            if text.lstrip().startswith("def "):
                return False
    return False


class DropoutInEval(Check):
    name = "dropout-in-eval"
    kinds = {"dropout-in-eval": ("warning", "F.dropout without training=self.training: dropout stays on in "
                                            "model.eval()")}
    description = "F.dropout(x, p) in a forward without training=self.training: dropout stays on in model.eval()"
    patches = {"f_dropout": "torch.nn.functional.dropout", "f_dropout1d": "torch.nn.functional.dropout1d",
               "f_dropout2d": "torch.nn.functional.dropout2d", "f_dropout3d": "torch.nn.functional.dropout3d",
               "f_sdpa": "torch.nn.functional.scaled_dot_product_attention"}

    def __init__(self, guard):
        super().__init__(guard)
        self._lines: set = set()  # source lines already looked at

    # Every nn.Dropout call in training comes here with its mode passed and grad on: one length test and one
    # grad-mode test, nothing more (a per-module-call path).
    def on_f_dropout(self, args, kwargs):
        if (len(args) < 3 and "training" not in kwargs) or not _grad_on():
            self._call("dropout", args, kwargs)

    def on_f_dropout1d(self, args, kwargs):
        if (len(args) < 3 and "training" not in kwargs) or not _grad_on():
            self._call("dropout1d", args, kwargs)

    def on_f_dropout2d(self, args, kwargs):
        if (len(args) < 3 and "training" not in kwargs) or not _grad_on():
            self._call("dropout2d", args, kwargs)

    def on_f_dropout3d(self, args, kwargs):
        if (len(args) < 3 and "training" not in kwargs) or not _grad_on():
            self._call("dropout3d", args, kwargs)

    # scaled_dot_product_attention has no `training` argument: `dropout_p=0.1` passed as is stays on in eval mode.
    # Looked at under no_grad only (evaluation), where a training step's calls cost one grad-mode test.
    def on_f_sdpa(self, args, kwargs):
        if _grad_on():
            return
        p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        if isinstance(p, (int, float)) and p > 0 and not torch.compiler.is_compiling():
            self._look_sdpa(p)

    def _look_sdpa(self, p: float) -> None:
        frame, module = forward_caller(sys._getframe(2))
        if frame is None or module is None or module.training:
            return  # torch's own calls (MultiheadAttention passes 0 in eval), or the module trains
        if not self._first_at(frame):
            return
        path = self._path(module)
        if path is None:
            return  # another model than the watched one
        source = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        mod = type(module).__name__
        self.emit("dropout-in-eval", path,
                  f"F.scaled_dot_product_attention(..., dropout_p={p}) in {path} ({mod}.{frame.f_code.co_name}, "
                  f"{source}) ran with dropout while {path} is in eval mode: scaled_dot_product_attention has no "
                  f"training argument, so a dropout_p passed as is stays on after model.eval() and validation and "
                  f"inference outputs are random",
                  f"Tie it to the module's mode: dropout_p=({p} if self.training else 0.0).",
                  source=source,
                  details={"function": "F.scaled_dot_product_attention", "p": p, "module": mod,
                           "module_training": False})

    def _first_at(self, frame) -> bool:
        """Whether `frame`'s line is looked at for the first time (one finding per source line)."""
        line = (frame.f_code.co_filename, frame.f_lineno)
        if line in self._lines:
            return False
        self._lines.add(line)
        return True

    def _path(self, module) -> Optional[str]:
        """`module`'s path; its class name under a global guard; None for a model the guard does not watch."""
        path = self.g.known_path(module)
        return type(module).__name__ if path is None and not self.g.models else path

    def _call(self, fn: str, args: tuple, kwargs: dict) -> None:
        if len(args) < 3 and "training" not in kwargs:
            self._look(fn, args, kwargs)
        elif (args[2] if len(args) > 2 else kwargs.get("training")) is True and self._evaluating():
            self._look_helper(fn, args, kwargs)

    def _evaluating(self) -> bool:
        """For ``training=True`` calls under ``no_grad`` (evaluation): the watched models are all in eval mode
        (under a global guard, any ``no_grad`` call qualifies)."""
        models = self.g.models
        return not any(m.training for m in models) if models else True

    def _look_helper(self, fn: str, args: tuple, kwargs: dict) -> None:
        """``training=True`` reached F.dropout through a helper's default (``def block(x, p, training=True)``)
        while the module calling the helper is in eval mode, and that call passed no ``training``: the
        forward forgot ``training=self.training``. A forward that says ``training=True`` itself, to the helper
        or to F.dropout, asks for Monte Carlo dropout: left alone."""
        if torch.compiler.is_compiling():
            return
        frame, module, owner = forward_caller(sys._getframe(1), with_frame=True)
        if frame is None or module is None or owner is frame or module.training:
            return
        line = (frame.f_code.co_filename, frame.f_lineno, owner.f_code.co_filename, owner.f_lineno)
        if line in self._lines:
            return
        self._lines.add(line)
        name = "training"
        code = frame.f_code
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if not any(v in params and frame.f_locals.get(v) is True for v in ("training", "train", "is_training")):
            return  # True from somewhere else than the helper's own parameter
        text = linecache.getline(owner.f_code.co_filename, owner.f_lineno).split("#")[0]
        if _PASSES_MODE.search(text):
            return  # the forward passes a mode (training=True on purpose, self.training, a variable of its own)
        path = self._path(module)
        if path is None:
            return  # another model than the watched one
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        source = f"{_short(code.co_filename)}:{frame.f_lineno}"
        forward = f"{_short(owner.f_code.co_filename)}:{owner.f_lineno}"
        mod = type(module).__name__
        self.emit("dropout-in-eval", path,
                  f"F.{fn}(..., p={p}) in the helper {code.co_name}() ({source}) ran with {name}=True, the helper's "
                  f"default, while {path} ({mod}) is in eval mode: {mod}.{owner.f_code.co_name} calls it at {forward} "
                  f"without passing the mode, so this dropout stays on after model.eval() and validation and "
                  f"inference outputs are random",
                  f"Pass the module's mode down: {code.co_name}(..., training=self.training) at {forward} (or give "
                  f"the helper no default for training, or use an nn.Dropout(p={p}) submodule).",
                  source=forward,
                  details={"function": f"F.{fn}", "p": p, "module": mod, "module_training": False,
                           "helper": code.co_name, "helper_source": source})

    def _look(self, fn: str, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if isinstance(p, (int, float)) and p == 0:
            return
        frame, module = forward_caller(sys._getframe(1))
        if frame is None:
            return
        if not self._first_at(frame):
            return
        if module is None:
            return  # outside a module's forward: not this check's pattern
        if _training_only(frame.f_code, frame.f_lineno):
            return  # `if self.training: h = F.dropout(h, p)`: never runs in eval mode
        path = self._path(module)
        if path is None:
            return  # another model than the watched one
        source = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        mod = type(module).__name__
        self.emit("dropout-in-eval", path,
                  f"F.{fn}(..., p={p}) in {path} ({mod}.{frame.f_code.co_name}, {source}) is called without "
                  f"training=: it defaults to True, so this dropout stays on after model.eval() and validation "
                  f"and inference outputs are random",
                  f"Pass the module's mode: F.{fn}(x, p={p}, training=self.training), or use an nn.Dropout(p={p}) "
                  f"submodule, which follows model.train()/model.eval(). For Monte Carlo dropout that must stay on "
                  f"in eval mode, say so: F.{fn}(x, p={p}, training=True) (silent).",
                  source=source,
                  details={"function": f"F.{fn}", "p": p, "module": mod,
                           "module_training": bool(module.training)})
