"""Helpers shared by the autograd-graph checks: the one bounded graph walk, graph holders in the
user's frames, a graph's size, bytes formatted."""
from __future__ import annotations

import sys
import types
from collections import deque
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from .._frames import is_skipped

MAX_ITEMS = 4096  # items of one list/dict looked at for graph holders


class Budget:
    """How many more graph nodes walks may visit (shared by several walks)."""

    __slots__ = ("left",)

    def __init__(self, left: int):
        self.left = left


def walk(roots: Iterable[Any], budget: Budget, prune: Optional[Callable[[Any], bool]] = None) -> Iterator[Any]:
    """Each autograd node reachable from `roots` (``grad_fn`` nodes; None is skipped) once, depth first,
    until `budget` is spent; the inputs of a node for which ``prune(node)`` is true are not followed."""
    seen: Set[int] = set()
    keep: List[Any] = []  # node wrappers stay alive during the walk, so their ids stay unique
    stack = [r for r in roots if r is not None]
    while stack and budget.left > 0:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        budget.left -= 1
        yield node
        if prune is not None and prune(node):
            continue
        try:
            nxt = node.next_functions
        except Exception:
            continue
        stack.extend(n for n, _ in nxt if n is not None and id(n) not in seen)


def graph_size(tensors: List[torch.Tensor], limit: int = 100_000) -> Tuple[int, int]:
    """(nodes, bytes of saved tensors still held) of the graphs behind `tensors` (bounded)."""
    storages: Dict[Tuple[int, int], int] = {}
    nodes = 0
    for node in walk([t.grad_fn for t in tensors], Budget(limit)):
        nodes += 1
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
    return nodes, sum(storages.values())


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # attributes every module has from nn.Module.__init__
_PLAIN_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
               str, bytes, int, float, bool, complex, type(None), range)


def may_hold_graph(value: Any) -> bool:
    """Whether `value` (found in a frame) can hold a tensor with a graph at all: not a module, function, class or
    plain number or string (most of a script's globals)."""
    return not isinstance(value, _PLAIN_TYPES)


def graph_holders(name: str, value: Any, depth: int = 0) -> Iterator[Tuple[str, Any, List[torch.Tensor]]]:
    """(readable name, owner object, tensors with a graph) for a value found in a frame (bounded depth)."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield name, value, [value]
        return
    if isinstance(value, _PLAIN_TYPES) or depth > 2:
        return
    if isinstance(value, (list, tuple, deque)):
        items = value[-MAX_ITEMS:] if not isinstance(value, deque) else list(value)[-MAX_ITEMS:]
        ts = [v for v in items if isinstance(v, torch.Tensor) and v.grad_fn is not None]
        if ts:
            yield f"{name}[...]", value, ts
        # rows of tensors (a per-epoch matrix of losses): the rows together, since each row alone holds
        # one step's graphs and would lose to the variable that last filled it
        rows = [v for v in items if isinstance(v, (list, tuple)) and v]
        if len(rows) > 1:
            inner = [t for r in rows for t in r[-MAX_ITEMS:] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if inner:
                yield f"{name}[...][...]", value, inner
        # dicts of tensors (a MAML loop's fast weights per task, `history.append(params)`): the list holds them all
        dicts = [t for v in items if isinstance(v, dict) for t in list(v.values())[:256]
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if dicts:
            yield f"{name}[...]", value, dicts
        for i, v in enumerate(items[:64]):
            if isinstance(v, (dict, list, tuple)) or hasattr(v, "__dict__"):
                if not isinstance(v, torch.Tensor):
                    yield from graph_holders(f"{name}[{i}]", v, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in list(value.items())[:MAX_ITEMS]:
            if isinstance(k, str) and k.startswith("__"):
                continue
            # a tensor key (an optimizer's state) is not printed: its repr costs milliseconds and names nothing
            key = repr(k) if isinstance(k, (str, int)) else "..."
            yield from graph_holders(f"{name}[{key}]", v, depth + 1)
        return
    if isinstance(value, nn.Module):
        # torch's own bookkeeping (hook tables, state-dict hooks, `_parameters`) holds no graph a script stores
        attrs = {k: v for k, v in vars(value).items() if k not in _MODULE_INTERNALS}
        # a registered buffer (a memory bank, a queue of features) and the submodules that may hold one
        attrs.update((k, v) for k, v in value._buffers.items() if v is not None)
        attrs.update((k, v) for k, v in value._modules.items() if v is not None)
    else:
        try:
            attrs = vars(value)
        except TypeError:
            return
    for k, v in list(attrs.items())[:256]:
        if k.startswith("__"):
            continue
        yield from graph_holders(f"{name}.{k}", v, depth + 1)


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
        if not is_skipped(f.f_code.co_filename):
            frames.append(f)
        f = f.f_back
    return frames


def graph_outputs(output: Any, limit: int = 64) -> List[torch.Tensor]:
    """The tensors of a module's `output` (any structure) that carry an autograd graph, at most `limit`."""
    if isinstance(output, torch.Tensor):
        return [output] if output.grad_fn is not None else []
    from ..tensors import iter_tensors

    out = []
    for t in iter_tensors(output):
        if t.grad_fn is not None:
            out.append(t)
            if len(out) >= limit:
                break
    return out
