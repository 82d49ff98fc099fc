"""Helpers shared by the parameter checks: naming groups of parameters by their module prefix, listing them."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._frames import frame_locals
from ._graphs import user_frames


def module_prefixes(names: Iterable[str], all_names: Sequence[str], limit: int = 10) -> List[str]:
    """The shortest module prefixes that cover exactly `names` among `all_names`.

    ``layer4.0.conv.weight, layer4.0.conv.bias, ...`` (every parameter under ``layer4``) gives
    ``["layer4"]``; a parameter whose module is only partly affected is named itself. At most
    `limit` entries, in model order.
    """
    chosen = set(names)
    if not chosen:
        return []
    total: Dict[str, int] = {}
    hit: Dict[str, int] = {}
    for n in dict.fromkeys(list(all_names) + sorted(chosen - set(all_names))):
        parts = n.split(".")
        for i in range(1, len(parts)):
            pre = ".".join(parts[:i])
            total[pre] = total.get(pre, 0) + 1
            if n in chosen:
                hit[pre] = hit.get(pre, 0) + 1
    order = [n for n in dict.fromkeys(all_names) if n in chosen] + sorted(chosen - set(all_names))
    out: List[str] = []
    for n in order:
        parts = n.split(".")
        best = n
        for i in range(1, len(parts)):
            pre = ".".join(parts[:i])
            if hit.get(pre, 0) == total[pre]:
                best = pre
                break
        if best not in out:
            out.append(best)
        if len(out) >= limit:
            break
    return out


class WatchedParams:
    """The watched models' parameters, listed once per set of models (``Module.parameters()`` walks every
    module in Python: ~3 us a module, too much for a periodic look on a large model). Weak references: a
    model dropped under a global guard is not kept alive by the list. `forget()` lists them again."""

    def __init__(self, guard: Any):
        self.g = guard
        self._plist: Optional[Tuple[tuple, list, list]] = None  # (ids of the roots, refs to them, refs to params)

    def forget(self) -> None:
        self._plist = None

    def __call__(self) -> list:
        roots = self.g.roots
        key = tuple(map(id, roots))
        plist = self._plist
        if plist is None or plist[0] != key or any(r() is not m for r, m in zip(plist[1], roots)):
            self._plist = plist = (key, [weakref.ref(m) for m in roots],
                                   [weakref.ref(p) for _, p in self.g.named_parameters()])
        return [p for r in plist[2] if (p := r()) is not None]


def frame_optimizers() -> list:
    """The optimizers the user's frames name (locals, then their globals), innermost first: also those guard has
    not seen step yet (it knows an optimizer from its first step). Report-time only (a walk of the frames)."""
    found, seen = [], set()
    for fr in user_frames():
        for scope in (frame_locals(fr), fr.f_globals):
            for v in list(scope.values()):
                if isinstance(v, torch.optim.Optimizer) and id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
    return found
