"""Helpers shared by the autograd-graph checks: sizing a graph, formatting bytes."""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Set, Tuple

import torch

from .._frames import _skipped


def graph_size(tensors: List[torch.Tensor], limit: int = 100_000) -> Tuple[int, int]:
    """(nodes, bytes of saved tensors still held) of the graphs behind `tensors` (bounded)."""
    seen: Set[int] = set()
    keep: List[Any] = []  # keep node wrappers alive so ids stay unique during the walk
    storages: Dict[Tuple[int, int], int] = {}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                v = getattr(node, attr)
            except Exception:  # freed by backward()
                continue
            for s in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(s, torch.Tensor) and s.layout is torch.strided and not s.is_meta:
                    try:
                        st = s.untyped_storage()
                        storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
                    except Exception:
                        pass
        try:
            stack.extend(n for n, _ in node.next_functions if n is not None)
        except Exception:
            pass
    return len(seen), sum(storages.values())


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def user_frames(limit: int = 12) -> List[Any]:
    """The user's frames on the current stack (innermost first), skipping torch and guard."""
    frames = []
    f = sys._getframe(1)
    while f is not None and len(frames) < limit:
        if not _skipped(f.f_code.co_filename):
            frames.append(f)
        f = f.f_back
    return frames
