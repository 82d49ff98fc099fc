"""The staging engine: device values kept until the step ends, then read with one transfer per device.

Checks stage 0-dim device tensors (`Staging.stage`, `stage_flag`) or register collectors that
gather many values at once (`stage_batch`); `Staging.resolve` reads them all together, so a
healthy step costs one host synchronisation per device instead of one per value.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .findings import GuardError
from . import tensors as _tensors
from .tensors import Norms, stored_values, without_grad
from ._weak import WeakIdMap

MAX_STAGED = 8192

_VALUE, _FLAG, _BATCH = 0, 1, 2

Collector = Callable[[], List[Tuple[torch.Tensor, Callable[[List[float]], None]]]]


class GradNorms:
    """Per-parameter gradient norms of one step, kept on the device until the step is resolved."""

    __slots__ = ("params", "totals", "stacked", "_all", "_namer", "_names")

    def __init__(self, params: List[torch.Tensor], namer: Callable[[torch.Tensor], str],
                 grads: Optional[List[torch.Tensor]] = None, key: Any = None):
        self.params, self._namer, self._names = params, namer, None
        # Gradients made with create_graph=True carry history: their norms must not.
        self._all = without_grad(Norms, [p.grad for p in params] if grads is None else grads,
                                 key=tuple(map(id, params)) if key is None else key)
        self.totals, self.stacked = self._all.totals, self._all.stacked

    @property
    def norms(self) -> List[torch.Tensor]:
        """0-dim norm per parameter (made on first use)."""
        return self._all.norms

    @property
    def names(self) -> List[str]:
        """Parameter names, computed on first use (only needed once something fired)."""
        if self._names is None:
            self._names = [self._namer(p) for p in self.params]
        return self._names

    def per_param(self) -> List[float]:
        """Host values of every norm (one sync; call only after something fired)."""
        if not self.norms:
            return []
        return [float(v) for v in torch.stack([n.float().cpu() for n in self.norms]).tolist()]


class Staging:
    """Staged device values of the current step, the step's loss and its gradient norms.

    `contain(owner, exc)` is told when a callback or collector raised (`owner` is the bound
    method's object, if any); `on_full()` runs when too many values are waiting.
    """

    def __init__(self, contain: Callable[[Any, BaseException], None], on_full: Callable[[], None]):
        self._contain = contain
        self._on_full = on_full
        self.clear()

    def clear(self) -> None:
        """Forget everything pending (the guard closed)."""
        self._staged: List[Tuple[torch.Tensor, Callable, int]] = []
        self._collectors: List[Collector] = []
        self._loss: Optional[torch.Tensor] = None
        self.step_loss: Optional[float] = None  # host value of the loss of the step being resolved
        self.step_norms: Dict[int, GradNorms] = {}  # this step's norms by id(optimizer) (read by `Guard.grad_norms`)
        # per optimizer: (its groups' (id, length) of the params lists, their parameters flattened, the
        # key of that list, whether every gradient was a plain strided, non-meta tensor when last seen)
        self._flat = WeakIdMap()  # dies with the optimizer (no parameters kept past it)

    def pending(self) -> Dict[str, int]:
        """How much is waiting: staged values, collectors, cached gradient norms."""
        return {"staged": len(self._staged), "collectors": len(self._collectors), "grad_norms": len(self.step_norms)}

    def stage(self, value: torch.Tensor, callback: Callable[[float], None]) -> None:
        """Keep a 0-dim device tensor until the step is resolved; then ``callback(host_value)``."""
        self._staged.append((value, callback, _VALUE))
        if len(self._staged) > MAX_STAGED:
            self._on_full()

    def stage_flag(self, ok: torch.Tensor, on_fail: Callable[[], None]) -> None:
        """Keep a 0-dim bool tensor (True = fine); ``on_fail()`` runs at resolution if it is False."""
        self._staged.append((ok, on_fail, _FLAG))
        if len(self._staged) > MAX_STAGED:
            self._on_full()

    def stage_batch(self, collect: Collector) -> None:
        """Register `collect` for this step: at resolution it returns ``[(tensor, callback(values))]``.

        For checks that gather many device values per step themselves: they stack once, at the end,
        instead of staging each value (the cheapest path for per-module-call values).
        """
        self._collectors.append(collect)

    def add_loss(self, tensors: Any) -> None:
        """Add the scalar(s) backward() was called on to this step's loss (for the timeline)."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        for t in ts:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and t.device.type != "meta":
                v = _scalar(t)
                v = v if v.dtype is torch.float32 else v.float()
                self._loss = v if self._loss is None or self._loss.device != v.device else self._loss + v

    def grad_norms(self, optimizer: Optional[torch.optim.Optimizer], params: Callable[[], List[torch.Tensor]],
                   namer: Callable[[torch.Tensor], str]) -> GradNorms:
        """This step's gradient norms of `optimizer`'s parameters (or ``params()``), computed once per step."""
        key = id(optimizer)
        gn = self.step_norms.get(key)
        if gn is None:
            gn = self.step_norms[key] = self._make_grad_norms(optimizer, params, namer)
        return gn

    def _make_grad_norms(self, optimizer: Optional[torch.optim.Optimizer], params: Callable[[], List[torch.Tensor]],
                         namer: Callable[[torch.Tensor], str]) -> GradNorms:
        """One Python pass over the parameters per step: the optimizer's flattened list is kept while its
        groups stay the same, and gradients seen plain (strided, not meta) are not tested again until
        the list of parameters with a gradient changes (the norms then fall back to the full filter)."""
        flat = self._flat.data.get(id(optimizer)) if optimizer is not None else None
        shape = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups) if optimizer is not None else None
        if flat is None or flat[0] != shape:
            # (a model's "parameters" replaced by non-leaf tensors, learn2learn's clones: reading their .grad warns)
            ps = ([p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else
                  [p for p in params() if p.is_leaf])
            flat = (shape, ps, tuple(map(id, ps)), False)
            if optimizer is not None:
                self._flat[optimizer] = flat
        ps = flat[1]
        grads = [g for p in ps if (g := p.grad) is not None]
        if len(grads) == len(ps):
            if flat[3]:
                try:
                    return GradNorms(ps, namer, grads, flat[2])
                except RuntimeError:  # a gradient that is no longer plain (made sparse by hand): filter,
                    if optimizer is not None:  # and test them again from now on
                        self._flat[optimizer] = flat[:3] + (False,)
            elif all(g.layout is torch.strided and not g.is_meta for g in grads):
                if optimizer is not None:
                    self._flat[optimizer] = flat[:3] + (True,)
                return GradNorms(ps, namer, grads, flat[2])
        strided = torch.strided
        kept, grads, sparse = [], [], False
        for p in ps:
            gr = p.grad
            if gr is None or gr.is_meta:
                continue
            if gr.layout is not strided:  # a sparse gradient (an nn.Embedding(sparse=True)'s): its stored values
                gr = stored_values(gr)
                if gr is None:
                    continue
                sparse = True
            kept.append(p)
            grads.append(gr)
        # the stored values' shapes change from step to step: no grouping cached for them
        key = tuple((id(p), tuple(g.shape)) for p, g in zip(kept, grads)) if sparse else None
        return GradNorms(kept, namer, grads, key)

    def forget_grad_norms(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this step's cached norms of `optimizer` (the gradients changed in place)."""
        self.step_norms.pop(id(optimizer), None)

    def has_staged(self) -> bool:
        """Whether values or collectors wait for resolution (the step's loss and norms aside)."""
        return bool(self._staged or self._collectors)

    def resolve(self, keep_step_values: bool = False) -> Dict[str, Any]:
        """Read every staged value with one transfer per device and run the callbacks.

        Returns the step's timeline values (``loss``, ``grad_norm``) that were pending; with
        `keep_step_values` (a mid-step read for the user) those stay for the step's own resolution.
        """
        if keep_step_values:
            loss, norms = self._loss, self.step_norms
            self._loss, self.step_norms = None, {}
            try:
                self.resolve()
            finally:
                self._loss, self.step_norms = loss, norms
            return {}
        staged, self._staged = self._staged, []
        collectors, self._collectors = self._collectors, []
        for collect in collectors:
            try:
                staged.extend((t, cb, _BATCH) for t, cb in collect())
            except GuardError:
                raise
            except Exception as exc:
                self._contain(getattr(collect, "__self__", None), exc)
        loss, self._loss = self._loss, None
        norms, self.step_norms = self.step_norms, {}
        entry: Dict[str, Any] = {}
        self.step_loss = None
        if loss is not None:
            # first: the checks' callbacks may compare their values with the step's loss (`step_loss`)
            staged.insert(0, (loss, lambda v: self._loss_read(entry, v), _VALUE))
        totals: List[float] = []
        for gn in norms.values():
            for t in gn.totals.values():
                staged.append((t, totals.append, _VALUE))
        if staged:
            try:
                values = read(staged)
            except Exception:
                staged, values = self._read_each(staged)
            for (t, cb, kind), v in zip(staged, values):
                try:
                    if kind != _FLAG:
                        cb(v)
                    elif not v:
                        cb()
                except GuardError:
                    raise
                except Exception as exc:
                    self._contain(getattr(cb, "__self__", None), exc)
        if totals:
            entry["grad_norm"] = float(sum(t * t for t in totals) ** 0.5)
        return entry


    def _loss_read(self, entry: Dict[str, Any], v: float) -> None:
        entry["loss"] = self.step_loss = v

    def _read_each(self, staged: List[Tuple[torch.Tensor, Any, int]]) -> Tuple[List[Tuple[torch.Tensor, Any, int]], List[Any]]:
        """The batched read failed (a value that cannot be read on the host): read entry by entry, and
        leave out, as its check's failure, each one that cannot be read; the others keep their step."""
        kept, values = [], []
        for entry in staged:
            try:
                values.append(read([entry])[0])
            except Exception as exc:
                self._contain(getattr(entry[1], "__self__", None), exc)
                continue
            kept.append(entry)
        return kept, values


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 0-dim tensor without autograd history; no op where it is one already (small ops add up per step)."""
    t = t.detach() if t.requires_grad else t
    return t if t.dim() == 0 else t.reshape(())


def _host_value(t: torch.Tensor, kind: int) -> Any:
    """A CPU tensor's staged value: a float (0-dim entries) or a list of floats (`_BATCH` entries)."""
    t = t.detach() if t.requires_grad else t
    if kind == _BATCH:
        t = t if t.dtype is torch.float32 else t.to(torch.float32)
        return (t if t.dim() == 1 else t.reshape(-1)).tolist()  # a stack of norms is 1-d already: no view op
    v = t.item() if t.numel() == 1 else float("nan")
    return float(v) if not isinstance(v, bool) else v


def read(staged: Sequence[Tuple[torch.Tensor, Any, int]]) -> List[Any]:
    """Host values of all staged tensors: batched per device and kind, one transfer per device
    (CPU values are read one by one while `tensors.HOST_DIRECT` is on: there is nothing to transfer).

    0-dim entries give a float each, `_BATCH` entries a list of floats.
    """
    groups: Dict[torch.device, Tuple[List[int], List[int], List[int]]] = {}
    out: List[Any] = [0.0] * len(staged)
    seen: Dict[int, Any] = {}  # a tensor staged by several checks (the step's gradient norm) is read once
    for i, (t, _, kind) in enumerate(staged):
        if t.is_cpu and _tensors.HOST_DIRECT:
            # On the host there is no transfer to batch: reading each value costs less than the stack
            # and cat that would gather them (two kernels a step on a small model).
            if kind == _BATCH:
                out[i] = _host_value(t, kind)
                continue
            v = seen.get(id(t))  # the tensors stay alive in `staged`: their ids are not reused meanwhile
            if v is None:
                v = seen[id(t)] = _host_value(t, kind)
            out[i] = v
            continue
        groups.setdefault(t.device, ([], [], []))[kind].append(i)
    for lists in groups.values():
        parts: List[torch.Tensor] = []
        spans: List[Tuple[int, int, int]] = []  # (entry, start, length); length -1: a scalar
        pos = 0
        for kind, idx in enumerate(lists):
            if not idx:
                continue
            if kind == _BATCH:
                for i in idx:
                    v = staged[i][0]
                    v = v.detach() if v.requires_grad else v
                    v = v if v.dim() == 1 else v.reshape(-1)
                    v = v if v.dtype is torch.float32 else v.to(torch.float32)
                    parts.append(v)
                    spans.append((i, pos, v.numel()))
                    pos += v.numel()
                continue
            ts = torch.stack([_scalar(staged[i][0]) for i in idx])
            parts.append(ts if ts.dtype is torch.float32 else ts.to(torch.float32))
            for i in idx:
                spans.append((i, pos, -1))
                pos += 1
        vals = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        for i, start, n in spans:
            out[i] = vals[start] if n < 0 else vals[start:start + n]
    return out
