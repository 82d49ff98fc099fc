"""Cryptic PyTorch errors: add the cause, the module/step and the fix to the exception, re-raise it unchanged.

On ``exception(exc)`` (an exception escaping the guarded block or the wrapped
model's call) a known error gets one note (``BaseException.add_note``, printed
with the traceback) and an ``explained-error`` finding; the exception object
and its type stay the same, so ``except`` clauses still work.

Which module: the innermost ``nn.Module`` call in the exception's traceback (read
once, on the error path; nothing is kept per module call).
In-place errors: during the first `TAG_STEPS` steps a ``saved_tensors_hooks``
pair is pushed for the duration of each outermost model call (never inside
torch.func transforms, which refuse such hooks) and tags every tensor autograd
saves there with the module whose forward saved it and its version. PyTorch
skips its own version check for tensors packed by hooks, so the unpack hook does
that check itself, with the same message plus the module. The packed form holds
a ``detach()``-ed alias (same storage and version counter) so that saved outputs
do not form a reference cycle with their ``grad_fn``; autograd re-attaches the
graph metadata on unpack. An in-place error is a property of the code path, met
on the first backward that takes it, so later steps run without the hooks (they
cost two Python calls per saved tensor); an error after that is still explained,
without the saving module.
"""
from __future__ import annotations

import functools
import gc
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from .._frames import frame_locals, is_skipped, short_path, variable_naming
from ..hooks import eager
from .base import Check
from ._graphs import Budget, graph_holders, may_hold_graph, walk
from ._notes import NOTE_PREFIX, add_guard_note

KIND = "explained-error"
_DP_RE = re.compile(r"'(DataParallel|DistributedDataParallel)' object has no attribute '([A-Za-z_][\w]*)'")
_DEV_RE = re.compile(r"found at least two devices, ([\w:]+) and ([\w:]+)")
_DEV2_RE = re.compile(r"Tensor on device ([\w:]+) is not on the expected device ([\w:]+)")
_SIZE_RE = re.compile(r"got input size (torch\.Size\(\[[^\]]*\]\))")
_CHANNELS_RE = re.compile(r"weight of size \[([\d, ]+)\], expected input\[([\d, ]+)\] to have (\d+) channels, "
                          r"but got (\d+) channels instead")
_DTYPE_TEXTS = ("must have the same dtype", "mixed dtype", "expected scalar type", "does not match weight dtype")
_TARGET_DTYPE_RE = re.compile(r"expected target dtype to be Long or Byte, but got (\w+)")
_TYPE_RE = re.compile(r"Input type \(([\w.]+)\) and (?:bias|weight) type \(([\w.]+)\) should be the same")
_DTYPE_WORDS = {"double": "float64", "float": "float32", "half": "float16", "bfloat16": "bfloat16"}
_PAIRED_LOSSES = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                            "binary_cross_entropy_with_logits"})
_DIST_RE = re.compile(r"Expected parameter (\w+) \(Tensor of shape \(([^)]*)\)\) of distribution (\w+)\(.*?to satisfy "
                      r"the constraint ([\w.]+)\(", re.S)
#: what maps a network's raw output into each constraint's range
_INTO_RANGE = {"GreaterThan": "F.softplus(raw) + 1e-6 (or raw.exp())", "Positive": "F.softplus(raw) + 1e-6 (or raw.exp())",
               "GreaterThanEq": "F.softplus(raw)", "Interval": "torch.sigmoid(raw) (scaled to the interval)",
               "HalfOpenInterval": "torch.sigmoid(raw) (scaled to the interval)", "Simplex": "raw.softmax(-1)",
               "UnitInterval": "torch.sigmoid(raw)", "PositiveDefinite": "L @ L.mT + eps * I from a lower-triangular L",
               "LowerCholesky": "torch.linalg.cholesky, or a tril with a softplus diagonal"}


def _distribution_args(text: str, param: str, shape: str, dist: str, constraint: str) -> Tuple[str, str, str, Dict[str, Any]]:
    """A torch.distributions argument outside its range (a scale that went negative, probabilities not summing
    to 1), or NaN from upstream."""
    nan = "nan" in text.split("invalid values", 1)[-1].lower()
    if nan:
        cause = (f"{dist}'s {param} holds NaN: the distribution only sees it; the NaN was made upstream, in the "
                 f"model's output or the arithmetic producing {param}")
        fix = ("Find where the NaN starts (guard's nonfinite check names the module when that output is the "
               "model's); a scale computed as exp() of a large value or a log of 0 are the usual causes.")
    else:
        into = _INTO_RANGE.get(constraint, "an activation that maps the raw output into that range")
        cause = f"{dist}'s {param} must satisfy {constraint} but holds values outside it (a raw network output used as {param})"
        fix = f"Map the raw output into the range: {param} = {into}."
    return "loss", cause, fix, {"distribution": dist, "parameter": param, "constraint": constraint, "nan": nan}


_WEIGHTED_LOSSES = frozenset({"cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                              "multi_margin_loss", "multilabel_soft_margin_loss"})
#: optimizer states shaped like their parameter (Adafactor's factored row/column states are not)
_FULL_STATES = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                          "sum", "exp_inf", "ax", "prev", "grad_avg", "mu", "eta"})
_INVALID_GRAD_RE = re.compile(r"returned an invalid gradient at index (\d+) - got \[([\d, ]*)\] but expected shape "
                              r"compatible with \[([\d, ]*)\]")
_SIZE_TEXTS = ("must match the size of tensor", "must be the same as input size", "that is different to the input size")
_TOP_TENSORS = 5
TAG_STEPS = 2  # steps whose saved tensors are tagged with the module that saved them
_CALL_IMPL = nn.Module._call_impl.__code__
_MAX_FRAMES = 64
_hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda ignore_tracing: None)
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


_ONECYCLE_RE = re.compile(r"Tried to step (\d+) times\. The specified number of total steps is (\d+)")


def _one_cycle_overrun(exc: BaseException, stepped: int, total: int) -> Tuple[str, str, str, Dict[str, Any]]:
    """OneCycleLR stepped past its total_steps: sized for one step per epoch (or one loader) and stepped per batch."""
    sched = _traceback_self(exc, "OneCycleLR")
    name = type(sched).__name__ if sched is not None else "OneCycleLR"
    cause = (f"{name} was stepped {stepped} times, but its schedule was built for total_steps={total}: it counts "
             f"scheduler.step() calls, one per optimizer step, so a run of E epochs of B batches needs E x B of them "
             f"(a schedule sized as the number of epochs, or one epoch's batches, runs out here)")
    fix = ("Size it from the loop: OneCycleLR(optimizer, max_lr=..., epochs=EPOCHS, steps_per_epoch=len(train_loader)) "
           "(with gradient accumulation, steps_per_epoch=math.ceil(len(train_loader) / accum_steps)), and call "
           "scheduler.step() right after each optimizer.step().")
    return name, cause, fix, {"scheduler": name, "stepped": stepped, "total_steps": total}


def _traceback_self(exc: BaseException, cls_name: str) -> Any:
    """The ``self`` of the innermost traceback frame whose ``self`` is an instance of a class named `cls_name`."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if any(c.__name__ == cls_name for c in type(obj).__mro__):
            found = obj
        tb = tb.tb_next
    return found


def _one_hot_like(t: torch.Tensor) -> bool:
    """Whether a target holds only 0s and 1s (one-hot or multi-hot labels); read on the error path only."""
    try:
        d = t.detach()
        return bool(((d == 0) | (d == 1)).all())
    except Exception:
        return True


def _through(exc: BaseException, torch_fn: str) -> bool:
    """Whether the exception passed through torch's own function `torch_fn` (``grad``: torch.autograd.grad)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == torch_fn and is_skipped(code.co_filename) and "autograd" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


_WRONG_GRADS_RE = re.compile(r"function (\w+) returned an incorrect number of gradients \(expected (\d+), got (\d+)\)")


_CE_SIZE_RE = re.compile(r"Expected target size \[([\d, ]+)\], got \[([\d, ]+)\]")


def _ce_target_layout(exc: BaseException, text: str) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
    """cross_entropy's target-shape errors for dense predictions: the class dimension not in dim 1, a mask kept
    (N, 1, H, W)."""
    if not isinstance(exc, RuntimeError):
        return None
    m = _CE_SIZE_RE.search(text)
    if m:
        want, got = m.group(1), m.group(2)
        cause = (f"cross_entropy takes the classes in dim 1 of the input, (N, C, d1, ...) against targets (N, d1, ...): "
                 f"it expected targets [{want}] from the input's shape but got [{got}], so the input's class "
                 f"dimension is not dim 1 (logits kept channels-last, (N, L, C), or permuted for another layer)")
        fix = ("Move the classes to dim 1, F.cross_entropy(logits.permute(0, 2, 1), y) for (N, L, C) logits (or "
               "permute(0, 3, 1, 2) for NHWC), or flatten both: F.cross_entropy(logits.reshape(-1, C), y.reshape(-1)).")
        return "loss", cause, fix, {"expected_target": want, "target": got}
    if "only batches of spatial targets supported" in text:
        cause = ("cross_entropy's dense target must be class indices of shape (N, H, W); this one has 4 dimensions, a "
                 "mask kept with its channel dimension, (N, 1, H, W)")
        fix = ("Drop the channel dimension of the mask: F.cross_entropy(logits, mask.squeeze(1).long()) (for a "
               "one-hot (N, C, H, W) target, mask.argmax(1), or pass it as float probabilities of the input's shape).")
        return "loss", cause, fix, {"target_dims": 4}
    return None


def _loss_weight_shape(exc: BaseException) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
    """A BCE loss's `pos_weight` or `weight` whose shape makes the result broadcast past the input's ("output with
    shape [8] doesn't match the broadcast shape [8, 8]"): named, with the shape it must have."""
    fn = next((f for f in ("binary_cross_entropy_with_logits", "binary_cross_entropy")
               if _local_of(exc, (f,), "input") is not None), None)
    if fn is None:
        return None
    x = _local_of(exc, (fn,), "input")
    for arg in ("pos_weight", "weight"):
        w = _local_of(exc, (fn,), arg)
        if isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor):
            try:
                torch.broadcast_shapes(tuple(w.shape), tuple(x.shape))
                grows = tuple(torch.broadcast_shapes(tuple(w.shape), tuple(x.shape))) != tuple(x.shape)
            except RuntimeError:
                grows = True
            if grows:
                xs, ws = list(x.shape), list(w.shape)
                want = ("[1] (one weight for the positives), or [C] for C labels per sample" if arg == "pos_weight"
                        else f"the input's shape {xs} (one weight per element), or one that broadcasts to it")
                cause = (f"{fn}'s `{arg}` has shape {ws} while its input is {xs}: broadcast against the input it would "
                         f"give a larger result, so the loss cannot be computed (a per-sample weight kept [N, 1] for "
                         f"[N] logits, or the other way round)")
                fix = (f"Give `{arg}` the shape {want}: {arg}.view(-1) for [N] logits, or {arg}.view_as(input); a "
                       f"pos_weight is per label, not per sample (use weight= for per-sample weights).")
                return "loss", cause, fix, {"loss": fn, "argument": arg, "argument_shape": ws, "input_shape": xs}
    return None


def _dtype_part(type_name: str) -> str:
    """``torch.cuda.FloatTensor`` and ``float`` -> ``float``: the dtype in a legacy type name."""
    return type_name.lower().replace("torch.", "").replace("cuda.", "").replace("tensor", "")


def _user_line(exc: BaseException) -> Optional[str]:
    """``file:line`` of the innermost user frame in the exception's traceback."""
    try:
        frames = traceback.extract_tb(exc.__traceback__)
    except Exception:
        return None
    for fr in reversed(frames):
        if not is_skipped(fr.filename):
            return f"{short_path(fr.filename)}:{fr.lineno}"
    return None


