"""Evaluation outside ``torch.no_grad()``: model forwards whose graphs are never back-propagated.

Each grad-enabled call of a guarded root model whose outputs require grad gets a
small tag in its output nodes' ``metadata``. Every ``backward()`` (and
``torch.autograd.grad``) walks its graph from the roots, only while some tagged
forward of the current step is still unclaimed, and only until all of them are
found (a loss built on the model output reaches the output node in a few
nodes). At the end of a training step a forward that no backward reached, and
whose graph is gone (it can no longer be back-propagated), was built for
nothing; one whose graph is still alive is given two more steps (GAN loops
back-propagate a generator output after the discriminator's step). At the end
of the guard every unclaimed forward counts. Steps without any ``backward()``
are not judged, and a guard that never saw one reports nothing (inference
scripts, ``autograd.grad``-only loops).

Cost: one ``torch.is_grad_enabled()`` and a few attribute writes per root model
call; nothing per inner module; graph walks only while a forward is unclaimed.
Reported once; afterwards the check stops tracking.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch

from ._graphs import fmt_bytes, graph_size
from .base import Check

KEY = "guard.eval_no_grad"
WALK_BUDGET = 50_000  # nodes per backward walk; beyond it unclaimed forwards are given the benefit of the doubt
MAX_PENDING = 4096
GRACE = 2  # steps a still-alive, unclaimed graph may wait for its backward
MAX_OUTPUTS = 8


class _Tag:
    __slots__ = ("rec", "__weakref__")

    def __init__(self, rec: "_Fwd"):
        self.rec = rec


class _Fwd:
    __slots__ = ("step", "source", "path", "used", "tags", "outs", "age")

    def __init__(self, step: int, source: Optional[str], path: str):
        self.step, self.source, self.path = step, source, path
        self.used = False
        self.tags: List[weakref.ref] = []
        self.outs: List[weakref.ref] = []
        self.age = 0

    def alive(self) -> bool:
        return any(t() is not None for t in self.tags)


def _outputs(output: Any) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.grad_fn is not None else []
    from ..tensors import iter_tensors

    out = []
    for t in iter_tensors(output):
        if t.grad_fn is not None:
            out.append(t)
            if len(out) >= MAX_OUTPUTS:
                break
    return out


class EvalWithoutNoGrad(Check):
    name = "eval-without-no-grad"
    kinds = ("eval-without-no-grad",)
    description = "model forwards that build graphs never back-propagated (evaluation outside no_grad)"
    patches = {"autograd_grad": "torch.autograd.grad"}

    def __init__(self, guard):
        super().__init__(guard)
        self._pending: List[_Fwd] = []
        self._unclaimed = 0  # pending forwards not yet reached by a backward
        self._backward_in_step = False
        self._any_backward = False
        self._done = False

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root or self._done or not torch.is_grad_enabled():
            return
        outs = _outputs(output)
        if not outs or len(self._pending) >= MAX_PENDING:
            return
        rec = _Fwd(self.g.step, self.g.root_source, path)
        for t in outs:
            md = t.grad_fn.metadata
            if KEY in md:
                continue  # an output passed through unchanged from an earlier tagged forward
            tag = _Tag(rec)
            md[KEY] = tag
            rec.tags.append(weakref.ref(tag))
            rec.outs.append(weakref.ref(t))
        if rec.tags:
            self._pending.append(rec)
            self._unclaimed += 1

    def on_backward(self, tensors, kwargs):
        self._backward_in_step = self._any_backward = True
        self._claim(tensors)

    def on_autograd_grad(self, args, kwargs):
        self._backward_in_step = self._any_backward = True
        self._claim(args[0] if args else kwargs.get("outputs"))

    def _claim(self, roots: Any) -> None:
        if self._done or self._unclaimed <= 0:
            return
        if isinstance(roots, torch.Tensor):
            roots = [roots]
        stack = [t.grad_fn for t in (roots or ()) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        keep = []  # node wrappers stay alive during the walk, so ids stay unique
        budget = WALK_BUDGET
        while stack and self._unclaimed > 0:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            budget -= 1
            if budget <= 0:
                for rec in self._pending:  # too big to be sure: no alarm for anything still open
                    rec.used = True
                self._unclaimed = 0
                return
            try:
                tag = node.metadata.get(KEY)
            except Exception:
                tag = None
            if tag is not None and not tag.rec.used:
                tag.rec.used = True
                self._unclaimed -= 1
            try:
                nxt = node.next_functions
            except Exception:
                continue
            for n, _ in nxt:
                if n is not None and id(n) not in seen:
                    stack.append(n)

    def on_step_end(self, step):
        if self._done:
            return
        if not self._backward_in_step:
            if not any(r.alive() for r in self._pending):
                self._pending, self._unclaimed = [], 0  # a step without backward: not judged
            return
        self._backward_in_step = False
        keep, unused = [], []
        for rec in self._pending:
            if rec.used:
                continue
            rec.age += 1
            if rec.alive() and rec.age <= GRACE:
                keep.append(rec)
            else:
                unused.append(rec)
        self._pending = keep
        self._unclaimed = len(keep)
        if unused:
            self._report(unused)

    def on_exit(self):
        if self._done or not self._any_backward:
            return
        unused = [r for r in self._pending if not r.used]
        if unused:
            self._report(unused)

    def _report(self, unused: List[_Fwd]) -> None:
        self._done = True
        self._pending, self._unclaimed = [], 0
        first = unused[0]
        by_source: Dict[Optional[str], int] = {}
        for r in unused:
            by_source[r.source] = by_source.get(r.source, 0) + 1
        same = [r for r in unused if r.source == first.source]
        alive = [t for r in same for t in (o() for o in r.outs) if t is not None]
        details: Dict[str, Any] = {"forwards": len(same), "sources": {str(k): v for k, v in by_source.items()},
                                   "graphs_alive": sum(1 for r in same if r.alive())}
        mem = ""
        if alive:
            nodes, saved = graph_size(alive)
            details.update(graph_nodes=nodes, saved_bytes=saved)
            if saved:
                mem = f"; the {len(alive)} graph(s) still alive hold {fmt_bytes(saved)} of saved activations"
        n = len(same)
        message = (f"{n} forward pass{'es' if n != 1 else ''} of {first.path} at {first.source} built autograd "
                   f"graphs (outputs require grad) that no backward() used; evaluation outside "
                   f"torch.no_grad() keeps every activation for a backward that never comes{mem}")
        hint = ("Run evaluation under `with torch.no_grad():` (or `torch.inference_mode()`), and call "
                "model.eval() first; this saves the activation memory and time.")
        self.emit("eval-without-no-grad", first.path, message, hint, step=first.step, source=first.source,
                  details=details)
