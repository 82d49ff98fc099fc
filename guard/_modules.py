"""Module-tree walks without recursion: deep models (hundreds of nested levels) must not make guard's own
bookkeeping the thing that hits Python's recursion limit."""
from __future__ import annotations

from typing import Tuple

from torch import nn
from torch.nn.parameter import is_lazy

from .tensors import unexpanded


def tree_stats(module: nn.Module) -> Tuple[int, int]:
    """(deepest nesting level below `module`, number of distinct parameter elements), by an explicit stack."""
    seen_mods, seen_params = {id(module)}, set()
    stack = [(module, 0)]
    depth = numel = 0
    while stack:
        mod, level = stack.pop()
        depth = max(depth, level)
        for p in mod._parameters.values():
            p = unexpanded(p)
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                if not is_lazy(p):  # nn.LazyLinear before its first call: no size yet
                    numel += p.numel()
        for child in mod._modules.values():
            if child is not None and id(child) not in seen_mods:
                seen_mods.add(id(child))
                stack.append((child, level + 1))
    return depth, numel


class RecursionRoom:
    """Room in Python's recursion limit for deep watched models.

    torch runs a hooked module call one Python frame deeper per level than an unhooked one, and
    guard's hooks run at the deepest point; so that a model nested as deep as plain PyTorch runs also
    runs guarded, the limit is raised by the model's depth (plus guard's few frames) while a guard is
    active, and put back on close unless someone changed it meanwhile.
    """

    THRESHOLD = 32  # models nested deeper than this are rare; only they get room

    def __init__(self) -> None:
        self.deep = 0
        self._limit: "Tuple[int, int] | None" = None  # (the user's limit, the raised one)

    def note(self, module: nn.Module) -> None:
        """Remember how deeply `module`'s layers nest."""
        depth = tree_stats(module)[0]
        if depth > self.THRESHOLD and depth > self.deep:
            self.deep = depth

    def make(self) -> None:
        """Raise the limit (once per guard; again if the user lowered it meanwhile)."""
        if not self.deep:
            return
        import sys

        limit = sys.getrecursionlimit()
        if self._limit is not None and limit == self._limit[1]:
            return
        raised = limit + self.deep + 24
        self._limit = (limit, raised)
        sys.setrecursionlimit(raised)

    def restore(self) -> None:
        import sys

        if self._limit is not None and sys.getrecursionlimit() == self._limit[1]:
            sys.setrecursionlimit(self._limit[0])
        self._limit = None
