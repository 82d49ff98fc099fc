"""Helpers shared by the optimizer checks: naming groups of parameters by their module prefix."""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence


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
