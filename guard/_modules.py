"""Module-tree walks without recursion: deep models (hundreds of nested levels) must not make guard's own
bookkeeping the thing that hits Python's recursion limit."""
from __future__ import annotations

from typing import Tuple

from torch import nn


def tree_stats(module: nn.Module) -> Tuple[int, int]:
    """(deepest nesting level below `module`, number of distinct parameter elements), by an explicit stack."""
    seen_mods, seen_params = {id(module)}, set()
    stack = [(module, 0)]
    depth = numel = 0
    while stack:
        mod, level = stack.pop()
        depth = max(depth, level)
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                numel += p.numel()
        for child in mod._modules.values():
            if child is not None and id(child) not in seen_mods:
                seen_mods.add(id(child))
                stack.append((child, level + 1))
    return depth, numel