def _backward_roots(exc: BaseException) -> Tuple[List[torch.Tensor], Any]:
    """(tensors backward() or autograd.grad() was called on, the user's frame that called it), from the traceback."""
    roots: List[torch.Tensor] = []
    user = None
    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if not is_skipped(f.f_code.co_filename):
            user = f
        elif not roots and f.f_code.co_name in ("backward", "grad"):
            loc = f.f_locals
            v = loc.get("tensors", loc.get("outputs", loc.get("self")))
            v = [v] if isinstance(v, torch.Tensor) else v if isinstance(v, (list, tuple)) else []
            roots = [t for t in v if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        tb = tb.tb_next
    return roots, user


@functools.lru_cache(maxsize=8)
def _parsed(filename: str, stamp: int) -> Tuple[str, Any]:
    """(source, its ast) of a file as of `stamp` (its mtime), parsed once for the several candidates of one
    explanation."""
    import ast
    import linecache

    source = "".join(linecache.getlines(filename))
    return source, ast.parse(source)


def _assignment(code: Any, name: str) -> Optional[Tuple[str, str, str]]:
    """How the function of `code` carries `name` (``h``, ``self.h``) over: (``file:line: `text```, how, the value
    written) for an assignment from an expression using it (how "self": ``out, h = rnn(x, h)``; "sum":
    ``total += loss``) or an in-place write into it (how "write": ``buf[:] = out``, ``buf.copy_(out)``)."""
    import ast

    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    lo, hi = code.co_firstlineno, max(lines, default=code.co_firstlineno)
    try:
        stamp = os.stat(code.co_filename).st_mtime_ns
    except OSError:
        stamp = 0
    source, tree = _parsed(code.co_filename, stamp)
    want = ast.dump(ast.parse(name, mode="eval").body)

    def at(node: Any) -> str:
        text = " ".join((ast.get_source_segment(source, node) or "").split())  # without a trailing comment
        text = text if len(text) <= 100 else text[:97] + "..."
        return f"{short_path(code.co_filename)}:{node.lineno}: `{text}`"

    def same(node: Any) -> bool:
        return ast.dump(node).replace("Store()", "Load()") == want

    for node in ast.walk(tree):
        if not lo <= getattr(node, "lineno", 0) <= hi:
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for tg in targets for t in ([tg] + list(getattr(tg, "elts", [])))]
            if any(same(t) for t in flat):
                if isinstance(node, ast.AugAssign):
                    return at(node), "sum", ""
                if any(ast.dump(t) == want for t in ast.walk(node.value)):
                    return at(node), "self", ""
                # through a local: `mem = self.memory + f(x); self.memory = mem` (or `= mem.mean(0)`)
                for local in sorted({n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}):
                    if _via_local(tree, local, want, lo, hi) is not None:
                        return at(node), "self", ""
            elif any(isinstance(t, ast.Subscript) and same(t.value) for t in flat):
                return at(node), "write", ast.get_source_segment(source, node.value) or ""
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and same(node.func.value) \
                and node.func.attr in ("copy_", "index_copy_", "index_put_", "masked_scatter_", "scatter_") \
                and node.args:
            return at(node), "write", ast.get_source_segment(source, node.args[-1]) or ""
    return None


def _via_local(tree: Any, local: str, want: str, lo: int, hi: int) -> Any:
    """The assignment, between lines `lo` and `hi`, of the plain variable `local` from an expression that reads the
    target `want` (an ``ast.dump``): ``mem = self.memory + ...`` before ``self.memory = mem``."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and lo <= node.lineno <= hi and any(
                isinstance(t, ast.Name) and t.id == local for t in node.targets) and any(
                ast.dump(t) == want for t in ast.walk(node.value)):
            return node
    return None


def _carried_at(frame: Any, scope: Dict[str, Any], name: str) -> Optional[Tuple[str, str, str, str]]:
    """`_assignment` of `name` (a variable of `frame`, or an attribute path into one: ``model.hidden``): in
    `frame`'s function, or for an attribute in a method of its owner's class (``self.hidden = ...``); with the
    name as written there appended."""
    if name.isidentifier():
        found = _assignment(frame.f_code, name)
        return found + (name,) if found else None
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    owner = scope.get(parts[0])
    for part in parts[1:-1]:
        owner = (getattr(owner, "__dict__", None) or {}).get(part) if not isinstance(owner, nn.Module) else \
            owner._modules.get(part, vars(owner).get(part))
    if owner is None:
        return None
    for klass in type(owner).__mro__:
        if klass in (nn.Module, object):
            break
        for fn in vars(klass).values():
            code = getattr(fn, "__code__", None)
            if code is not None and code.co_argcount:  # a method: its first argument is the owner
                expr = f"{code.co_varnames[0]}.{parts[-1]}"
                found = _assignment(code, expr)
                if found is not None:
                    return found + (expr,)
    return None


def _newest_node_of(ts: List[torch.Tensor]) -> int:
    """Autograd's largest sequence number among the grad_fns of `ts` (-1 with none)."""
    return max((t.grad_fn._sequence_nr() for t in ts if t.grad_fn is not None), default=-1)


def _from_plain_leaf(ts: List[torch.Tensor]) -> bool:
    """Whether `ts` were computed, in a few operations, from leaves made with requires_grad=True that are no
    nn.Parameter (and from no parameter): a value meant to be trained, built as a result instead of a leaf."""
    stack, seen, plain = [t.grad_fn for t in ts if t.grad_fn is not None], 0, False
    while stack:
        node = stack.pop()
        seen += 1
        if node is None or seen > 16:
            return False if seen > 16 else plain
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if isinstance(var, nn.Parameter):
                return False
            plain = True
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return plain


def _freed_holder(exc: BaseException, newest: int) -> Optional[Tuple[str, Optional[str], str, str, str]]:
    """What attached an earlier graph to the loss of a failed backward(), as (name, where, how, the name as
    written there, the value written): a variable or attribute holding a tensor made before the last completed
    backward (node sequence numbers up to `newest`; where None, how ""), else one whose newer tensor reaches such
    a node other than through another variable's tensor and that the code carries over (`_assignment`: how
    "sum", "self", "write"; "tuple" for an LSTM's state); how "twice" when the loss itself is that old. None
    when none of these is found."""
    if newest < 0:
        return None
    roots, user = _backward_roots(exc)
    if not roots or user is None:
        return None
    keep: List[Any] = []  # node wrappers stay alive so that their ids stay unique
    in_graph: Dict[int, bool] = {}  # node id -> made before the last backward
    for node in walk([t.grad_fn for t in roots], Budget(20_000)):
        keep.append(node)
        in_graph[id(node)] = node._sequence_nr() <= newest
    if not any(in_graph.values()):
        return None
    if all(in_graph.get(id(t.grad_fn)) for t in roots):  # the loss itself is older: backward() twice on it
        return "", None, "twice", "", ""
    scope = dict(user.f_globals)
    scope.update(frame_locals(user))
    found: List[Tuple[str, List[torch.Tensor]]] = []
    for var, value in list(scope.items())[-1024:]:
        if var.startswith("__") or not may_hold_graph(value):
            continue
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            found.append((var, [v for v in value if v.grad_fn is not None]))
            continue
        found.extend((n, ts) for n, _, ts in graph_holders(var, value))
    olds = [(n, ts) for n, ts in found if any(in_graph.get(id(t.grad_fn)) for t in ts)]
    if len(olds) > 1:
        # the holder nearest the loss: the one whose graph reaches the others' (`H = torch.stack(states)` read by
        # the loss, not the loop's last state `h` that H was stacked from)
        fns = {n: [t.grad_fn for t in ts] for n, ts in olds}  # (kept alive while ids are compared)
        ids = {n: {id(f) for f in fs} for n, fs in fns.items()}

        def covers(n: str, ts: List[torch.Tensor]) -> int:
            nodes = list(walk(fns[n], Budget(5_000)))
            seen = {id(node) for node in nodes}
            return sum(1 for m, fn_ids in ids.items() if m != n and fn_ids & seen)
        olds.sort(key=lambda c: -covers(*c))
    if olds:  # (its tensors in the last place: whether they were made from a plain leaf decides the fix)
        return olds[0][0], None, "", olds[0][0], olds[0][1]
    budget = Budget(40_000)

    def reaches(ts: List[torch.Tensor], others: Set[int]) -> bool:
        return any(in_graph.get(id(node)) for node in walk([t.grad_fn for t in ts], budget,
                                                           prune=lambda node: id(node) in others)
                   if id(node) not in others)

    carried = []  # (name, its tensors, _carried_at) of variables the code carries over that reach the old graph
    for n, ts in found:
        if reaches(ts, set()):
            at = _carried_at(user, scope, n)
            if at is not None:
                carried.append((n, ts, at))
    fns = {n: {id(t.grad_fn) for t in ts} for n, ts, _ in carried}
    every = set().union(*fns.values()) if fns else set()
    # the old graph reached only through another carried variable is that one's doing (`loss = loss + f(buf)`
    # reaches it through `buf`, written with live outputs)
    chosen = next((c for c in carried if reaches(c[1], every - fns[c[0]])), carried[0] if carried else None)
    if chosen is None:
        return None
    n, _, at = chosen
    how = "tuple" if at[1] == "self" and isinstance(scope.get(n), (list, tuple)) else at[1]
    return n, at[0], how, at[3], at[2]


def _loader_iter(exc: BaseException) -> Any:
    """The multi-process DataLoader iterator whose frame the exception passed through, if any."""
    tb = exc.__traceback__
    while tb is not None:
        it = tb.tb_frame.f_locals.get("self")
        if type(it).__name__ == "_MultiProcessingDataLoaderIter":
            return it
        tb = tb.tb_next
    return None


def _worker_signals(exc: BaseException, wait: float = 0.0) -> List[int]:
    """Signals that killed the DataLoader's workers, read from the iterator in the traceback's frames.

    With `wait`, a worker not reaped yet is given up to that many seconds in all to be (its death may
    reach the main process as a closed connection before its exit code does)."""
    it = _loader_iter(exc)
    workers = list(getattr(it, "_workers", ())) if it is not None else []
    if wait:
        deadline = time.monotonic() + wait
        for w in workers:
            left = deadline - time.monotonic()
            if left > 0 and getattr(w, "exitcode", 0) is None:
                try:
                    w.join(left)
                except Exception:
                    pass
    codes = [getattr(w, "exitcode", None) for w in workers]
    return sorted({-c for c in codes if isinstance(c, int) and c < 0})


def _mib(n: int) -> str:
    if n >= 2 ** 40:
        return f"{n / 2 ** 40:.2f} TiB"
    return f"{n / 2 ** 20:.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"


