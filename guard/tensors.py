"""Walking the tensors inside arbitrary Python structures, cheaply."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
MAX_DEPTH = 6
MAX_ITEMS = 256


_FOREIGN = ("torch", "numpy", "builtins", "collections", "functools", "typing", "pandas", "PIL", "scipy", "sklearn")


def _attributes(obj: Any) -> Optional[Dict[str, Any]]:
    """The attributes of a plain object of a class of the user's code (a PyG-style graph batch holding `data.pos`,
    `data.batch`), or None: modules (their weights are no input), classes, callables and library objects."""
    if isinstance(obj, (torch.nn.Module, type)) or callable(obj):
        return None
    if (type(obj).__module__ or "").partition(".")[0] in _FOREIGN:
        return None
    d = getattr(obj, "__dict__", None)
    return d if type(d) is dict else None


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in tensors/tuples/lists/dicts/namedtuples/dataclasses/mappings and plain objects of the user's own
    classes (bounded depth and count)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if _depth >= MAX_DEPTH or obj is None or isinstance(obj, (int, float, str, bytes, bool)):
        return
    if isinstance(obj, (tuple, list)):
        items = obj[:MAX_ITEMS]
    elif isinstance(obj, dict):
        items = list(obj.values())[:MAX_ITEMS]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)][:MAX_ITEMS]
    elif isinstance(obj, Mapping):
        items = list(obj.values())[:MAX_ITEMS]
    else:
        attrs = _attributes(obj)
        if attrs is None:
            return
        items = list(attrs.values())[:MAX_ITEMS]
    for it in items:
        if isinstance(it, torch.Tensor):
            yield it
        else:
            yield from iter_tensors(it, _depth + 1)


def iter_named_tensors(obj: Any, prefix: str = "", _depth: int = 0) -> Iterator[Tuple[str, torch.Tensor]]:
    """Like `iter_tensors`, with a readable location (``[0]``, ``['x']``, ``.field``)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        return
    if _depth >= MAX_DEPTH or obj is None or isinstance(obj, (int, float, str, bytes, bool)):
        return
    if isinstance(obj, (tuple, list)):
        pairs = [(f"{prefix}[{i}]", v) for i, v in enumerate(obj[:MAX_ITEMS])]
    elif isinstance(obj, dict):
        pairs = [(f"{prefix}[{k!r}]", v) for k, v in list(obj.items())[:MAX_ITEMS]]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        pairs = [(f"{prefix}.{f.name}", getattr(obj, f.name, None)) for f in dataclasses.fields(obj)][:MAX_ITEMS]
    elif isinstance(obj, Mapping):
        pairs = [(f"{prefix}[{k!r}]", v) for k, v in list(obj.items())[:MAX_ITEMS]]
    else:
        attrs = _attributes(obj)
        if attrs is None:
            return
        pairs = [(f"{prefix}.{k}", v) for k, v in list(attrs.items())[:MAX_ITEMS]]
    for name, v in pairs:
        yield from iter_named_tensors(v, name, _depth + 1)


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    for t in iter_tensors(obj):
        return t
    return None


_SCREEN_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                            torch.complex64, torch.complex128})


_is_compiling = torch.compiler.is_compiling  # the same function objects (Dynamo knows them by identity),
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # without two attribute walks per screened tensor
_STRIDED = torch.strided


try:  # the per-sample-gradient wrapper torch swaps in for a module's parameters during one call
    from torch.nn.utils._expanded_weights import ExpandedWeight as _ExpandedWeight
except Exception:  # pragma: no cover - a torch without it
    _ExpandedWeight = ()


def unexpanded(t: Any) -> Any:
    """The parameter itself for an ``ExpandedWeight`` (``call_for_per_sample_grads``, Opacus-style DP-SGD), whose
    tensor methods mostly raise; anything else as it is."""
    return t.orig_weight if isinstance(t, _ExpandedWeight) else t


def screenable(t: torch.Tensor) -> bool:
    """A plain, dense, floating tensor whose values can be reduced on its device."""
    return (
        type(t) in _PLAIN
        and t.dtype in _SCREEN_DTYPES
        and t.layout is _STRIDED
        and not t.is_nested  # nested tensors report a strided layout but have no sizes/sum
        # vmap/grad-wrapped values must not escape their transform (Dynamo cannot trace the test: skip it there)
        and (_is_compiling() or not _is_wrapped(t))
        and not t.is_meta
        and t.numel() > 0
    )


