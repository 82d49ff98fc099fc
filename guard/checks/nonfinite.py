"""NaN/Inf: dirty inputs, the first module that makes them, the loss, gradients and parameters.

Cost model: every screened tensor costs one ``sum`` and one ``isfinite`` on its
own device, staged without a host sync. Module inputs that are the output of
an earlier module are not screened again (identity lookup). Once per step the
guard reads all flags at once; only when one fired does this check look
closer (exact counts, which module, which parameters), and only then syncs.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..tensors import finite_flag, finite_stats, iter_named_tensors, nonfinite_counts, screenable
from .base import Check

_CATEGORY_ORDER = ("param", "input", "output", "loss", "grad")


class _Call:
    """One module call's screened inputs and outputs, by flag index."""

    __slots__ = ("path", "type", "is_root", "inputs", "outputs", "source", "step", "module")

    def __init__(self, path: str, mtype: str, is_root: bool, source: Optional[str], step: int, module: Any):
        self.path, self.type, self.is_root, self.source, self.step = path, mtype, is_root, source, step
        self.inputs: List[Tuple[str, int]] = []
        self.outputs: List[Tuple[str, int]] = []
        self.module = weakref.ref(module)


class NonFinite(Check):
    name = "nonfinite"
    kinds = ("nonfinite-input", "nonfinite-output", "nonfinite-loss", "nonfinite-grad", "nonfinite-param")
    description = "NaN/Inf in inputs, module outputs (module of origin), loss, gradients and parameters"

    def __init__(self, guard):
        super().__init__(guard)
        self._new_window()
        self._bad_param_names: set = set()
        self._bad_grad_steps: set = set()
        self._armed: Dict[int, str] = {}  # id(module) -> path: capture exact counts at its next call

    def _new_window(self) -> None:
        self._n = 0  # flags staged in this window
        self._bad: set = set()
        self._tensors: Dict[int, Tuple[weakref.ref, int]] = {}  # id(tensor) -> (ref, flag index)
        self._refs: Dict[int, weakref.ref] = {}  # flag index -> tensor ref (for details)
        self._calls: List[_Call] = []
        self._stack: List[_Call] = []
        self._losses: List[Tuple[int, Optional[str], int]] = []
        self._grads: List[Tuple[int, Any, int, Optional[str]]] = []
        self._params: List[Tuple[int, List[torch.Tensor], List[str], int, Optional[str]]] = []

    # staging ---------------------------------------------------------------
    def _flag(self, t: torch.Tensor) -> int:
        i = self._n
        self._n += 1
        self.g.stage_flag(finite_flag(t), lambda i=i: self._bad.add(i))
        return i

    def _screen(self, t: torch.Tensor, reuse: bool) -> int:
        key = id(t)
        if reuse:
            hit = self._tensors.get(key)
            if hit is not None and hit[0]() is t:
                return hit[1]
        i = self._flag(t)
        try:
            ref = weakref.ref(t)
        except TypeError:
            return i
        self._tensors[key] = (ref, i)
        self._refs[i] = ref
        return i

    # events ----------------------------------------------------------------
    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if not self.g.sampling:
            return
        call = _Call(path, type(module).__name__, is_root, self.g.root_source, self.g.step, module)
        for name, t in iter_named_tensors(args, "args"):
            if screenable(t):
                call.inputs.append((name, self._screen(t, reuse=True)))
        for name, t in iter_named_tensors(kwargs, "kwargs"):
            if screenable(t):
                call.inputs.append((name, self._screen(t, reuse=True)))
        self._stack.append(call)

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not self._stack or self._stack[-1].module() is not module:
            return  # sampling switched on mid-call, or a call we did not see start
        call = self._stack.pop()
        if self._armed and id(module) in self._armed:
            self._capture(module, args, kwargs, output)
        for name, t in iter_named_tensors(output, "output"):
            if screenable(t):
                call.outputs.append((name, self._screen(t, reuse=False)))
        self._calls.append(call)

    def on_backward(self, tensors, kwargs):
        if not self.g.sampling:
            return
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        for t in ts:
            if isinstance(t, torch.Tensor) and screenable(t):
                self._losses.append((self._flag(t), self.g.root_source, self.g.step))

    def on_backward_done(self, tensors, kwargs):
        if not self.g.has_optimizer and self.g.sampling:
            self._stage_grads(None)

    def on_step_pre(self, optimizer):
        if self.g.sampling:
            self._stage_grads(optimizer)

    def _stage_grads(self, optimizer) -> None:
        gn = self.g.grad_norms(optimizer)
        for total in gn.totals.values():
            self._grads.append((self._flag(total), gn, self.g.step, self.g.source()))

    def on_step_post(self, optimizer):
        if not self.g.sampling:
            return
        params = [p for grp in optimizer.param_groups for p in grp["params"]
                  if p.grad is not None and screenable(p)]
        if not params:
            return
        by_dev: Dict[Tuple[Any, Any], List[torch.Tensor]] = {}
        for p in params:
            by_dev.setdefault((p.device, p.dtype), []).append(p)
        for group in by_dev.values():
            norms = torch._foreach_norm([p.detach() for p in group])
            total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
            names = [self.g.param_name(p) for p in group]
            self._params.append((self._flag(total), group, names, self.g.step, self.g.source()))

    def _capture(self, module, args, kwargs, output) -> None:
        """The origin's tensors were gone at resolution: record exact counts from this next call."""
        path = self._armed.pop(id(module))
        counts = {n: nonfinite_counts(t) for n, t in iter_named_tensors(output, "output") if screenable(t)}
        stats_in = {n: finite_stats(t) for n, t in iter_named_tensors((args, kwargs), "inputs") if screenable(t)}
        self.g.update_details("nonfinite-output", path, counts=counts, input_stats=stats_in,
                              counts_from_step=self.g.step)

    # resolution -------------------------------------------------------------
    def on_resolved(self):
        bad = self._bad
        window = (self._calls, self._losses, self._grads, self._params, self._refs)
        self._new_window()
        if not bad:
            return
        calls, losses, grads, params, refs = window
        self._bad_grad_steps.update(step for flag, _, step, _ in grads if flag in bad)
        for flag, group, names, step, source in params:
            if flag in bad and self._report_params(group, names, step, source,
                                                   caused=step in self._bad_grad_steps):
                return
        for call in calls:
            if call.is_root and any(i in bad for _, i in call.inputs):
                self._report_input(call, bad, refs)
                return
        for call in calls:
            if any(i in bad for _, i in call.outputs) and not any(i in bad for _, i in call.inputs):
                if self._report_output(call, bad, refs):
                    return
        for flag, source, step in losses:
            if flag in bad:
                if not calls or not any(i in bad for c in calls for _, i in c.outputs):
                    self.emit("nonfinite-loss", "loss",
                              "the loss passed to backward() is NaN/Inf although the model's outputs were finite",
                              "The loss computation itself overflows or divides by zero (log(0), sqrt(<0), x/0): "
                              "clamp its inputs (e.g. torch.log(p.clamp_min(1e-8))) or use a stable built-in loss.",
                              step=step, source=source)
                return
        for flag, gn, step, source in grads:
            if flag in bad and not self._bad_param_names:  # NaN weights make NaN grads: not news
                self._report_grads(gn, step, source)
                return

    def _report_input(self, call: _Call, bad: set, refs: Dict[int, weakref.ref]) -> None:
        args, counts = [], {}
        for name, i in call.inputs:
            if i in bad:
                args.append(name)
                t = refs.get(i, lambda: None)()
                if t is not None:
                    counts[name] = nonfinite_counts(t)
        self.emit("nonfinite-input", "input",
                  f"the input to {call.path} contains NaN/Inf ({', '.join(args)}): the data is dirty",
                  "Check the dataset and transforms for NaN/Inf (e.g. torch.isfinite(x).all() in the Dataset), "
                  "or filter such samples before they reach the model.",
                  step=call.step, source=call.source,
                  details={"module": call.type, "arguments": args, "counts": counts})

    def _report_output(self, call: _Call, bad: set, refs: Dict[int, weakref.ref]) -> bool:
        module = call.module()
        bad_params: List[str] = []
        if module is not None:
            for n, p in module.named_parameters():
                if screenable(p) and not bool(torch.isfinite(p.detach()).all()):
                    if self.g.param_name(p) in self._bad_param_names:
                        return True  # a consequence of an already reported nonfinite-param
                    bad_params.append(n)
        out_counts, in_stats, out_stats = {}, {}, {}
        for name, i in call.outputs:
            t = refs.get(i, lambda: None)()
            if t is not None and i in bad:
                out_counts[name] = nonfinite_counts(t)
                out_stats[name] = finite_stats(t)
        for name, i in call.inputs:
            t = refs.get(i, lambda: None)()
            if t is not None:
                in_stats[name] = finite_stats(t)
        if not out_counts and module is not None:
            self._armed[id(module)] = call.path
        why = (f"its parameters {', '.join(bad_params[:5])} are non-finite" if bad_params
               else "its inputs were finite")
        self.emit("nonfinite-output", call.path,
                  f"{call.path} ({call.type}) produced NaN/Inf; {why}",
                  _output_hint(call.type, bool(bad_params)),
                  step=call.step, source=call.source,
                  details={"module": call.type, "counts": out_counts, "input_stats": in_stats,
                           "output_stats": out_stats, "nonfinite_params": bad_params})
        return True

    def _report_grads(self, gn, step: int, source: Optional[str]) -> None:
        values = gn.per_param()
        names = [n for n, v in zip(gn.names, values) if v != v or v in (float("inf"), float("-inf"))]
        if not names:
            return
        self.emit("nonfinite-grad", names[0],
                  f"{len(names)} parameter gradient(s) are NaN/Inf: {', '.join(names[:5])}"
                  + (" ..." if len(names) > 5 else ""),
                  "The backward pass overflowed (e.g. sqrt/log/pow at 0, division by a tiny value, or an exploding "
                  "loss): clip with torch.nn.utils.clip_grad_norm_, lower the learning rate, or use AMP's GradScaler "
                  "which skips such steps.",
                  step=step, source=source, details={"parameters": names[:20], "count": len(names)})

    def _report_params(self, group: List[torch.Tensor], names: List[str], step: int, source: Optional[str],
                       caused: bool) -> bool:
        bad = [n for p, n in zip(group, names) if not bool(torch.isfinite(p.detach()).all())]
        new = [n for n in bad if n not in self._bad_param_names]
        self._bad_param_names.update(bad)
        if not new or caused:
            return False  # already known, or the step's gradients were NaN/Inf (reported upstream)
        self.emit("nonfinite-param", bad[0],
                  f"after optimizer.step() {len(bad)} parameter(s) are NaN/Inf: {', '.join(bad[:5])}"
                  + (" ..." if len(bad) > 5 else ""),
                  "The update itself overflowed although the gradients were finite: lower the learning rate, "
                  "check optimizer settings such as eps=0 or a huge momentum, and clip gradients.",
                  step=step, source=source, details={"parameters": bad[:20], "count": len(bad)})
        return True


def _output_hint(mtype: str, params: bool) -> str:
    if params:
        return ("The module's weights are already NaN/Inf (a bad checkpoint or an earlier overflow): reload good "
                "weights and lower the learning rate.")
    if "Norm" in mtype:
        return ("A normalisation layer divided by a near-zero variance or got constant input: raise its eps, "
                "or check for constant/zero features.")
    return ("This module's computation overflowed or hit an undefined point (log(0), sqrt(<0), x/0, exp of a large "
            "value): clamp inputs, add an epsilon, lower the learning rate, or clip gradients.")
