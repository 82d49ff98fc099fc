"""Helpers shared by the train/eval mode checks: which modules' output depends on train/eval mode, and which
module's forward called a functional dropout."""
from __future__ import annotations

import linecache
import os
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .._frames import short_path, source_text
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd


def mode_sensitive(model: nn.Module) -> List[Tuple[str, weakref.ref]]:
    """(path, module) of the modules whose train/eval mode changes the output: Dropout and BatchNorm, and the
    dropout built into `nn.LSTM`/`nn.GRU`/`nn.RNN` (between stacked layers) and `nn.MultiheadAttention`."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, _DropoutNd):
            if float(getattr(m, "p", 0.0) or 0.0) > 0:
                out.append((name or type(m).__name__, weakref.ref(m)))
        elif isinstance(m, nn.RNNBase):
            if float(getattr(m, "dropout", 0.0) or 0.0) > 0 and getattr(m, "num_layers", 1) > 1:
                out.append((name or type(m).__name__, weakref.ref(m)))
        elif isinstance(m, nn.MultiheadAttention):
            if float(getattr(m, "dropout", 0.0) or 0.0) > 0:
                out.append((name or type(m).__name__, weakref.ref(m)))
        elif isinstance(m, _BatchNorm):
            if getattr(m, "track_running_stats", True) and _mode_read(type(m).forward):
                out.append((name or type(m).__name__, weakref.ref(m)))
    return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_read_cache: dict = {}


def _mode_read(forward: Any) -> bool:
    """Whether a BatchNorm's `forward` depends on train/eval mode: torch's does; one of the user's own (a subclass, or
    a patch of ``nn.BatchNorm2d.forward``: MEMO's prior BN, which mixes the running and the batch statistics in
    both modes) only when it reads ``self.training`` or hands over to ``super()``."""
    hit = _read_cache.get(forward)
    if hit is None:
        code = getattr(forward, "__code__", None)
        if code is None or os.path.abspath(code.co_filename).startswith(_TORCH_DIR):
            hit = True
        else:
            src = source_text(forward)
            hit = src is None or "training" in src or "super(" in src
        if len(_read_cache) < 256:
            _read_cache[forward] = hit
    return hit


#: the functional dropouts, patched for the mode checks (shared with dropout-in-eval: one wrapper each)
F_DROPOUT_PATCHES = {"f_dropout": "torch.nn.functional.dropout", "f_dropout1d": "torch.nn.functional.dropout1d",
                     "f_dropout2d": "torch.nn.functional.dropout2d", "f_dropout3d": "torch.nn.functional.dropout3d"}


def dropout_site(frame: Any) -> Optional[Tuple[nn.Module, str, bool]]:
    """(the module whose forward called F.dropout, its source line, whether that line passes the module's mode:
    ``training=self.training``), looked up from the patched function's frame; None from torch's own code
    (``nn.Dropout``) or outside any module's forward."""
    call, module = forward_caller(frame)
    if call is None or module is None:
        return None
    line = linecache.getline(call.f_code.co_filename, call.f_lineno).split("#")[0]
    fn = call.f_code.co_filename
    at = fn.rfind("site-packages")  # a library's model (transformers/models/bart/...): from its package on
    shown = fn[at + len("site-packages") + 1:] if at >= 0 else short_path(fn)
    return (module, f"{shown}:{call.f_lineno}", ".training" in line)


_GUARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MAX_UP = 4  # user frames searched for the module whose forward called (helpers called from forward)


def method_owner(f: Any) -> Optional[nn.Module]:
    """The module whose method frame `f` runs, or None. A method's first parameter, whatever its name (`def
    forward(s, x)`); a plain function taking a module first (`def block(lin, x, p)`, `def greedy(m, src)`) is a
    helper, not that module's method."""
    co = f.f_code
    first = co.co_varnames[0] if co.co_argcount else None
    me = f.f_locals.get(first) if first else None
    if isinstance(me, nn.Module) and (first == "self" or getattr(getattr(type(me), co.co_name, None),
                                                                 "__code__", None) is co):
        return me
    return None


def forward_caller(frame: Any, with_frame: bool = False) -> Tuple[Optional[object], ...]:
    """(frame that called the patched function, the module whose forward it runs in) or (None, None);
    `with_frame` adds the frame of that module's method (a helper's caller)."""
    f = frame
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_GUARD):
        f = f.f_back
    if f is None or os.path.abspath(f.f_code.co_filename).startswith(_TORCH):
        return (None, None, None) if with_frame else (None, None)  # torch's own code: not the user's line
    call = f
    for _ in range(_MAX_UP):
        if f is None or os.path.abspath(f.f_code.co_filename).startswith(_TORCH):
            break  # left the forward (torch's Module.__call__)
        me = method_owner(f)
        if me is not None:
            return (call, me, f) if with_frame else (call, me)
        f = f.f_back
    return (call, None, None) if with_frame else (call, None)