def stored_values(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The dense values a sparse (COO, CSR, ...) or jagged nested tensor stores, when they can be screened: NaN
    in a sparse or nested batch is dirty data as in a dense one. None otherwise (and for every dense tensor)."""
    if t.layout is _STRIDED and not t.is_nested:
        return None
    try:
        if t.is_nested:
            v = t.values() if t.layout is torch.jagged else None
        elif t.layout is torch.sparse_coo:
            v = t._values()
        else:
            v = t.values()
    except Exception:  # a layout without a values buffer (a strided nested tensor)
        return None
    return v if v is not None and screenable(v) else None


def distinct_view(t: torch.Tensor) -> torch.Tensor:
    """`t` without its broadcast (stride-0) dimensions: an ``expand``ed view's distinct values."""
    st = t.stride()
    if 0 in st:
        return t[tuple(0 if k == 0 else slice(None) for k in st)]
    return t


def nonfinite_counts(t: torch.Tensor) -> dict:
    """Exact counts of NaN, +Inf, -Inf (syncs; only for a tensor already flagged; expanded views count once)."""
    d = distinct_view(t.detach())
    if d.is_complex():
        d = torch.view_as_real(d)
    return {
        "nan": int(torch.isnan(d).sum()),
        "posinf": int(torch.isposinf(d).sum()),
        "neginf": int(torch.isneginf(d).sum()),
        "numel": int(d.numel()),
    }


def finite_stats(t: torch.Tensor) -> dict:
    """min/max/mean/std of the finite values (syncs; for a finding's details)."""
    d = distinct_view(t.detach())
    if d.is_complex():
        d = d.abs()
    d = d.float()
    f = d[torch.isfinite(d)]
    if f.numel() == 0:
        return {"finite": 0}
    return {"min": float(f.min()), "max": float(f.max()), "mean": float(f.mean()),
            "std": float(f.std()) if f.numel() > 1 else 0.0, "finite": int(f.numel())}


def _group_by_device(tensors: List[torch.Tensor]) -> List[List[int]]:
    """Indices of `tensors` grouped by (device, dtype) (the slow path: mixed lists only)."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


# On the CPU every tensor costs a kernel dispatch (about a microsecond) in ``_foreach_norm``; small
# tensors of one shape are cheaper copied into one stack and reduced by one kernel. Accelerators run
# ``_foreach_norm`` as one fused kernel, so there nothing is copied.
_SMALL = 1 << 16  # elements per tensor
_STACK_BYTES = 1 << 25  # copied at most per call
# A stack and its reduction cost about as much as ~8 tensors' dispatches inside ``_foreach_norm``
# (measured in a training step, caches cold): smaller groups go to ``_foreach_norm``.
_MIN_STACK = 10
_plans: Dict[Any, List[Tuple[bool, List[int]]]] = {}


def _cpu_plan(tensors: List[torch.Tensor], key: Any) -> Optional[List[Tuple[bool, List[int]]]]:
    """[(stack?, indices)] for all-CPU `tensors`: same-shape small ones stacked; None when not all on the CPU."""
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        return plan
    groups: Dict[Any, List[int]] = {}
    rest: List[int] = []
    budget = _STACK_BYTES
    for i, t in enumerate(tensors):
        if not t.is_cpu:
            return None
        n = t.numel()
        if n <= _SMALL and budget >= n * 8:
            budget -= n * 8
            groups.setdefault((t.shape, t.dtype), []).append(i)
        else:
            rest.append(i)
    plan = []
    for idx in groups.values():
        if len(idx) >= _MIN_STACK:
            plan.append((True, idx))
        else:
            rest.extend(idx)
    if rest:
        plan.append((False, sorted(rest)))
    if key is not None:
        if len(_plans) > 64:
            _plans.clear()
        _plans[key] = plan
    return plan


class Norms:
    """Per-tensor L2 norms of a list of tensors, kept on their devices.

    ``stacked`` maps each device to ``(1-d float32 tensor of norms, the tensors' indices)``;
    ``totals`` maps each device to the joint norm; ``norms[i]`` is tensor i's 0-dim norm (made on
    first use: the stacked form is what a step reads). `key` names a list whose shapes stay the
    same from call to call (a model's parameters), so that its CPU grouping is worked out once.
    """

    __slots__ = ("stacked", "totals", "_norms", "_n")

    def __init__(self, tensors: List[torch.Tensor], key: Any = None):
        self.stacked: Dict[torch.device, Tuple[torch.Tensor, List[int]]] = {}
        self.totals: Dict[torch.device, torch.Tensor] = {}
        self._norms: Optional[List[torch.Tensor]] = None
        self._n = len(tensors)
        if not tensors:
            return
        groups = self._cpu(tensors, key) if tensors[0].is_cpu else None
        if groups is None:
            try:  # the common case: one device, one dtype (no per-tensor Python pass to group them)
                norms = list(torch._foreach_norm(tensors))
                groups = [(torch.stack(norms), list(range(len(tensors))))]
                self._norms = norms
            except RuntimeError:  # mixed devices (a model split across GPUs)
                by_dev: Dict[torch.device, Tuple[List[torch.Tensor], List[int]]] = {}
                for idx in _group_by_device(tensors):
                    res = torch._foreach_norm([tensors[i] for i in idx])
                    ns, ids = by_dev.setdefault(res[0].device, ([], []))
                    ns.extend(n.float() for n in res)
                    ids.extend(idx)
                groups = [(torch.stack(ns), ids) for ns, ids in by_dev.values()]
        for st, ids in groups:
            st = st if st.dtype == torch.float32 else st.float()
            self.stacked[st.device] = (st, ids)
            self.totals[st.device] = torch.linalg.vector_norm(st)

    @staticmethod
    def _cpu(tensors: List[torch.Tensor], key: Any) -> Optional[List[Tuple[torch.Tensor, List[int]]]]:
        plan = _cpu_plan(tensors, key)
        if plan is None or not any(stack for stack, _ in plan):
            return None
        try:
            parts, ids = [], []
            for stack, idx in plan:
                if stack:
                    st = torch.stack([tensors[i] for i in idx]).reshape(len(idx), -1)
                    parts.append(torch.linalg.vector_norm(st, dim=1))
                else:
                    parts.append(torch.stack(list(torch._foreach_norm([tensors[i] for i in idx]))))
                ids.extend(idx)
        except RuntimeError:  # a cached plan for ids now reused by other tensors: plan afresh
            _plans.pop(key, None)
            return Norms._cpu(tensors, None) if key is not None else None
        parts = [p if p.dtype == torch.float32 else p.float() for p in parts]
        return [(torch.cat(parts) if len(parts) > 1 else parts[0], ids)]

    @property
    def norms(self) -> List[torch.Tensor]:
        if self._norms is None:
            out: List[Optional[torch.Tensor]] = [None] * self._n
            for st, ids in self.stacked.values():
                for k, i in enumerate(ids):
                    out[i] = st[k]
            self._norms = out  # type: ignore[assignment]
        return self._norms  # type: ignore[return-value]


_set_grad = getattr(torch._C, "_set_grad_enabled", None)

#: Staged CPU values are read one by one (`.item()`/`.tolist()`): on the host there is no transfer to
#: batch, and the stack/cat that would gather them cost more. False makes CPU take the accelerator path
#: (one batched read per step), which is how the tests exercise that path without a GPU.
HOST_DIRECT = True


def as_float(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 for a norm: a complex tensor as its real view (``.float()`` would drop the imaginary part,
    with a warning on the user's stderr)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t if t.dtype is torch.float32 else t.float()


def without_grad(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with autograd recording off: ``torch.no_grad()`` without its context-manager
    machinery (several Python calls), for the per-step hot path."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if _set_grad is None:  # a torch without the private switch
        with torch.no_grad():
            return fn(*args, **kwargs)
    _set_grad(False)
    try:
        return fn(*args, **kwargs)
    finally:
        _set_grad(True)


def fused_norms(tensors: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Dict[torch.device, torch.Tensor]]:
    """Per-tensor L2 norms (``torch._foreach_norm``) and their joint norm per device."""
    n = Norms(tensors)
    return n.norms, n.totals
