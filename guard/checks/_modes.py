"""Helpers shared by the train/eval mode checks: which modules' output depends on train/eval mode."""
from __future__ import annotations

import weakref
from typing import List, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd


def mode_sensitive(model: nn.Module) -> List[Tuple[str, weakref.ref]]:
    """(path, module) of the Dropout/BatchNorm modules whose train/eval mode changes the output."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, _DropoutNd):
            if float(getattr(m, "p", 0.0) or 0.0) > 0:
                out.append((name or type(m).__name__, weakref.ref(m)))
        elif isinstance(m, _BatchNorm):
            if getattr(m, "track_running_stats", True):
                out.append((name or type(m).__name__, weakref.ref(m)))
    return out