_ASKED_RE = re.compile(r"(?:tried to allocate|Tried to allocate)\s+([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)?")
_UNITS = {None: 1, "bytes": 1, "B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}


def _requested_bytes(text: str) -> Optional[int]:
    """The size of the allocation that failed, as PyTorch's allocators report it (CPU: bytes, CUDA: MiB/GiB)."""
    m = _ASKED_RE.search(text)
    if not m:
        return None
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    except (ValueError, KeyError):
        return None



def _traceback_variable(exc: BaseException, obj: Any) -> Optional[str]:
    """The name of a variable of the user's code, in a frame of `exc`'s traceback (its locals, then its module's
    globals), whose value is `obj`: an uncaught error reaches a global guard with no user frame on the stack."""
    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if not is_skipped(f.f_code.co_filename):
            for scope in (frame_locals(f), f.f_globals):
                for k, v in scope.items():
                    if v is obj and not k.startswith("_"):
                        return k
        tb = tb.tb_next
    return None

class ExplainErrors(Check):
    name = "explain"
    kinds = {
        KIND: ("error", "a cryptic PyTorch error escaped the guarded block"),
    }
    description = "adds the cause, module, step and fix to cryptic PyTorch errors (in-place, device, OOM, shm, ...)"

    # torch.func refuses to run while saved-tensor hooks are active; these are its entry points.
    patches = {
        "functorch_vjp": "torch._functorch.eager_transforms._vjp_with_argnums",
        "functorch_grad": "torch._functorch.eager_transforms.grad_and_value_impl",
        # shared with nonfinite and eval-without-no-grad (one wrapper): the grad mode where it raised
        "autograd_grad": "torch.autograd.grad",
    }

    def __init__(self, guard):
        super().__init__(guard)
        self._suspended: List[bool] = []
        self._thread = threading.get_ident()
        self._inplace: Optional[Dict[str, Any]] = None
        self._batch: Optional[List[int]] = None
        # the line of the last model call when it ran with gradient recording off (an evaluation helper decorated
        # @torch.no_grad() reused for training), else None: a backward() of a loss without graph names it
        self._nograd_call: Optional[str] = None
        self._pushed: List[Any] = []  # one entry per root call: its saved_tensors_hooks context, or None

    # ------------------------------------------------------------------ saved tensors
    def _module_of_frame(self, frame: Any) -> Optional[str]:
        """Path of the innermost module call at or above `frame` (a ``Module._call_impl`` frame's self)."""
        n = 0
        while frame is not None and n < _MAX_FRAMES:
            if frame.f_code is _CALL_IMPL:
                path = self.g.known_path(frame.f_locals.get("self"))
                if path is not None:
                    return path
            frame = frame.f_back
            n += 1
        return None

    @eager
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            fn = t.grad_fn  # PyTorch's message names the op that made the tensor: kept for ours
            made = f"output {t.output_nr} of {type(fn).__name__}" if fn is not None else None
            # A weight or a view of one (Linear saves ``weight.t()``): an update changes it between steps.
            param = t if isinstance(t, nn.Parameter) else t._base if isinstance(t._base, nn.Parameter) else None
            if param is None and t.is_leaf and t.requires_grad:
                param = t  # a plain leaf an optimizer may update (an optimised image or input)
            return (t.detach(), t._version, self._module_of_frame(sys._getframe(1)), made, self.g.step, param)
        except Exception:  # e.g. no version counter: keep PyTorch's own handling for this tensor
            return t.detach()

    @eager
    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not tuple:
            return packed
        t, version, path, made, step, param = packed
        now = t._version
        if now != version:
            self._inplace = {"module": path, "shape": list(t.shape), "dtype": str(t.dtype),
                             "saved_version": version, "version": now, "step": self.g.step}
            if param is not None and step < self.g.step:
                self._inplace["saved_at_step"] = step  # a weight an update changed since: an earlier step's graph
                self._inplace["weight"] = isinstance(param, nn.Parameter)
            elif param is not None:
                # a weight changed between this step's forward and its backward (a renormalisation placed there)
                self._inplace["parameter"] = self.g.param_name(param)
            by = f"saved by module `{path}`" if path else "saved outside any module call"
            which = f", which is {made}" if made else ""
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}]{which}, {by}, is at version {now}; expected version {version} instead. "
                "Hint: enable anomaly detection to find the operation that failed to compute its gradient, with "
                "torch.autograd.set_detect_anomaly(True).")
        return t

    # ------------------------------------------------------------------ torch.func inside a model call
    def _suspend(self) -> None:
        """Lift our saved-tensor hooks for a torch.func transform (which refuses any), if they are on top."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        ours = False
        if self._pushed and self._pushed[-1] is not None and top is not None:
            hooks = top(False)
            ours = hooks is not None and getattr(hooks[0], "__self__", None) is self
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._suspended.append(ours)

    def _resume(self) -> None:
        if self._suspended and self._suspended.pop():
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)

    def on_autograd_grad_error(self, args, kwargs, exc):
        # the mode torch.autograd.grad ran under: the exception leaves a function decorated @torch.no_grad() with
        # recording back on
        if not hasattr(exc, "guard_grad_enabled"):
            exc.guard_grad_enabled = torch.is_grad_enabled()

    def on_functorch_vjp(self, args, kwargs):
        self._suspend()

    def on_functorch_vjp_done(self, args, kwargs, result):
        self._resume()

    def on_functorch_vjp_error(self, args, kwargs, exc):
        self._resume()

    on_functorch_grad = on_functorch_vjp
    on_functorch_grad_done = on_functorch_vjp_done
    on_functorch_grad_error = on_functorch_vjp_error

    # ------------------------------------------------------------------ model calls
    def watches(self, module) -> bool:
        return False  # outermost model calls only

    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if not is_root or _compiling() or threading.get_ident() != self._thread:  # Dynamo traces hooks
            return
        for a in args:
            if isinstance(a, torch.Tensor) and not a.is_nested:
                self._batch = list(a.shape)
                break
        self._nograd_call = None if torch.is_grad_enabled() else self.g.root_source
        # Hooks only around model calls, and only where allowed (torch.func transforms refuse them).
        cm = None
        # never over the user's own saved-tensor hooks (activation offload with save_on_cpu, fp16 packing): the
        # innermost hooks win, so theirs would not run
        if self.g.step < TAG_STEPS and _hooks_enabled() and _top_hooks(False) is None:
            cm = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            cm.__enter__()
        self._pushed.append(cm)

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root or _compiling() or threading.get_ident() != self._thread:
            return
        if self._pushed:
            cm = self._pushed.pop()
            if cm is not None:
                cm.__exit__(None, None, None)

    def on_exit(self):
        """A model call whose end guard never saw (closed or paused mid-call): lift its hooks, never leave them behind."""
        if threading.get_ident() != self._thread:
            return  # saved-tensor hooks are per thread: only the thread that pushed them can lift them
        while self._pushed:
            cm = self._pushed.pop()
            if cm is not None:
                try:
                    cm.__exit__(None, None, None)
                except Exception:
                    pass

    def _failing_module(self, exc: BaseException) -> Optional[str]:
        """Path of the innermost watched module whose call the exception came through."""
        return self._innermost(exc)[0]

    def _stray_attributes(self, exc: BaseException) -> List[Tuple[str, str]]:
        """Plain tensor attributes (not parameters or buffers) of the failing module on another device than its
        parameters: (path.name, device)."""
        path, module, _ = self._innermost(exc)
        if module is None:
            return []
        own = {t.device for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))}
        own = own or {p.device for p in module.parameters()}
        out = []
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and own and value.device not in own:
                out.append((f"{path}.{name}" if path else name, str(value.device)))
        return out

    def _innermost(self, exc: BaseException) -> Tuple[Optional[str], Any, tuple]:
        """(path, module, positional inputs) of the innermost watched module whose call the exception came through."""
        path, module, args = None, None, ()
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is _CALL_IMPL:
                local = tb.tb_frame.f_locals
                mod = local.get("self")
                p = self.g.known_path(mod)
                if p is not None:
                    path, module, args = p, mod, local.get("args") or ()
            tb = tb.tb_next
        return path, module, args if isinstance(args, tuple) else ()

    # ------------------------------------------------------------------ explaining
    def on_exception(self, exc):
        from ..findings import GuardError

        if isinstance(exc, (GuardError, KeyboardInterrupt, SystemExit, GeneratorExit)):
            return
        if any(isinstance(n, str) and n.startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ()) or ()):
            return  # another check or a nested guard explained it already
        try:
            module = self._failing_module(exc)
        except Exception:
            module = None
        res = self._classify(exc, module)
        if res is None:
            return
        where, cause, fix, details = res
        step = self.g.step
        add_guard_note(exc, f"{NOTE_PREFIX}{cause} (step {step})\n  fix: {fix}")
        details.setdefault("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        self.emit(KIND, where, cause, fix, step=step, source=_user_line(exc), details=details)

    def _mtype(self, path: Optional[str]) -> str:
        info = self.g.modules.get(path) if path else None
        return f" ({info['type']})" if info else ""

    def _classify(self, exc: BaseException, module: Optional[str]) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        text = str(exc)
        low = text.lower()
        if isinstance(exc, RuntimeError) and "does not require grad and does not have a grad_fn" in text:
            return self._no_graph(exc)
        if isinstance(exc, AssertionError) and "No inf checks were recorded" in text:
            # GradScaler.step/update found no record of an unscale for the optimizer: its gradients were not scaled
            # by this scaler's backward, or were wiped before step; update() after a direct optimizer.step()
            if "prior to update" in text:
                cause = ("scaler.update() ran, but scaler.step(optimizer) never did this iteration: optimizer.step() was "
                         "called directly, so it applied the gradients still multiplied by the loss scale (65536 at "
                         "the start), and the scaler never checked them for inf/NaN")
                fix = ("Step through the scaler: scaler.scale(loss).backward(); scaler.step(optimizer); "
                       "scaler.update() (scaler.step unscales, skips a step with inf/NaN gradients, and calls "
                       "optimizer.step()).")
                return "GradScaler", cause, fix, {"missing_scaler_step": True}
            cause = ("scaler.step(optimizer) found no gradients to unscale for this optimizer: none of its parameters "
                     "has a gradient, because optimizer.zero_grad() ran between scaler.scale(loss).backward() and "
                     "scaler.step(optimizer) (or the loss scaled does not reach this optimizer's parameters)")
            fix = ("Zero the gradients before the backward: optimizer.zero_grad(); scaler.scale(loss).backward(); "
                   "scaler.step(optimizer); scaler.update().")
            return "GradScaler", cause, fix, {"no_gradients_at_step": True}
        if isinstance(exc, ValueError) and "some parameters appear in more than one parameter group" in text:
            return self._shared_param_groups(exc)
        if isinstance(exc, ValueError):
            m = _DIST_RE.search(text)
            if m:
                return _distribution_args(text, *m.groups())
            m = _ONECYCLE_RE.search(text)
            if m:
                found = _one_cycle_overrun(exc, int(m.group(1)), int(m.group(2)))
                sched = _traceback_self(exc, "OneCycleLR")
                stepping = self.g.watched.stepping_optimizers()
                if sched is not None and stepping and not any(getattr(sched, "optimizer", None) is o for o in stepping):
                    # built once before a loop that makes a new optimizer per fold or run: it drives an optimizer
                    # that never steps, and runs out after the first fold
                    where, _, _, details = found
                    cause = (f"OneCycleLR was stepped {m.group(1)} times, past its total_steps={m.group(2)}, and the "
                             f"optimizer it schedules is not one that steps: it was built once, over an optimizer "
                             f"replaced since (a new model and optimizer per fold of a cross-validation), so it runs "
                             f"out after the first fold and never set the new optimizers' learning rate")
                    fix = ("Build the scheduler inside the loop, right after each fold's optimizer: sched = "
                           "OneCycleLR(opt, max_lr=..., epochs=EPOCHS, steps_per_epoch=len(train_loader)).")
                    return where, cause, fix, {**details, "stale_optimizer": True}
                return found
        if isinstance(exc, RuntimeError) and "modified by an inplace operation" in text:
            info, self._inplace = self._inplace, None
            path = (info or {}).get("module")
            details = dict(info or {})
            if path:
                cause = (f"a tensor that `{path}`{self._mtype(path)} saved for backward "
                         f"({info['shape']}, {info['dtype']}) was modified in place before backward() "
                         f"(version {info['version']}, saved at {info['saved_version']})")
            else:
                cause = "a tensor saved for backward was modified in place before backward() needed it"
            fix = ("Make the later in-place op out-of-place (x = x + y instead of x += y, x.add_() -> x.add(), "
                   "nn.ReLU(inplace=False), no x[idx] = ... on it), or .clone() the tensor before changing it.")
            held = self._optimised_saved(exc, text) if not path else None
            if held is not None:
                # no module saved it (functional code on plain tensors): the tensor an optimizer updates, saved by an
                # earlier step's ops and stepped since
                name, opt = held
                cause += (f": it is `{name}`, the tensor {opt} optimises, saved by an earlier step's forward and "
                          f"updated by {opt}.step() since, so this backward() runs through an earlier step's graph: "
                          f"something carried from one iteration into the next still attached to it, such as the "
                          f"optimised tensor's own name re-bound to a value computed from it (`q = F.normalize(q)`), "
                          f"which the next iteration computes from again")
                fix = ("Keep the optimised leaf's name for the leaf: compute the derived value under another name "
                       "(`qn = F.normalize(q)`, and use qn in the loss), or renormalise the leaf in place under "
                       "torch.no_grad() after optimizer.step(); detach whatever else is carried across steps, and "
                       "drop retain_graph=True.")
                details = {**details, "optimised_tensor": name, "optimizer": opt}
            if info and "saved_at_step" in info:
                # A weight saved by an earlier step's forward, updated by optimizer.step() since: this backward runs
                # through that step's graph (a hidden state carried over without detach, kept with retain_graph).
                what = (f"a weight of `{path}`" if info.get("weight", True) else
                        f"a leaf tensor that requires grad (an input the optimizer updates), taken by `{path}`")
                cause += (f": it is {what} saved by step {info['saved_at_step']}'s forward and updated "
                          f"by optimizer.step() since, so this backward() runs through the graph of an earlier step "
                          f"(a tensor carried across steps without .detach(): an RNN's hidden state, an external "
                          f"memory, a running sum)")
                fix = ("Detach what is carried from one step to the next (truncated BPTT: state = state.detach(), "
                       "or tuple(s.detach() for s in state) for an LSTM) and drop retain_graph=True, so each "
                       "backward() ends at its own step's start.")
            elif info and "parameter" in info and (emb := self._max_norm_table(info["parameter"])) is not None:
                cause += (f": it is the weight `{info['parameter']}` of an nn.Embedding with "
                          f"max_norm={emb.max_norm:g}, which renormalises the rows it looks up in place, inside its own forward: the weight was "
                          f"used in this graph before that lookup (a tied projection, a regulariser over the table)")
                fix = ("Use a copy of the weight where it is used outside the lookup (`emb.weight.clone()`, as the "
                       "nn.Embedding documentation says for max_norm), or do the lookup before that use.")
                details = {**details, "max_norm": emb.max_norm}
            elif info and "parameter" in info:
                cause += (f": it is the weight `{info['parameter']}`, changed in place after the forward that saved "
                          f"it and before this backward() (a renormalisation, clamp or copy under torch.no_grad() "
                          f"placed between the loss and backward())")
                fix = ("Change weights by hand after optimizer.step() (or before the forward), not between the forward "
                       "and backward(): move the `with torch.no_grad(): ...` block below optimizer.step().")
            return path or details.get("optimised_tensor") or "backward", cause, fix, details
        if isinstance(exc, RuntimeError) and "a leaf Variable that requires grad is being used in an in-place" in text:
            cause = ("an in-place operation on a leaf tensor that requires grad (a parameter: p.div_(...), "
                     "p.clamp_(...), p.copy_(...), p[idx] = ...) ran while autograd was recording: autograd cannot "
                     "record a change made to a leaf")
            fix = ("Change parameters by hand under `with torch.no_grad():` (or in a function decorated with "
                   "@torch.no_grad()), as optimizers do: with torch.no_grad(): p.div_(norms). Do it after "
                   "optimizer.step(), not between the forward and backward() that need the old values.")
            return "parameter", cause, fix, {}
        if isinstance(exc, RuntimeError) and "grad can be implicitly created only for scalar outputs" in text \
                and _through(exc, "grad"):
            # torch.autograd.grad(H(x), x): a derivative of a model's output per sample (dH/dx, forces, u_x), whose
            # .mean() fix would divide every derivative by the batch size
            cause = ("torch.autograd.grad was given a non-scalar output without grad_outputs: for the derivative of "
                     "each sample's output with respect to its own input (dH/dx, a force, u_x in a PINN) the output's "
                     "gradient must be given")
            fix = ("Pass grad_outputs=torch.ones_like(out) (or differentiate out.sum(), the same thing: each sample's "
                   "output depends on its own input only); not out.mean(), which divides every derivative by the "
                   "batch size.")
            return "torch.autograd.grad", cause, fix, {"autograd_grad": True}
        if isinstance(exc, RuntimeError) and "grad can be implicitly created only for scalar outputs" in text:
            cause = ("backward() was called on a tensor with more than one element: a loss left unreduced "
                     "(reduction='none', a per-sample or per-element loss) has no implicit gradient")
            fix = ("Reduce the loss to a scalar before backward(): loss.mean() (or loss.sum(), which scales the "
                   "gradients with the batch size; for per-sample weights (loss * w).sum() / w.sum()). To "
                   "back-propagate a non-scalar on purpose, pass its gradient: out.backward(torch.ones_like(out)).")
            return "loss", cause, fix, {}
        if isinstance(exc, RuntimeError) and text.startswith("Class values must be"):  # F.one_hot's two checks
            if "non-negative" in text:
                cause = ("F.one_hot got a negative class index: an ignore label (-1, or -100 for padding and unlabelled "
                         "samples) kept in the labels it was given")
                fix = ("Leave the ignored samples out before one_hot (y[y >= 0]), or one-hot y.clamp_min(0) and zero "
                       "those rows: F.one_hot(y.clamp_min(0), C) * (y >= 0).unsqueeze(-1).")
            else:
                cause = ("F.one_hot got a class index >= num_classes: labels numbered from 1 (1..C), or a num_classes "
                         "smaller than the dataset's number of classes")
                fix = ("Print y.min() and y.max(): make 1-based labels 0-based (y - 1) or pass the real number of "
                       "classes, F.one_hot(y, num_classes=C) (cross_entropy says the same as 'Target C is out of bounds').")
            return "one_hot", cause, fix, {"op": "one_hot"}
        m = _WRONG_GRADS_RE.search(text) if isinstance(exc, RuntimeError) else None
        if m:
            node, want, got = m.group(1), int(m.group(2)), int(m.group(3))
            fn = node[:-len("Backward")] if node.endswith("Backward") else node
            cause = (f"the backward of the custom autograd.Function `{fn}` returned {got} gradient(s), but its forward "
                     f"took {want} input(s): backward must return exactly one value per forward argument after ctx")
            fix = (f"Return one gradient per input of {fn}.forward, in order, with None for the arguments that need "
                   f"none (non-tensors, constants, lambda of a gradient reversal): return grad_x, None.")
            return fn, cause, fix, {"function": fn, "expected": want, "returned": got}
        if isinstance(exc, RuntimeError) and "backward through the graph a second time" in text:
            return self._second_backward(exc)
        typed = _TYPE_RE.search(text)
        if typed and _dtype_part(typed.group(1)) != _dtype_part(typed.group(2)):
            typed = None  # a dtype mismatch (below)
        if isinstance(exc, RuntimeError) and ("Expected all tensors to be on the same device" in text
                                              or "is not on the expected device" in text or typed):
            m = _DEV_RE.search(text) or _DEV2_RE.search(text)
            devs = list(m.groups()) if m else []
            if typed:  # "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor)": a conv's input
                devs = ["cuda" if ".cuda." in t else "cpu" for t in typed.groups()]
            where = module or "model"
            cause = ("tensors on different devices met in one operation"
                     + (f" in `{module}`{self._mtype(module)}" if module else "")
                     + (f" ({devs[0]} and {devs[1]})" if devs else ""))
            fix = ("Move the model and every input to one device: model = model.to(device); x = x.to(device). "
                   "Tensor.cuda()/.to() return a copy - reassign it (x = x.cuda()); nn.Module.to() moves in place. "
                   "Create new tensors with device=x.device.")
            stray = self._stray_attributes(exc)
            if stray:
                names = ", ".join(f"`{n}` ({d})" for n, d in stray[:3])
                cause += f"; {names} is a plain tensor attribute, which module.to()/.to_empty()/.cuda() do not move"
                fix = (f"Register it as a buffer so that the module's moves take it along: "
                       f"self.register_buffer('{stray[0][0].rsplit('.', 1)[-1]}', tensor, persistent=False) "
                       f"instead of self.{stray[0][0].rsplit('.', 1)[-1]} = tensor (persistent=True keeps it in "
                       f"state_dict).")
            return where, cause, fix, {"devices": devs, **({"plain_attributes": [n for n, _ in stray]} if stray else {})}
        if isinstance(exc, ValueError) and "Expected more than 1 value per channel when training" in text:
            m = _SIZE_RE.search(text)
            where = module or "batchnorm"
            cause = ((f"`{module}`{self._mtype(module)}" if module else "a BatchNorm layer")
                     + " in training mode got one value per channel"
                     + (f" (input size {m.group(1)})" if m else "") + ": a batch of 1 has no batch statistics")
            fix = ("Use drop_last=True in the DataLoader (the last batch has 1 sample) or a batch size > 1; "
                   "call model.eval() for single-sample inference; GroupNorm/LayerNorm work with batch size 1.")
            return where, cause, fix, {"input_size": m.group(1) if m else None}
        oom = isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or (
            isinstance(exc, RuntimeError) and ("out of memory" in low or "can't allocate memory" in low))
        if oom:
            return self._oom(exc, module)
        # A worker's death can also reach the main process as the connection it sent a batch through closing
        # (ConnectionResetError, EOFError), before PyTorch's own "DataLoader worker ... exited" error.
        closed = isinstance(exc, (ConnectionError, EOFError)) and _loader_iter(exc) is not None
        if closed or (isinstance(exc, RuntimeError) and "dataloader worker" in low and (
                "shared memory" in low or "exited unexpectedly" in low or "killed by signal" in low)):
            sigs = _worker_signals(exc, wait=1.0 if closed else 0.0)
            bus = "shared memory" in low or "bus error" in low or getattr(signal, "SIGBUS", -1) in sigs
            if bus:
                cause = ("a DataLoader worker died with a bus error: the workers ran out of shared memory "
                         "(/dev/shm) passing batches to the main process (common in Docker, whose default "
                         "/dev/shm is 64 MB)")
                fix = ("Use fewer workers (num_workers=0 to confirm) or smaller batches, or give the container a "
                       "larger /dev/shm (docker run --shm-size=8g or --ipc=host).")
            elif signal.SIGKILL in sigs:
                cause = "a DataLoader worker was killed (SIGKILL): usually the kernel's OOM killer, out of host RAM"
                fix = ("Use fewer workers or smaller batches, avoid copying large Python lists/arrays into each "
                       "worker, or add host memory; num_workers=0 shows the underlying error if there is one.")
            elif closed:
                cause = (f"a DataLoader worker died while passing a batch to the main process (the connection it "
                         f"sends tensors through closed: {type(exc).__name__}); the usual cause is a bus error from "
                         f"a full /dev/shm (shared memory, 64 MB by default in Docker)")
                fix = ("Run with num_workers=0 to see the worker's own error; for shared memory use fewer workers or "
                       "smaller batches, or give the container a larger /dev/shm (docker run --shm-size=8g or "
                       "--ipc=host).")
            else:
                return None
            return "DataLoader", cause, fix, {"worker_signals": sigs}
        if (isinstance(exc, IndexError) and "index out of range in self" in text) or (
                isinstance(exc, RuntimeError) and ("which is not in the valid range [0," in text
                                                   or "Expected i < index_size" in text)):  # EmbeddingBag's two
            return self._embedding_index(exc, module)
        m = _INVALID_GRAD_RE.search(text)
        if isinstance(exc, RuntimeError) and m:
            return self._reshaped_leaf(m.group(2), m.group(3))
        if isinstance(exc, RuntimeError) and "can't be cast to the desired output type" in text:
            target = _local_of(exc, ("binary_cross_entropy_with_logits", "binary_cross_entropy"), "target")
            if isinstance(target, torch.Tensor) and not target.is_floating_point():
                # BCE computes in the target's dtype: an int64 target (ordinal levels, multi-hot labels built with
                # a comparison and .long()) leaves a float result nowhere to go
                dtype = str(target.dtype).replace("torch.", "")
                cause = (f"the binary cross-entropy's targets are {dtype}: BCE/BCEWithLogitsLoss take float targets "
                         f"(probabilities in [0, 1], of the input's shape), and PyTorch's message speaks of the "
                         f"result's type instead")
                fix = ("Make the targets float: loss_fn(logits, y.float()) (or build them as float: "
                       "(y[:, None] > torch.arange(K)).float() for ordinal levels).")
                return "loss", cause, fix, {"target_dtype": dtype}
        m = _TARGET_DTYPE_RE.search(text)
        if isinstance(exc, RuntimeError) and m:
            got = m.group(1)
            cause = (f"the loss's class targets are {got} ({'torch.float32' if got == 'Float' else 'torch.' + got.lower()}"
                     f"), but cross_entropy/nll_loss take class indices as int64 (Long)"
                     + (": labels read from NumPy or a CSV often arrive as int32" if got == "Int" else "")
                     + (": float targets must instead be class probabilities of the input's shape" if got in ("Float", "Double", "Half") else ""))
            fix = ("Convert the targets: loss_fn(logits, y.long()) (or make the Dataset return torch.long labels: "
                   "torch.as_tensor(label, dtype=torch.long)).")
            target = _local_of(exc, ("cross_entropy", "nll_loss"), "target")
            if got in ("Float", "Double", "Half", "BFloat16") and _fractional(target):
                # mixed labels (mixup or cutmix applied to class indices): .long() would cut 1.3 to 1 without a word
                cause += (f"; these hold fractions ({_few(target)}), class indices mixed as numbers (mixup or cutmix "
                          f"applied to the labels), which .long() would truncate")
                fix = ("Mix one-hot targets instead of class indices: y_mix = lam * F.one_hot(y, C).float() + (1 - lam) "
                       "* F.one_hot(y[perm], C).float(), then F.cross_entropy(logits, y_mix) (probabilities of the "
                       "input's shape); or mix the losses: lam * F.cross_entropy(logits, y) + (1 - lam) * "
                       "F.cross_entropy(logits, y[perm]).")
                return "loss", cause, fix, {"target_dtype": got, "fractional_targets": True}
            return "loss", cause, fix, {"target_dtype": got}
        hit = self._beginner_loss(exc, text)
        if hit is not None:
            return hit
        hit = _ce_target_layout(exc, text)
        if hit is not None:
            return hit
        if isinstance(exc, RuntimeError) and "doesn't match the broadcast shape" in text:
            hit = _loss_weight_shape(exc)
            if hit is not None:
                return hit
        if isinstance(exc, (RuntimeError, ValueError)):
            hit = (self._dtype_mismatch(exc, text, module) or self._channels(text, module, exc)
                   or self._stale_state(exc, text) or self._loss_sizes(exc, text))
            if hit is not None:
                return hit
        if isinstance(exc, AttributeError):
            m = _DP_RE.search(text)
            if m:
                wrapper, name = m.groups()
                known = any(hasattr(mod, name) for mod in self.g.models)
                cause = (f"{wrapper} wraps the model: its submodules and attributes live on .module, so "
                         f"`.{name}` is not found on the wrapper")
                fix = (f"Use model.module.{name} (or keep a reference to the unwrapped model); the same applies "
                       f"to state_dict() keys, which gain a 'module.' prefix.")
                return wrapper, cause, fix, {"attribute": name, "found_on_module": known}
        return None

    def _shared_param_groups(self, exc: BaseException) -> Tuple[str, str, str, Dict[str, Any]]:
        """A parameter in two param groups: which one (a tied weight is one parameter under two names)."""
        shared: List[str] = []
        tb = exc.__traceback__
        while tb is not None:
            local = tb.tb_frame.f_locals
            if tb.tb_frame.f_code.co_name == "add_param_group" and isinstance(local.get("param_group"), dict):
                new = {id(p) for p in local["param_group"].get("params", ())}
                groups = getattr(local.get("self"), "param_groups", None) or []
                before = {id(p) for g in groups for p in g["params"]}
                ids = new & before
                for root in self.g.roots or self.g.models:
                    names: Dict[int, List[str]] = {}
                    for n, p in root.named_parameters(remove_duplicate=False):
                        names.setdefault(id(p), []).append(n)
                    shared += [" = ".join(names[i]) for i in ids if i in names]
            tb = tb.tb_next
        tied = any(" = " in n for n in shared)
        cause = ("a parameter was given to two param groups of one optimizer"
                 + (f": {', '.join(shared[:3])}" if shared else "")
                 + (" (one tied weight under two names: the same Parameter reached through both modules)" if tied else ""))
        fix = ("Put each parameter in one group: build the groups from one de-duplicated list (model.named_parameters() "
               "lists a tied weight once), e.g. seen = set(); group_b = [p for p in b.parameters() if id(p) not in seen]"
               + ("; a tied weight belongs to the group of whichever module should set its lr and decay" if tied else "")
               + ".")
        return "optimizer", cause, fix, {"shared": shared[:10], "tied": tied}

    def _embedding_index(self, exc: BaseException, module: Optional[str]) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """An Embedding given an index >= num_embeddings (or < 0): which layer, the index and the table's size."""
        path, mod, args = self._innermost(exc)
        if not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or not args or not isinstance(args[0], torch.Tensor):
            return None
        idx = args[0]
        if idx.numel() == 0 or idx.is_floating_point() or idx.device.type == "meta":
            return None
        lo, hi = int(idx.min()), int(idx.max())
        n = mod.num_embeddings
        shape = list(idx.shape)
        if 0 <= lo and hi < n:
            # every index fits: an EmbeddingBag's offsets are what is out of range (bag lengths passed as offsets)
            return self._bag_offsets(path, mod, args) if isinstance(mod, nn.EmbeddingBag) else None
        bad = hi if hi >= n else lo
        cause = (f"`{path}` ({type(mod).__name__}({n}, {mod.embedding_dim})) got index {bad}, outside [0, {n}) "
                 f"(indices of shape {shape} range over [{lo}, {hi}]): " +
                 ("a position past the longest sequence it was built for, or a token id past the vocabulary"
                  if bad >= n else "a negative index (a padding or ignore value such as -100 or -1 used as an id)"))
        fix = (f"Make num_embeddings cover every index (the vocabulary size, or the longest sequence for positions: "
               f"at least {hi + 1}), or truncate/clip the inputs to it (x[:, :{n}] for positions); for padding, use "
               f"an id inside the table with padding_idx=... .")
        hashed = bad >= 10 * n
        if hi == n and lo >= 1 and idx.dim() <= 2:
            # ids 1..N into a table of N rows: numbered from 1 (a database's ids, ranks); a bigger table would leave
            # row 0 untrained and every id one row off its meaning nowhere
            cause += (f"; the largest is exactly {n}, the table's size, and none is 0: ids numbered from 1 (1..{n}) "
                      f"look like this")
            fix = (f"Shift ids numbered from 1 to 0..{n - 1} (`ids - 1`); a table of {n + 1} rows instead leaves row 0 "
                   f"untrained (fine only as padding, with padding_idx=0).")
        if hashed:
            # ids far past the table (raw hashes, user or item ids of the whole catalogue): the hashing trick's modulo
            cause += (f"; the indices reach {hi / n:,.0f}x the table's size, which looks like raw hashed or "
                      f"catalogue-wide ids")
            fix = (f"Map the ids into the table: hashed features need `ids % {n}` (the hashing trick), catalogue ids a "
                   f"vocabulary lookup to 0..N-1; a table of {hi + 1:,} rows is rarely what was meant.")
        return path or "embedding", cause, fix, {"num_embeddings": n, "index_min": lo, "index_max": hi,
                                                  "index_shape": shape, **({"hashed_ids": True} if hashed else {})}

    def _max_norm_table(self, name: str) -> Optional[nn.Embedding]:
        """The nn.Embedding with max_norm whose weight is the parameter `name` (it renormalises in its forward)."""
        param = dict(self.g.named_parameters()).get(name)
        if param is None:
            return None
        for root in self.g.watched.roots:
            for mod in root.modules():
                if isinstance(mod, nn.Embedding) and mod.max_norm is not None and mod.weight is param:
                    return mod
        return None

    @staticmethod
    def _bag_offsets(path: str, mod: nn.EmbeddingBag, args: tuple) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """An EmbeddingBag whose indices all fit, given offsets that are not the start of each bag (the bags'
        lengths): 0 first, non-decreasing, none past the number of indices."""
        off = args[1] if len(args) > 1 else None
        if not isinstance(off, torch.Tensor) or off.dim() != 1 or off.numel() == 0 or off.is_floating_point():
            return None
        total = args[0].numel()
        vals = off.detach().cpu()
        first, last = int(vals[0]), int(vals[-1])
        rising = bool((vals[1:] >= vals[:-1]).all()) if vals.numel() > 1 else True
        if first == 0 and rising and last <= total:
            return None
        cause = (f"`{path}` (EmbeddingBag) got offsets that are not where each bag starts (first {first}, last {last}, "
                 f"{'non-decreasing' if rising else 'not non-decreasing'}; {total} indices): offsets must start at 0 "
                 f"and rise to at most the number of indices; bag lengths passed as offsets look like this")
        fix = ("Pass each bag's start: offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]) (not "
               "the lengths), or give a 2-D input of equal-length bags with no offsets.")
        return path or "embedding_bag", cause, fix, {"offsets_first": first, "offsets_last": last,
                                                     "offsets_rising": rising, "indices": total}

    def _dtype_mismatch(self, exc: BaseException, text: str, module: Optional[str]) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """Float and Double met in one op: name the odd parameters of the failing module, or its input."""
        m = _TYPE_RE.search(text)
        if m:  # "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor)" is about devices
            if _dtype_part(m.group(1)) == _dtype_part(m.group(2)):
                return None
        elif not any(t in text for t in _DTYPE_TEXTS):
            return None
        hit = self._loss_weight_dtype(exc)
        if hit is not None:
            return hit
        path, mod, args = self._innermost(exc)
        inputs = {f"args[{i}]": str(a.dtype).replace("torch.", "") for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor) and a.is_floating_point()}
        params: Dict[str, str] = {}
        if isinstance(mod, nn.Module):
            for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                if t is not None and t.is_floating_point():
                    params[n] = str(t.dtype).replace("torch.", "")
        kinds = sorted(set(params.values()))
        said = [w for k, w in _DTYPE_WORDS.items() if re.search(rf"\b{k}\b", text, re.I) or w in text]
        where = path or module or "model"
        name = f"`{where}`{self._mtype(where)}" if path else "an operation"
        if len(kinds) > 1:
            cause = (f"{name} holds parameters of different dtypes ("
                     + ", ".join(f"{n}: {d}" for n, d in params.items()) + "): one op cannot mix them")
        elif kinds:
            odd = {n: d for n, d in inputs.items() if d != kinds[0]}
            other = list(odd.values()) or [d for d in said if d != kinds[0]]
            cause = (f"{name} has {kinds[0]} parameters but got a {other[0] if other else 'different'} input"
                     + (f" ({', '.join(odd)})" if odd else "")
                     + ("; often NumPy data: its arrays are float64, and torch.from_numpy / torch.tensor keep that"
                        if other and other[0] == "float64" else ""))
        else:
            cause = f"tensors of different dtypes ({' and '.join(said) or 'float types'}) met in {name}"
        fix = ("Give the model and its inputs one dtype: x = x.float() (torch.from_numpy(a).float() for NumPy data), "
               "or model.to(x.dtype) / model.float() for weights made from NumPy arrays; for mixed precision use "
               "torch.autocast rather than .half() on some tensors. Tensor.double()/.float()/.half()/.to() return a "
               "new tensor: a bare `x.double()` changes nothing, assign it (x = x.double()); only nn.Module's "
               "conversions work in place.")
        return where, cause, fix, {"param_dtypes": params, "input_dtypes": inputs, "error_dtypes": said}

    def _loss_weight_dtype(self, exc: BaseException) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """A loss's class weights (``weight=``, ``pos_weight=``) of another dtype than its input: float64 weights
        from NumPy class counts, in ``nn.CrossEntropyLoss(weight=cw)`` or ``F.cross_entropy(..., weight=cw)``."""
        tb = exc.__traceback__
        found = None
        while tb is not None:  # the innermost torch loss function's own arguments
            code = tb.tb_frame.f_code
            if code.co_name in _WEIGHTED_LOSSES and is_skipped(code.co_filename):
                local = tb.tb_frame.f_locals
                x = local.get("input")
                for arg in ("weight", "pos_weight"):
                    w = local.get(arg)
                    if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.is_floating_point()
                            and x.is_floating_point() and w.dtype != x.dtype):
                        found = (code.co_name, arg, str(w.dtype).replace("torch.", ""),
                                 str(x.dtype).replace("torch.", ""))
            tb = tb.tb_next
        if found is None:
            return None
        fn, arg, wd, xd = found
        cause = (f"the {arg}= tensor given to {fn} is {wd} while its input is {xd}"
                 + ("; class weights computed with NumPy are float64, and torch.from_numpy / torch.tensor keep that"
                    if wd == "float64" else ""))
        fix = (f"Make the weights the input's dtype: {arg}=w.float() (or torch.tensor(..., dtype=torch.float32)); "
               f"for a loss module, build it with the converted tensor (nn.CrossEntropyLoss(weight=w.float())) or "
               f"call criterion.to(logits.dtype).")
        return "loss", cause, fix, {"loss": fn, "argument": arg, "weight_dtype": wd, "input_dtype": xd}

    def _no_graph(self, exc: BaseException) -> Tuple[str, str, str, Dict[str, Any]]:
        """``backward()`` (or ``autograd.grad``) on a tensor with no graph: which of the usual causes it is."""
        # under a global guard the models are the outermost modules seen called
        params = [p for m in (self.g.models or self.g.roots) for p in m.parameters()]
        # a model frozen on purpose while an optimizer trains something else (style transfer's image, an adversarial
        # patch, a soft prompt): the loss was cut from that tensor, not from the model
        trains = any(p.requires_grad for o in self._optimizers(exc) for grp in o.param_groups for p in grp["params"])
        frozen = bool(params) and not any(p.requires_grad for p in params) and not trains
        # the mode backward() ran under (noted as it raised), else the mode where the exception left the user's code
        grad_off = not getattr(exc, "guard_grad_enabled", torch.is_grad_enabled())
        fn = None
        tb = exc.__traceback__
        while tb is not None:  # autograd.grad's own frame: its create_graph
            if tb.tb_frame.f_code.co_name == "grad" and is_skipped(tb.tb_frame.f_code.co_filename):
                fn = "grad"
            tb = tb.tb_next
        if grad_off and fn == "grad":
            why = ("gradient recording was off where torch.autograd.grad ran (inside torch.no_grad() or a function "
                   "decorated @torch.no_grad(): a sampler or attack written like an evaluation helper), so the model "
                   "call it differentiates recorded no graph")
            fix = ("Record the graph where the gradient is taken: drop the @torch.no_grad() decorator from that "
                   "function, or wrap the model call and torch.autograd.grad in `with torch.enable_grad():`, and "
                   "detach the samples it returns.")
            cause = f"torch.autograd.grad got a tensor with no autograd graph: {why}"
            return "torch.autograd.grad", cause, fix, {"grad_enabled": False, "model_frozen": frozen, "autograd_grad": True}
        if fn == "grad" and not grad_off and not frozen:
            why = ("the tensor it differentiates carries no graph: most often a derivative taken by an earlier "
                   "torch.autograd.grad without create_graph=True (a PINN's u_x, whose own derivative u_xx is taken "
                   "next), else a tensor cut by .detach(), .item() or torch.no_grad()")
            fix = ("Take every derivative that is differentiated again with create_graph=True: u_x = "
                   "torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0], then u_xx from u_x (even "
                   "where only values are needed, such as residuals for resampling: detach the result afterwards).")
            cause = f"torch.autograd.grad got a tensor with no autograd graph: {why}"
            return "torch.autograd.grad", cause, fix, {"grad_enabled": True, "model_frozen": False,
                                                       "autograd_grad": True}
        if grad_off:
            why = ("gradient recording is off where it ran (inside torch.no_grad(), torch.inference_mode() or a "
                   "function decorated with them, such as an evaluation helper reused for training)")
            fix = "Compute the loss with gradients on: move the training step out of torch.no_grad()/inference_mode."
        elif frozen:
            why = "every parameter of the model has requires_grad=False (frozen), so nothing in it needs a gradient"
            fix = ("Unfreeze what should train (module.requires_grad_(True)), or, for a frozen feature extractor, train "
                   "a head whose parameters require grad.")
        elif self._nograd_call is not None and not fn:
            why = (f"the model's last call ({self._nograd_call}) ran with gradient recording off (inside "
                   f"torch.no_grad(), torch.inference_mode() or a function decorated with them, such as an evaluation "
                   f"helper reused for training), so its output, and the loss computed from it, carry no graph")
            fix = ("Call the model with gradients on for training: drop the @torch.no_grad() decorator from that "
                   "function (keep a decorated copy for inference), or wrap the call in `with torch.enable_grad():`.")
        else:
            why = ("it was cut from the model's graph: computed from .detach(), .item(), .numpy(), .data or "
                   "torch.tensor(...), under torch.no_grad() earlier, or from torch.autograd.grad(...) without "
                   "create_graph=True (a force or gradient-penalty term then has no graph to back-propagate)")
            fix = ("Keep the loss inside autograd: no .detach()/.item()/.numpy()/.data on the way to it, and "
                   "torch.autograd.grad(..., create_graph=True) for terms built from gradients; do not wrap it in "
                   "torch.tensor(..., requires_grad=True) (that trains nothing).")
        cause = f"{'torch.autograd.grad' if fn else 'backward()'} got a tensor with no autograd graph: {why}"
        details = {"grad_enabled": not grad_off, "model_frozen": frozen}
        if not grad_off and not frozen and self._nograd_call is not None and not fn:
            details["model_call_without_grad"] = self._nograd_call
        return "loss", cause, fix, details

    def _optimised_saved(self, exc: BaseException, text: str) -> Optional[Tuple[str, str]]:
        """(name, optimizer class) of the one tensor an optimizer holds that matches the in-place error's shape and
        version (``[torch.FloatTensor [4]] is at version 3``), when nothing else is known."""
        m = re.search(r"\[torch\.\w+ \[([\d, ]*)\]\] is at version (\d+)", text)
        if not m:
            return None
        shape = [int(d) for d in m.group(1).split(",") if d.strip()]
        version = int(m.group(2))
        found = [(p, o) for o in self._optimizers(exc) for grp in o.param_groups for p in grp["params"]
                 if list(p.shape) == shape and p._version == version]
        if len(found) != 1:
            return None
        p, o = found[0]
        name = self.g.param_name(p)
        if name.startswith("param_groups["):
            # the variable that named it now holds a value computed from it (`q = F.normalize(q)`): name that one
            tb = exc.__traceback__
            while tb is not None and name.startswith("param_groups["):
                fr = tb.tb_frame
                if not is_skipped(fr.f_code.co_filename):
                    for var, v in list(frame_locals(fr).items()) + list(fr.f_globals.items()):
                        if isinstance(v, torch.Tensor) and v.grad_fn is not None and not var.startswith("_") and any(
                                getattr(n, "variable", None) is p for n in walk([v.grad_fn], Budget(2000))):
                            name = var
                            break
                tb = tb.tb_next
        return name, type(o).__name__

    def _optimizers(self, exc: BaseException) -> List[Any]:
        """The optimizers guard knows, else those the raising frames name (a global guard knows an optimizer from
        its first step; a script failing at its first backward() has stepped none)."""
        if self.g.optimizers:
            return list(self.g.optimizers)
        found: Dict[int, Any] = {}
        tb = exc.__traceback__
        while tb is not None:
            fr = tb.tb_frame
            if not is_skipped(fr.f_code.co_filename):
                for v in list(frame_locals(fr).values()) + list(fr.f_globals.values()):
                    if isinstance(v, torch.optim.Optimizer):
                        found.setdefault(id(v), v)
            tb = tb.tb_next
        return list(found.values())

    def _trains_through(self, ts: List[torch.Tensor]) -> bool:
        """Whether the graph behind `ts` (a few hundred nodes) reaches a parameter that a watched optimizer holds."""
        held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
        for node in walk([t.grad_fn for t in ts if t.grad_fn is not None], Budget(400)):
            v = getattr(node, "variable", None)
            if v is not None and id(v) in held:
                return True
        return False

    def _second_backward(self, exc: BaseException) -> Tuple[str, str, str, Dict[str, Any]]:
        """Backward through a freed graph: names the variable or attribute that brought an earlier graph in."""
        try:
            held = _freed_holder(exc, self.g.graph_seq)
        except Exception:
            held = None
        if held is None:
            cause = ("backward() ran through a graph whose saved tensors were freed by an earlier backward(): "
                     "something from an earlier step is still attached to this step's graph (a hidden state or "
                     "running total carried across iterations, e.g. total_loss += loss or an RNN hidden state)")
            fix = ("Detach what you carry across steps (hidden = hidden.detach(), total_loss += loss.item()); "
                   "pass retain_graph=True only when you really back-propagate twice through the same graph.")
            return "backward", cause, fix, {}
        name, line, how, expr, value = held
        if how == "twice":
            cause = ("backward() ran a second time through the graph of a loss that an earlier backward() already "
                     "ran through and freed (backward() called twice on one loss, or on a loss computed before the "
                     "last backward())")
            fix = ("Call backward() once per loss (sum several losses and call it once); to back-propagate twice "
                   "through one graph on purpose, pass retain_graph=True to the first backward().")
            return "backward", cause, fix, {}
        if line is None:  # it holds a tensor of the earlier graph itself (a cache, a GAN's fake batch)
            cause = (f"this loss is computed from `{name}`, a tensor made before the last backward(), which ran "
                     f"through its graph and freed it (a tensor cached across steps, or one shared by two losses "
                     f"that are back-propagated one after the other)")
            kept = (f"store detached values in {name[:-5]}: {name[:-5]}.append(x.detach()), or "
                    f"{name[:-5]}[key] = x.detach()" if name.endswith("[...]") else f"{name} = ....detach()")
            fix = (f"Detach it where it is kept ({kept}) or compute it again for each step; when two "
                   f"losses share it on purpose, detach it for the one that must not reach its graph (a GAN's "
                   f"D(fake.detach())), or pass retain_graph=True to the first backward().")
            if isinstance(value, list) and not name.endswith("[...]") and self.g.step >= 1 \
                    and _newest_node_of(value) <= self.g.first_graph_seq and self._trains_through(value):
                # a regulariser computed once before the loop (`kl = kl_divergence(q(mu, rho), prior).sum()`), made
                # before the first backward and failing at a later step (a GAN's shared `fake` fails at its first):
                # a detached copy would be a constant, and the parameters it is made of would get no gradient
                fix = (f"Compute `{name}` again inside the loop, at each step: it is made from parameters an optimizer "
                       f"trains, so a detached copy would be a constant that gives them no gradient. Detach it only if "
                       f"it is meant as a constant ({kept}); when two losses share it on purpose, detach it for the one "
                       f"that must not reach its graph (a GAN's D(fake.detach())), or pass retain_graph=True to the "
                       f"first backward().")
            if isinstance(value, list) and _from_plain_leaf(value):
                # `self.prompt = torch.randn(P, D, requires_grad=True) * 0.5`: meant to be trained, made once as a
                # result of a leaf, not a leaf; detaching it would stop it from ever training
                cause += (f"; `{name}` is computed once from a tensor made with requires_grad=True (such as "
                          f"`torch.randn(..., requires_grad=True) * 0.5`), so it is a result, not a leaf, and no "
                          f"optimizer updates it")
                fix = (f"Make it an nn.Parameter where it is created, a leaf the optimizer updates: "
                       f"{name} = nn.Parameter(torch.randn(...) * 0.5), with the scaling inside (or scale the leaf in "
                       f"place under torch.no_grad()); if it is a constant cache, detach it instead ({kept}).")
        elif how == "sum":
            cause = (f"`{name}` adds up tensors across iterations ({line}) with their graphs: backward() on it runs "
                     f"again through the graphs of earlier iterations, which their backward() freed")
            fix = (f"Call backward() on each iteration's own loss, and keep a number for the total: "
                   f"{expr} += loss.item() (or loss.detach()).")
        elif how == "write":
            cause = (f"`{name}` is written in place with tensors still attached to their graph ({line}), and this "
                     f"loss reads it after an earlier backward() freed that graph (a replay buffer or memory of "
                     f"outputs, logits or features)")
            shown = value if re.fullmatch(r"[\w.\[\]]+", value or "-") else f"({value})" if value else "value"
            fix = (f"Store detached values: write {shown}.detach() into {expr}, so that what is read back later is "
                   f"a constant target, not a path into a graph that no longer exists.")
        else:
            cause = (f"`{name}` is carried from one iteration into the next ({line}) still attached to the graph "
                     f"of the iteration before, whose backward() freed it")
            code = re.search(r"`([^`]*)`", line or "")
            lhs, _, rhs = (code.group(1) if code else "").partition("=")
            others = sorted({w for w in re.findall(r"(?<![\w.])([A-Za-z_]\w*)", rhs)
                             if w != expr and not w.startswith(("torch", "F")) and w not in ("self", "detach")})
            # (arithmetic only, torch's math included, `q * torch.exp(eta * gloss)` in group DRO: a call of anything
            # else, `h = cell(x, h)`, is a recurrence whose step output must keep its graph)
            calls = re.findall(r"(?<![\w.])([A-Za-z_][\w.]*)\s*\(", rhs)
            math_only = all(c.startswith(("torch.", "F.", "math.", expr + ".")) for c in calls)
            if how != "tuple" and lhs.strip() == expr and rhs.strip() and others and math_only \
                    and not _weights_among(exc, others):
                # the update mixes in other tensors (an ensemble of this epoch's outputs, `ep`): detaching the old
                # value alone leaves their graphs in the new one
                fix = (f"Detach the carried value as it is computed: {expr} = ({rhs.strip()}).detach(), so that "
                       f"neither the old value nor {', '.join(f'`{o}`' for o in others[:3])} brings an earlier "
                       f"iteration's graph into the next step (where those are filled from the model's outputs, "
                       f"store them detached: out.detach()).")
            else:
                fix = ("Detach it where it is carried over: "
                       + (f"{expr} = tuple(s.detach() for s in {expr}) (an LSTM's (h, c))" if how == "tuple"
                          else f"{expr} = {expr}.detach()")
                       + " (truncated backpropagation through time), so that each backward() ends at its own step's "
                         "start.")
        return name, cause, fix, {"holder": name, **({"carried_at": line} if line else {})}

    def _reshaped_leaf(self, got: str, expected: str) -> Tuple[str, str, str, Dict[str, Any]]:
        """A gradient of one shape for a tensor autograd recorded with another: a parameter whose ``.data`` was
        swapped for a larger tensor (``resize_token_embeddings`` mid-run) while a graph from before is alive."""
        shape = [int(x) for x in got.split(",") if x.strip()]
        name = next((n for n, p in self.g.named_parameters() if list(p.shape) == shape), None)
        what = f"`{name}`" if name else "a parameter"
        cause = (f"backward() made a gradient of shape [{got}] for a tensor autograd recorded as [{expected}]: "
                 f"{what} was resized after a graph over its old shape was built (its .data swapped for a larger "
                 f"tensor, as model.resize_token_embeddings(...) does mid-run), and that graph is still alive (the "
                 f"last step's loss kept in a variable keeps autograd's record of the old shape)")
        fix = ("Resize before training starts (and before building the optimizer); if it must happen mid-run, drop "
               "every tensor of the old graph first (del loss, outputs) and build the optimizer again after (its "
               "state has the old size too).")
        return name or "backward", cause, fix, {"gradient_shape": shape,
                                                "recorded_shape": [int(x) for x in expected.split(",") if x.strip()]}

    def _stale_state(self, exc: BaseException, text: str) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """A size or dtype mismatch inside ``optimizer.step()`` between a parameter and the state the optimizer
        made for it: a parameter resized after that (``resize_token_embeddings`` swaps the embedding's ``.data``
        for a larger one, keeping the Parameter), saved state loaded by position into parameters of another
        order, or a model converted to another dtype (``model.double()``) with the optimizer kept."""
        sized = any(t in text for t in _SIZE_TEXTS + ("size mismatch", "shape mismatch", "match the broadcast shape"))
        typed = "dtype" in text
        if not (sized or typed):
            return None
        opt = None
        tb = exc.__traceback__
        while tb is not None:  # the optimizer whose step() raised
            me = tb.tb_frame.f_locals.get("self")
            if isinstance(me, torch.optim.Optimizer):
                opt = me
            tb = tb.tb_next
        if opt is None:
            return None
        oname = type(opt).__name__
        params = [p for group in opt.param_groups for p in group["params"]]
        for p in params:
            for key, v in opt.state.get(p, {}).items():
                if key not in _FULL_STATES or not isinstance(v, torch.Tensor) or not v.dim():
                    continue
                name = self.g.param_name(p)
                if name.startswith("param_groups["):  # in no model: the user's variable names it better (`W_enc`)
                    name = variable_naming(p) or _traceback_variable(exc, p) or name
                details = {"optimizer": oname, "state": key, "state_shape": list(v.shape),
                           "param_shape": list(p.shape)}
                if sized and v.shape != p.shape:
                    other = next((q for q in params if q is not p and q.shape == v.shape), None)
                    if other is not None:
                        oname2 = self.g.param_name(other)
                        whose = f" (`{oname2}`)" if oname2 and oname2 != name else ""
                        cause = (f"{oname}'s state for `{name}` ({key}: {list(v.shape)}) does not fit the parameter "
                                 f"({list(p.shape)}) but fits another one's{whose}: "
                                 f"optimizer.load_state_dict() matches the saved state to the parameters by their "
                                 f"position, and the model's parameters are in another order than when it was saved "
                                 f"(a layer inserted or moved since), so the moments landed on other parameters")
                        fix = ("Load an optimizer's state only into an optimizer over the same parameters in the same "
                               "order; after changing the model, start the optimizer fresh, or move each parameter's "
                               "state by name.")
                        pruned = [n for n in (self.g.param_name(q) for q in params) if n.endswith("_orig")]
                        if pruned:
                            # prune re-registers `weight` as `weight_orig` after the module's other parameters
                            cause += (f"; torch.nn.utils.prune re-registers a pruned tensor as `<name>_orig` last among "
                                      f"its module's parameters ({', '.join(pruned[:3])}), so an optimizer built before "
                                      f"pruning lists them in another order than one built after")
                            fix = ("Build both optimizers over the same structure: prune (prune.identity for the "
                                   "resumed model) before creating the optimizer whose state is saved, or save after "
                                   "prune.remove(); otherwise start the optimizer fresh.")
                            details = {**details, "pruned": pruned[:10]}
                        return name, cause, fix, {**details, "loaded_by_position": True}
                    if v.dim() == p.dim() and v.shape[1:] == p.shape[1:]:
                        # rows added or removed (points densified or pruned, as 3D Gaussian splatting does; a
                        # vocabulary grown) with the moments left as they were
                        cause = (f"{oname}'s state for `{name}` ({key}: {list(v.shape)}) no longer matches the "
                                 f"parameter ({list(p.shape)}): its rows were pruned or added after {oname} made its "
                                 f"state (points densified or pruned, model.resize_token_embeddings(...)) and the "
                                 f"moments were not changed with them, or the state was loaded from the checkpoint "
                                 f"of a model of other sizes ({oname.lower()}.load_state_dict of another run)")
                        fix = (f"If the state was loaded, load the optimizer state saved with this model (or start "
                               f"the optimizer fresh). Otherwise resize before building the optimizer, or build a new "
                               f"one after resizing; to keep "
                               f"the moments, change their rows with the parameter's: for each state tensor of "
                               f"`{name}`, state[k] = state[k][keep] when pruning, torch.cat([state[k], "
                               f"torch.zeros_like(new_rows)]) when adding rows, under the new parameter (or del "
                               f"optimizer.state[param] to restart its moments).")
                        return name, cause, fix, {**details, "rows_changed": True}
                    if v.dim() == p.dim() and v.shape[0] == p.shape[0]:
                        # columns added or removed (a sparse autoencoder's dictionary grown, a layer widened)
                        cause = (f"{oname}'s state for `{name}` ({key}: {list(v.shape)}) no longer matches the "
                                 f"parameter ({list(p.shape)}): its columns were added or removed after {oname} "
                                 f"made its state (a dictionary grown, a layer widened, its .data replaced) and "
                                 f"the moments were not changed with them, or the state was loaded from the "
                                 f"checkpoint of a model of other sizes")
                        fix = (f"If the state was loaded, load the optimizer state saved with this model (or start "
                               f"the optimizer fresh). Otherwise build a new optimizer after resizing, or change the "
                               f"moments with the parameter: for "
                               f"each state tensor of `{name}`, torch.cat([state[k], torch.zeros_like(new_columns)], "
                               f"dim=1) when adding columns (state[k][:, keep] when removing them), or del "
                               f"optimizer.state[param] to restart its moments.")
                        return name, cause, fix, {**details, "columns_changed": True}
                    cause = (f"{oname}'s state for `{name}` ({key}: {list(v.shape)}) no longer matches the "
                             f"parameter ({list(p.shape)}): it was resized after {oname} made its state "
                             f"(model.resize_token_embeddings(...) after training started, or its .data replaced "
                             f"by a tensor of another shape); the optimizer keeps the old-sized moments")
                    fix = (f"Resize before building the optimizer, or build a new one after resizing; to keep the "
                           f"other parameters' moments, drop the resized one's: del optimizer.state[param] (for "
                           f"`{name}`) after resizing.")
                    return name, cause, fix, details
                if typed and v.dtype != p.dtype and v.is_floating_point() and p.is_floating_point():
                    cause = (f"{oname}'s state for `{name}` ({key}) is {v.dtype} but the parameter is now {p.dtype}: "
                             f"the model was converted (model.double(), .half(), .to(dtype)) after {oname} made its "
                             f"state, and the optimizer keeps its moments in the old dtype")
                    fix = ("Convert the model before building the optimizer, or build a new one after converting "
                           "(load its state_dict again to keep the moments: load_state_dict casts them to the "
                           "parameters' dtype); for mixed precision, torch.autocast keeps the parameters as they are.")
                    return name, cause, fix, {**details, "state_dtype": str(v.dtype), "param_dtype": str(p.dtype)}
        return None

    def _loss_sizes(self, exc: BaseException, text: str) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """An element-wise loss (MSE, L1, BCE) whose input and target cannot be paired: class indices or a
        one-hot target of the wrong width, most of the time."""
        if not any(t in text for t in _SIZE_TEXTS):
            return None
        fn, x, t = None, None, None
        tb = exc.__traceback__
        while tb is not None:  # the innermost call of such a loss: its own arguments
            code = tb.tb_frame.f_code
            if code.co_name in _PAIRED_LOSSES and is_skipped(code.co_filename):
                local = tb.tb_frame.f_locals
                fn, x, t = code.co_name, local.get("input"), local.get("target")
            tb = tb.tb_next
        if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
            return None
        xs, ts = list(x.shape), list(t.shape)
        details = {"loss": fn, "input_shape": xs, "target_shape": ts}
        if len(xs) >= 2 and ts == xs[:-1] and xs[-1] == 1:
            cause = (f"{fn}() got input {xs} and target {ts}: the prediction has a trailing dimension of 1 the target "
                     f"lacks (a model whose last layer is Linear(..., 1))")
            fix = ("Give both the same shape: pred.squeeze(-1) (or target.unsqueeze(-1)); inside a loss that would "
                   "accept them, such shapes broadcast to every prediction-target pair instead.")
        elif len(xs) >= 2 and ts == xs[:-1]:
            c = xs[-1]
            cause = (f"{fn}() got input {xs} and target {ts}: one target per sample for {c} outputs each, which "
                     f"looks like class indices; an element-wise loss needs one target per output")
            fix = (f"For classification use F.cross_entropy(logits, target.long()) (it takes class indices); to "
                   f"keep {fn}, give it one-hot targets: F.one_hot(target.long(), {c}).float().")
        elif len(xs) == len(ts) >= 2 and xs[:-1] == ts[:-1] and not _one_hot_like(t):
            c, k = xs[-1], ts[-1]
            cause = (f"{fn}() got input {xs} and target {ts}: {k} target columns for {c} outputs, and the target "
                     f"holds values other than 0 and 1 (no one-hot labels): another tensor of the step is passed as "
                     f"the target, or the arguments are in another order than the loss expects")
            fix = (f"Check what reaches {fn}(input, target): a reconstruction loss compares the output with the "
                   f"input it reconstructs ({fn}(recon, x), not the latent mean); a loss function of your own "
                   f"called with *model(x) takes the model's outputs in their order.")
            details["target_one_hot"] = False
        elif len(xs) == len(ts) >= 2 and xs[:-1] == ts[:-1]:
            c, k = xs[-1], ts[-1]
            cause = (f"{fn}() got input {xs} and target {ts}: {k} target columns for {c} outputs (F.one_hot(y) "
                     f"without num_classes makes max(y) + 1 columns, as many as this batch's largest label needs)")
            fix = f"Pass the number of classes: F.one_hot(y, num_classes={c}).float(), or make the output {k} wide."
        elif (xs == [] and ts in ([1], [1, 1])) or (ts == [] and xs in ([1], [1, 1])):
            # a batch of one sample: a bare .squeeze() drops the batch dimension with the trailing 1 (the last
            # batch of a DataLoader without drop_last, or a batch size of 1)
            cause = (f"{fn}() got input {xs} and target {ts}: a batch of one sample, whose batch dimension a bare "
                     f".squeeze() removed along with the size-1 output dimension")
            fix = ("Squeeze only the output dimension: pred.squeeze(-1) (or pred.view(-1)), never a bare .squeeze(), "
                   "which also drops the batch dimension when a batch holds one sample (the last batch of a "
                   "DataLoader, batch_size=1).")
            details["batch_of_one"] = True
        else:
            cause = f"{fn}() got input {xs} and target {ts}, which cannot be paired element by element"
            fix = "Give input and target the same shape (target.view_as(input) when they hold as many values)."
        return "loss", cause, fix, details

    def _beginner_loss(self, exc: BaseException, text: str) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """Three errors of a classification loss misused, whose PyTorch messages name neither cause nor fix."""
        if isinstance(exc, RuntimeError) and "all elements of input should be between 0 and 1" in text:
            cause = ("binary_cross_entropy (nn.BCELoss) got values outside [0, 1]: it takes probabilities, and "
                     "these are most often logits (a last Linear with no sigmoid)")
            fix = ("Use nn.BCEWithLogitsLoss (F.binary_cross_entropy_with_logits) on the logits: it applies the "
                   "sigmoid itself, in a numerically stable way; keep torch.sigmoid(logits) for predictions only.")
            return "loss", cause, fix, {"loss": "binary_cross_entropy", "logits_given": True}
        if isinstance(exc, RuntimeError) and ("unscale_() is being called after step()" in text or
                                              "has already been called" in text and "since the last update()" in text):
            # the scaler's per-optimizer state (unscaled, stepped) is reset only by update(): without it, the next
            # step's unscale_() or step() finds the last step's state
            if "after step()" in text:
                called, what = "unscale_", "ran after scaler.step(optimizer) with no scaler.update() in between"
            elif text.lstrip().startswith("step()"):
                called, what = "step", "ran twice since the last scaler.update()"
            else:
                called, what = "unscale_", ("ran twice since the last scaler.update(): update() is missing after "
                                            "step(), or unscale_() is called twice in one iteration")
            cause = f"GradScaler.{called}(optimizer) {what}; the scaler's record of each optimizer is reset only by update()"
            fix = ("Call scaler.update() once per iteration, after scaler.step(optimizer) for every optimizer: "
                   "scaler.scale(loss).backward(); scaler.unscale_(opt) (only to clip); scaler.step(opt); "
                   "scaler.update(). Without update() the scale never adapts either.")
            return "GradScaler", cause, fix, {"missing_update": True, "call": called}
        m = re.search(r"Expected floating point type for target with class probabilities, got (\w+)", text)
        if isinstance(exc, RuntimeError) and m:
            got = m.group(1)
            cause = (f"cross_entropy got a target of the input's shape, read as class probabilities, but of type "
                     f"{got}: one-hot labels built as integers (F.one_hot returns int64)")
            fix = ("Pass the class indices instead, loss_fn(logits, y) with y of shape [N] (y = onehot.argmax(1)), or "
                   "make the one-hot targets float: F.one_hot(y, C).float().")
            return "loss", cause, fix, {"loss": "cross_entropy", "target_dtype": got, "one_hot_integers": True}
        m = re.search(r"Expected input batch_size \((\d+)\) to match target batch_size \((\d+)\)", text)
        if isinstance(exc, ValueError) and m:
            n_in, n_t = int(m.group(1)), int(m.group(2))
            cause = f"the loss got {n_in} predictions for {n_t} targets"
            linear = any(isinstance(m, nn.Linear) for r in self.g.roots for m in r.modules())
            if n_t and n_in % n_t == 0 and n_in > n_t and not linear:
                # no Linear to flatten for (a UNet, a fully convolutional net): the batch grew inside the forward
                cause += (f": the model's output holds {n_in // n_t}x its input's samples, and it has no Linear whose "
                          f"input a reshape could have merged: something in its forward joins tensors along the "
                          f"batch dimension (torch.cat([up, skip], 0) for a skip connection, torch.stack then view)")
                fix = ("Concatenate skip connections along the channels: torch.cat([up, skip], dim=1) (dim 0 is the "
                       "batch); check every torch.cat/stack in forward for its dim.")
            elif n_t and n_in % n_t == 0 and n_in > n_t:
                cause += (f": {n_in // n_t} rows per sample, a reshape that merged the batch dimension with another "
                          f"(x.view(-1, k) with the wrong k before a Linear, or logits of a sequence model not "
                          f"flattened like their targets)")
                fix = ("Flatten keeping the batch: x.view(x.size(0), -1) (or torch.flatten(x, 1)) before the first "
                       "Linear, and size that Linear's in_features from it; for per-token logits flatten both: "
                       "loss_fn(logits.view(-1, C), targets.view(-1)).")
            elif n_in and n_t % n_in == 0 and n_t > n_in:
                cause += ": the targets hold several labels per prediction (sequence targets not flattened, or a " \
                         "reshape that merged samples into one row)"
                fix = ("Flatten predictions and targets alike (loss_fn(logits.view(-1, C), y.view(-1))), or flatten "
                       "the input keeping the batch: x.view(x.size(0), -1).")
            else:
                fix = ("Give the loss one prediction per target: check the reshape before the model's first Linear "
                       "(x.view(x.size(0), -1)), and that the targets come from the same batch.")
            return "loss", cause, fix, {"input_batch": n_in, "target_batch": n_t}
        return None

    def _channels(self, text: str, module: Optional[str], exc: Optional[BaseException] = None
                  ) -> Optional[Tuple[str, str, str, Dict[str, Any]]]:
        """A convolution got another number of channels than it has: often an (H, W, C) image."""
        m = _CHANNELS_RE.search(text)
        if not m:
            return None
        shape = [int(v) for v in m.group(2).split(",")]
        want, got = int(m.group(3)), int(m.group(4))
        where = module or "conv"
        name = f"`{module}`{self._mtype(module)}" if module else "a convolution"
        details = {"input_shape": shape, "expected_channels": want, "got_channels": got}
        if shape and shape[-1] == want:
            cause = (f"{name} expects channels first (N, C, H, W) with C = {want}, but its input {shape} has {want} in "
                     f"its last dimension: a channels-last image (H, W, C from PIL, OpenCV or NumPy)")
            fix = ("Move the channels to dim 1: x = x.permute(0, 3, 1, 2) for a batch (N, H, W, C); for one image "
                   "torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0) (or torchvision's ToTensor(), which does it).")
            return where, cause, fix, dict(details, channels_last=True)
        args = self._innermost(exc)[2] if exc is not None else ()
        given_dim = args[0].dim() if args and isinstance(args[0], torch.Tensor) else None
        if shape and shape[0] == 1 and len(shape) in (4, 5) and given_dim == len(shape) - 1:
            # torch's own unsqueeze of an unbatched input: the user's tensor had one dimension less, its batch taken
            # for the channels (a grayscale batch [N, H, W] into Conv2d(1, ...))
            given = shape[1:]
            cause = (f"{name} has {want} input channel(s) but got a {len(given)}-D input {given}, which a convolution "
                     f"takes as one unbatched sample: its first dimension ({got}) was read as the channels, so the "
                     f"batch of {got} samples is missing its channel dimension (a grayscale batch [N, H, W])")
            fix = ("Add the channel dimension: x.unsqueeze(1) for a batch of single-channel images ([N, H, W] -> "
                   "[N, 1, H, W]; [N, D, H, W] -> [N, 1, D, H, W] for Conv3d), usually in the Dataset or collate.")
            return where, cause, fix, dict(details, channels_last=False, unbatched=True)
        cause = f"{name} has {want} input channels but its input {shape} has {got} in dim 1"
        fix = ("Make in_channels match what reaches the layer (the previous layer's out_channels), or fix the "
               "input: grayscale vs RGB (x.repeat(1, 3, 1, 1), img.convert('RGB')), or a missing/extra dimension.")
        return where, cause, fix, dict(details, channels_last=False)

    def _oom(self, exc: BaseException, module: Optional[str]) -> Tuple[str, str, str, Dict[str, Any]]:
        names: Dict[int, str] = {}
        tensors: List[Tuple[str, torch.Tensor]] = []
        try:
            for n, p in self.g.named_parameters():
                tensors.append((n, p))
                if p.is_leaf and p.grad is not None:
                    tensors.append((n + ".grad", p.grad))
            for o in self.g.optimizers:
                for p, st in o.state.items():
                    pn = self.g.param_name(p)
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            tensors.append((f"optimizer state {pn}[{k}]", v))
            for n, t in tensors:
                names.setdefault(id(t), n)
            plain = (torch.Tensor, nn.Parameter)
            for obj in gc.get_objects():  # once, at the failure: other live tensors (activations kept, caches)
                if type(obj) in plain and id(obj) not in names:
                    tensors.append(("tensor", obj))
        except Exception:
            pass
        seen, big = set(), []
        for n, t in tensors:
            try:
                if t.device.type == "meta" or t.is_sparse:
                    continue
                key = (t.device, t.untyped_storage().data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                big.append((t.untyped_storage().nbytes(), n, list(t.shape), str(t.dtype), str(t.device)))
            except Exception:
                continue
        big.sort(key=lambda b: -b[0])
        top = [{"name": n, "shape": s, "dtype": d, "device": dev, "bytes": b} for b, n, s, d, dev in big[:_TOP_TENSORS]]
        bs = self._batch[0] if self._batch else None
        listed = ", ".join(f"{t['name']} {t['shape']} {_mib(t['bytes'])}" for t in top[:3])
        asked = _requested_bytes(str(exc))
        live = sum(b[0] for b in big)
        where = module or "memory"
        fix = ("Lower the batch size (accumulate gradients over several smaller batches to keep the effective "
               "size), use mixed precision (torch.autocast with bfloat16/float16), gradient checkpointing "
               "(torch.utils.checkpoint), run evaluation under torch.no_grad(), and do not keep graphs alive "
               "across steps (total_loss += loss.item()).")
        cause = ("out of memory" + (f" in `{module}`{self._mtype(module)}" if module else "")
                 + (f" with batch size {bs} (input {self._batch})" if bs is not None else "")
                 + (f"; the allocation that failed asked for {_mib(asked)}, all live tensors together hold "
                    f"{_mib(live)}" if asked is not None else "")
                 + (f"; largest live tensors: {listed}" if listed else ""))
        if asked is not None and asked > 4 * max(live, 1):
            # One operation asking for far more than everything alive: its shapes are the first suspect (an
            # attention matrix over H*W positions, a broadcast that multiplies two large dimensions).
            fix = ("One operation asked for more than everything alive: look at the shapes inside "
                   + (f"`{module}`" if module else "the failing operation")
                   + " first - a matrix over all pairs of positions (attention over H*W pixels or a long sequence: "
                     "downsample first, or attend in windows/chunks), or a broadcast between [N, 1] and [1, N] "
                     "tensors. " + fix)
        return where, cause, fix, {"batch_shape": self._batch, "largest_tensors": top, "requested_bytes": asked,
                                   "live_bytes": live}


def _local_of(exc: BaseException, functions: Tuple[str, ...], name: str) -> Any:
    """The value of `name` in the innermost frame of the exception's traceback that runs one of `functions`
    (the failing call's own argument: `target` of `F.cross_entropy`), or None."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in functions:
            found = tb.tb_frame.f_locals.get(name, found)
        tb = tb.tb_next
    return found


def _fractional(t: Any) -> bool:
    """Whether a floating tensor holds values that are not whole numbers (read on the error path only)."""
    try:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_meta or t.numel() == 0:
            return False
        t = t.detach()
        return bool((t != t.round()).any())
    except Exception:
        return False


def _few(t: torch.Tensor) -> str:
    vals = [round(float(v), 3) for v in t.detach().reshape(-1)[:4].cpu()]
    return ", ".join(map(str, vals)) + (", ..." if t.numel() > 4 else "")


def _weights_among(exc: BaseException, names: List[str]) -> bool:
    """Whether any of `names`, in the user's frames of the exception's traceback, is a weight (a parameter, a module,
    a leaf tensor that requires grad): `h = torch.tanh(h @ W + x)` is a recurrence written by hand, whose steps
    must keep their graph; group DRO's `q * torch.exp(eta * gloss)` mixes in a loss."""
    tb = exc.__traceback__
    while tb is not None:
        scope = tb.tb_frame.f_locals
        for n in names:
            v = scope.get(n, tb.tb_frame.f_globals.get(n))
            if isinstance(v, torch.nn.Module) or (isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad):
                return True
        tb = tb.tb_next
    return False
