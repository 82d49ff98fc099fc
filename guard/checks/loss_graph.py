"""Retained loss graphs: ``total_loss += loss`` keeps every step's autograd graph alive.

Mechanism (cheap, no object scan per step): at each ``backward()`` the loss's
``grad_fn`` gets a sentinel object in its ``metadata`` dict, and the check keeps
only a weak reference to the sentinel. ``weakref.ref(grad_fn)`` is refused for
built-in nodes, but the metadata dict lives exactly as long as the node, so the
sentinel dies with the graph. In a healthy loop the previous loss is dropped when
``loss`` is rebound, so at most the last step or two stay alive. When marks of
several steps long past are still alive, something holds their graphs.

Only then (once) does the check look for the holder: it reads the locals (and,
failing that, globals) of the user's frames and follows the ``grad_fn`` chains of
tensors, lists, dicts and object attributes found there, stopping at marked
nodes, and names the one that reaches the most old steps (``total_loss``,
``losses[...]``, ``meter.sum``).

Measured (tests/test_loop_checks.py): ``total = total + loss`` grows the process
RSS by about 10 KB per step on a small MLP (graph nodes only; the saved tensors
were freed by ``backward()``, so ``tracemalloc`` does not see it).
"""
from __future__ import annotations

import gc
import io
import linecache
import os
import re
import time
import tokenize
import types
import weakref
from collections import deque
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

from .._frames import frame_locals, short_path
from ._params import WatchedParams, frame_optimizers, module_prefixes
from ._graphs import Budget, fmt_bytes, graph_holders, graph_outputs, graph_size, may_hold_graph, user_frames, walk
from .base import Check

KEY = "guard.loss_graph"
OLD = 2        # a mark this many steps old (or more) belongs to a step that is over
MIN_AGE = 5    # report once the oldest live mark is at least this old ...
MIN_STEPS = 3  # ... and marks of at least this many past steps are alive
PARAM_LOOK = 16  # steps between looks for parameters that carry autograd history
HELD_LOOK_MAX = 512  # the longest wait between looks at the user's variables (the wait doubles from PARAM_LOOK)
MAX_AGE = 1024  # the longest wait between looks when graphs in reference cycles were freed by a collection
MAX_MARKS = 256
DEEP_EVERY = 8  # steps whose whole graph is marked (one walk of its nodes); the others mark the loss only
DEEP_BUDGET = 20_000  # graph nodes visited by one such walk
NODE_BUDGET = 200_000  # graph nodes visited in total while naming the holder
MAX_FRAMES = 12


class _Mark:
    """The sentinel stored in a loss node's ``metadata``; it dies with the node."""

    __slots__ = ("step", "__weakref__")

    def __init__(self, step: int):
        self.step = step


def _user_scopes() -> Tuple[List[Tuple[Any, Dict[str, Any]]], List[Any]]:
    """((frame, names) of the user's frames: their locals, then the innermost three's globals; the frames)."""
    frames = user_frames(MAX_FRAMES)
    scopes = [(fr, frame_locals(fr)) for fr in frames]
    seen_scopes = {id(d) for _, d in scopes}
    for fr in frames[:3]:
        if id(fr.f_globals) not in seen_scopes:
            seen_scopes.add(id(fr.f_globals))
            scopes.append((fr, fr.f_globals))
    return scopes, frames


def _user_modules() -> Iterator[Tuple[str, torch.nn.Module]]:
    """(variable, module) of the modules the user's frames hold, each once (report-time and rare looks only)."""
    seen: Set[int] = set()
    scopes, _ = _user_scopes()
    for _, scope in scopes:
        for name, value in list(scope.items()):
            if isinstance(value, torch.nn.Module) and not name.startswith("_") and id(value) not in seen:
                seen.add(id(value))
                yield name, value


def _torch_object(value: Any) -> bool:
    """An optimizer, a scheduler, a DataLoader, a guard: torch's and guard's own objects other than modules and
    tensors hold no graph a training script stores (an optimizer's state is keyed by its parameters; a guard's
    timeline is long)."""
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return False
    return (getattr(type(value), "__module__", None) or "").startswith(("torch.", "guard."))


def _roots(tensors: Any) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)):
        return [t for t in tensors if isinstance(t, torch.Tensor)]
    return []


class _Walker:
    """Follows ``grad_fn`` chains to the marked loss nodes of past steps (one budget for all walks)."""

    def __init__(self, before: int, key: str, prune: bool = True):
        self.before, self.key = before, key  # marks of steps < before count as "old"
        self.budget = Budget(NODE_BUDGET)
        # Pruned at the first mark: beyond a loss node lies that step's own forward graph. Not pruned (a second
        # look, when the first named nobody): a state carried from step to step (`T = model(T)` kept alive by
        # backward(retain_graph=True)) reaches the earlier steps only through this step's marked nodes.
        self.prune = prune

    def steps_reached(self, t: torch.Tensor, out: Set[int]) -> None:
        def at_mark(node: Any) -> bool:
            try:
                mark = node.metadata.get(self.key)
            except Exception:
                return False
            if mark is not None and mark.step < self.before:
                out.add(mark.step)
            return mark is not None and self.prune

        for _ in walk([t.grad_fn], self.budget, prune=at_mark):
            pass


_HARMLESS = re.compile(r"\.item\(\)|\.detach\(\)|\.tolist\(\)|\bfloat\(")
_UPDATE = r"\s*(\+=|-=|\*=|/=|\.append\(|\.extend\(|\.insert\(|\.appendleft\()"


def _last_part(name: str) -> Tuple[str, str]:
    """The searchable tail of a holder name: ('total_loss', regex) / ('.sum', regex) / ("['loss']", regex)."""
    base = name[:-5] if name.endswith("[...]") else name
    m = re.search(r"(\.\w+|\[[^\]]*\])$", base)
    if m and m.start() > 0:
        tail = m.group(1)
        if tail.startswith("["):
            key = tail[1:-1].strip("'\"")
            return tail, r"\[\s*['\"]?" + re.escape(key) + r"['\"]?\s*\]"
        return tail, r"\." + re.escape(tail[1:]) + r"\b"
    return base, r"(?<![\w.])" + re.escape(base) + r"\b"


_CODE_TEXT: Dict[Tuple[str, int], List[str]] = {}


def _code_lines(filename: str, lines: List[str]) -> List[str]:
    """`lines` with strings and comments blanked out (a docstring that quotes ``total += loss`` is no update)."""
    key = (filename, len(lines))
    hit = _CODE_TEXT.get(key)
    if hit is None:
        out = [list(line) for line in lines]
        try:
            prev = None
            for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
                if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    continue
                quoted = tok.type == tokenize.COMMENT or (
                    tok.type == tokenize.STRING and (prev is None or prev.string != "["))
                prev = tok
                if quoted:  # a string other than a subscript key (`stats["loss"] += loss` is the update)
                    (r0, c0), (r1, c1) = tok.start, tok.end
                    for r in range(r0, r1 + 1):
                        row = out[r - 1]
                        for c in range(c0 if r == r0 else 0, c1 if r == r1 else len(row)):
                            if row[c] != "\n":
                                row[c] = " "
        except (tokenize.TokenError, SyntaxError, IndentationError, IndexError):
            pass
        hit = _CODE_TEXT[key] = ["".join(row) for row in out]
        if len(_CODE_TEXT) > 64:
            _CODE_TEXT.clear()
    return hit


def _search(filename: str, lo: int, hi: int, target: str, only: Optional[Set[int]] = None) -> Optional[int]:
    lines = linecache.getlines(filename)
    if not lines:
        return None
    code = _code_lines(filename, lines)
    upd = re.compile(target + r"(" + _UPDATE + r"|\[[^\]]*\]\s*=(?!=))")  # also `self.x[idx] = x`
    # `self.total = self.total + loss`; also one of several targets, `pred, h = model(x, h)`
    selfref = re.compile(r"^\s*(?:[\w.]+\s*,\s*)*[\w.]*" + target + r"\s*(?:,\s*[\w.]+\s*)*=(?!=)(.*)$")
    best: Optional[int] = None
    for no in range(max(lo, 1), min(hi, len(lines)) + 1):
        if only is not None and no not in only:
            continue  # a line of a function defined inside (a class body's method under a script's top level)
        text = code[no - 1]
        if _HARMLESS.search(text):
            continue  # `total += loss.item()` is the fix, not the holder's update
        if upd.search(text):
            return no
        m = selfref.search(text)
        if m and best is None and re.search(target, m.group(1)):
            best = no  # `avg = 0.9 * avg + 0.1 * loss`
    return best


def _carry_over(holders: list) -> Optional[Tuple[Any, str, str]]:
    """(holder, the variable it is copied from, the copying line) when another holder is bound to the first one by
    a plain `b = a` in its function (`h_prev = h`, fed back as `h = 0.5 * h_prev + ...`): that is the state
    carried into the next iteration, and the line is where it should be detached."""
    a_name, frame = holders[0][0], holders[0][1]
    if not re.fullmatch(r"[A-Za-z_]\w*", a_name):
        return None
    code = frame.f_code
    lo, hi = _code_range(code)
    lines = linecache.getlines(code.co_filename)
    for h in holders[1:]:
        b_name = h[0]
        if not re.fullmatch(r"[A-Za-z_]\w*", b_name):
            continue
        rebind = re.compile(r"^\s*" + re.escape(b_name) + r"\s*=\s*" + re.escape(a_name) + r"\s*(#.*)?$")
        for no in range(max(lo, 1), min(hi, len(lines)) + 1):
            if rebind.match(lines[no - 1]):
                return h, a_name, f"{short_path(code.co_filename)}:{no}"
    return None


def _fed_back(holders: list, line: str) -> Optional[Any]:
    """The holder that the model call's line both passes in and assigns (`pred, level = model(chunk, level)`): the
    state carried into the next call, rather than an output also holding the graph (`pred`)."""
    m = re.match(r"\s*([^=()]+?)\s*=(?!=)(.*)$", line)
    if m is None:
        return None
    lhs, rhs = m.group(1), m.group(2)
    args = rhs[rhs.find("("):] if "(" in rhs else ""
    for h in holders:
        if re.fullmatch(r"[A-Za-z_]\w*", h[0]) and re.search(r"\b" + h[0] + r"\b", lhs) \
                and re.search(r"\b" + h[0] + r"\b", args):
            return h
    return None


def _holds_dicts(frame: Any, name: str) -> bool:
    """Whether the list the user's variable `name` (in `frame`) holds has dicts as entries."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return False
    value = frame_locals(frame).get(name, frame.f_globals.get(name))
    return isinstance(value, list) and bool(value) and isinstance(value[-1], dict)


def _code_range(code: types.CodeType) -> Tuple[int, int]:
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    return code.co_firstlineno, max(lines) if lines else code.co_firstlineno


def _update_source(name: str, frame: Any, parent: Any) -> Optional[str]:
    """``file:line`` where the holder is updated: its frame's function, the file, or the owner's class."""
    _, target = _last_part(name)
    places: List[Tuple[str, int, int, Optional[Set[int]]]] = []
    code = frame.f_code
    lo, hi = _code_range(code)
    places.append((code.co_filename, lo, hi, {ln for _, _, ln in code.co_lines() if ln is not None}))
    if parent is not None and not isinstance(parent, (dict, list, tuple)):
        for fn in vars(type(parent)).values():
            c = getattr(fn, "__code__", None)
            if c is not None:
                places.append((c.co_filename, *_code_range(c), None))
    places.append((code.co_filename, 1, 10 ** 9, None))
    targets = [target]
    base = name[:-5] if name.endswith("[...]") else name
    m = re.match(r"^(.*?)(\w+)\[[^\]]*\]$", base)
    if m:  # `W['0.weight']` written with a variable key (`W[n] = W[n] - ...`): the container's subscript writes
        targets.append(r"(?<!\w)" + re.escape(m.group(2)) + r"\b")  # `_search` asks for a write after it
    for target in targets:
        for filename, lo, hi, only in places:
            no = _search(filename, lo, hi, target, only)
            if no is not None:
                return f"{short_path(filename)}:{no}"
    return f"{short_path(code.co_filename)}:{frame.f_lineno}"


def _parent_modules(roots: List[Any]) -> Dict[str, Any]:
    """{class name: module} of the modules that hold one of `roots` as a submodule (found through the garbage
    collector's referrers of each root and of the `_modules` dict holding it: on the reporting path only)."""
    out: Dict[str, Any] = {}
    for r in roots:
        for mods in gc.get_referrers(r):  # the parent's `_modules` dict
            if type(mods) is not dict:
                continue
            for attrs in gc.get_referrers(mods):  # the parent's instance `__dict__`
                if type(attrs) is not dict or attrs.get("_modules") is not mods:
                    continue
                for owner in gc.get_referrers(attrs):
                    if isinstance(owner, torch.nn.Module) and owner is not r and getattr(owner, "__dict__", None) is attrs:
                        out.setdefault(type(owner).__name__, owner)
    return out


_OPERATOR = re.compile(r"[\s+\-*/@%<>|&]")  # an expression to put in parentheses before `.detach()`


def _appended(line: str) -> Optional[Tuple[str, str]]:
    """(receiver, argument) of the first `x.append(expr)` on `line`, the argument read to its closing parenthesis."""
    m = re.search(r"([A-Za-z_][\w.]*(?:\[[^\]]*\])*)\.append\(", line)
    if m is None:
        return None
    depth, i, top_comma = 1, m.end(), False
    while i < len(line) and depth:
        c = line[i]
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
        top_comma = top_comma or (c == "," and depth == 1)
        i += 1
    arg = line[m.end():i - 1].strip()
    return (m.group(1), arg) if depth == 0 and arg and not top_comma else None


def _line_has(source: str, text: str) -> bool:
    """Whether the line at `source` (``file:line``, the path as shown) holds `text`."""
    path, _, no = source.rpartition(":")
    try:
        return text in linecache.getline(os.path.abspath(path), int(no))
    except (ValueError, OSError):
        return False


def _line_at(source: str) -> str:
    """The text of the line at `source` (``file:line``, the path as shown); empty if unknown."""
    path, _, no = source.rpartition(":")
    try:
        return linecache.getline(os.path.abspath(path), int(no))
    except (ValueError, OSError):
        return ""


def _parent_of(name: str, frame: Any) -> Any:
    """The object owning an attribute holder (`meter` for `meter.sum`, `cy.pool` for `cy.pool.items`)."""
    m = re.match(r"^(\w+)((?:\.\w+)*)\.\w+(?:\[[^\]]*\])?$", name)  # `meter.sum`, `model.losses[...]`, `m.cache[0]`
    if not m:
        return None
    obj = frame_locals(frame).get(m.group(1), frame.f_globals.get(m.group(1)))
    for part in m.group(2).split(".")[1:]:
        d = getattr(obj, "__dict__", None)  # instance attributes only: no property runs
        obj = d.get(part) if isinstance(d, dict) else None
    return obj


class LossGraph(Check):
    name = "loss-graph"
    costly = True  # sampled under a budget: a property of the code (on waking, the next graph is walked whole)
    kinds = {
        "loss-graph-retained": ("error", "autograd graphs of earlier steps stay alive"),
    }
    description = "autograd graphs of earlier steps kept alive (total_loss += loss); names the holder"

    def __init__(self, guard):
        super().__init__(guard)
        self._key = f"{KEY}.{id(self)}"  # per guard: nested guards keep their own marks
        self._marks: List[Tuple[int, weakref.ref]] = []
        self._step_mark: Optional[Tuple[int, weakref.ref]] = None  # (step, its one mark)
        self._call_line: Optional[str] = None  # the last model call's line (`pred, level = model(chunk, level)`)
        self._deep_step = -1  # the last step whose graph was walked and marked
        self._deep_next = False  # walk the next backward's graph whatever its step (woken by a budget)
        self._done = False
        # (weak refs to the inputs, the line) of the last backward(inputs=..., create_graph=True) calls
        self._cg_inputs: Optional[deque] = None
        self._min_age = MIN_AGE  # doubled each time a garbage collection freed the old graphs (`_collected`)
        self._params = WatchedParams(guard)
        self._param_look = 0  # the step of the next look for parameters (and buffers) with autograd history
        # (model, buffer) -> (its grad_fn's sequence number, the step) at the last look
        self._buffer_seq: Dict[Tuple[int, str], Tuple[int, int]] = {}
        self._buffer_seq_old: Dict[Tuple[int, str], Tuple[int, int]] = {}  # the same, one look earlier
        self._params_told = False
        # the loss node's sequence number at each look's backward (autograd numbers its nodes in creation order),
        # with the look's step: the windows that tensors held in the user's variables are tested against
        self._look_seqs: List[Tuple[int, int]] = []
        self._held_look, self._held_wait = PARAM_LOOK, PARAM_LOOK  # the step of the next such look, and the wait

    def _buffer_history(self, step: int) -> None:
        """Registered buffers whose graph reaches back to an earlier look: a tensor with a grad_fn stored in a buffer
        at every step without ``.detach()`` (a replay buffer of samples drawn with ``autograd.grad``, an external
        memory), which keeps every step's graph although no loss is ever back-propagated through it."""
        # Compared with the look before the last one: the graph must span two looks (32 steps), so that a
        # holder the loss-graph rule can name from the user's variables (its deep walks) is named that way first.
        looked, self._buffer_seq_old = self._buffer_seq_old, self._buffer_seq
        self._buffer_seq = {}
        for model in (self.g.models or self.g.roots):
            for name, b in model.named_buffers():
                fn = b.grad_fn if isinstance(b, torch.Tensor) else None
                if fn is None:
                    continue
                key = (id(model), name)
                self._buffer_seq[key] = (fn._sequence_nr(), step)
                before, since = looked.get(key, (None, step))
                if before is None or fn._sequence_nr() <= before:
                    continue
                # Nodes made at or before the earlier look still behind it: the graph spans PARAM_LOOK steps.
                if any(node._sequence_nr() <= before for node in walk([fn], Budget(20_000))):
                    self._report_buffer(model, name, b, since)
                    return

    def _report_buffer(self, model, name: str, b: torch.Tensor, step: int) -> None:
        self._done = True
        label = self.g.path_of(model)
        where = f"{label}.{name}" if label and label != type(model).__name__ else name
        nodes, saved = graph_size([b], limit=20_000)
        mem = f", {fmt_bytes(saved)} of saved tensors" if saved else ""
        message = (f"buffer `{where}` holds an autograd graph that reaches back to step {step} or earlier "
                   f"({nodes} graph nodes{mem}; its grad_fn is {type(b.grad_fn).__name__}): a tensor with a grad_fn "
                   f"is stored in it at every step without .detach() (samples of a replay buffer drawn with "
                   f"autograd, a memory written each step), so every step's graph stays alive although no loss is "
                   f"back-propagated through it, and memory and time grow")
        hint = (f"Store detached values in it (`{name}[idx] = x.detach()`, `self.{name} = new.detach()`) or update "
                f"it under torch.no_grad(); keep the graph only for what this step's loss needs.")
        self.emit("loss-graph-retained", where, message, hint, step=step, source=self.g.source(),
                  details={"buffer": where, "graph_nodes": nodes, "grad_fn": type(b.grad_fn).__name__,
                           "buffer_with_history": True, **({"saved_bytes": saved} if saved else {})})

    def _held_history(self, step: int, tensors: Any) -> None:
        """Tensors held in the user's variables (an object's attribute, a list) whose graph keeps nodes made in each
        of the last two intervals between looks: a tensor with a grad_fn is stored at every step without
        ``.detach()`` (a replay buffer object's ``self.x[idx] = x`` of samples drawn with ``autograd.grad``), so the
        graphs of all steps stay chained, although no backward() ever runs through them (no loss mark is reached).
        Two generations are asked for, not one: a graph built once and reused (a cache refreshed now and then)
        keeps nodes of a single interval only."""
        roots = [t for t in _roots(tensors) if t.grad_fn is not None]
        if not roots:
            return
        seqs = self._look_seqs
        seqs.append((roots[0].grad_fn._sequence_nr(), step))
        if len(seqs) < 4:
            return
        del seqs[:-4]
        (b0, s0), (b1, s1), (b2, _), _ = seqs
        budget = Budget(DEEP_BUDGET)
        for name, frame, ts in self._scan():
            newest = [t for t in ts if t.grad_fn._sequence_nr() > b2]  # stored again since the last look
            if not newest:
                continue
            # nodes made in each interval, and before the first look (the graph reaches back to that step)
            found = {"first": False, "second": False, "older": False}

            def at(node: Any) -> bool:
                seq = node._sequence_nr()
                if seq <= b0:
                    found["older"] = True
                    return True  # its inputs are older still
                found["first" if seq <= b1 else "second" if seq <= b2 else "new"] = True
                return False

            for _ in walk([t.grad_fn for t in newest], budget, prune=at):
                if found["first"] and found["second"] and found["older"]:
                    break
            if found["first"] and found["second"]:
                self._report_held(name, frame, newest, s0 if found["older"] else s1)
                return
            if budget.left <= 0:
                return

    def _scan(self):
        """(name, frame, tensors with a graph) held in the user's frames: locals, and the outer frames' globals."""
        seen_objs: Set[int] = set()
        scopes, _ = _user_scopes()
        for fr, scope in scopes:
            for name, value in list(scope.items()):
                if name.startswith("__") or not may_hold_graph(value) or id(value) in seen_objs or _torch_object(value):
                    continue
                seen_objs.add(id(value))
                try:
                    for cname, _, ts in graph_holders(name, value):
                        # a weight with history (an EMA updated in place with autograd on, still bound to the loop
                        # variable `e`) is the parameter look's to tell, at its module
                        ts = [t for t in ts if not isinstance(t, torch.nn.Parameter)]
                        if ts:
                            yield cname, fr, ts
                except Exception:
                    continue

    def _report_held(self, name: str, frame: Any, ts: List[torch.Tensor], step: int) -> None:
        self._done = True
        base = name[:-5] if name.endswith("[...]") else name
        src = _update_source(name, frame, _parent_of(name, frame))
        nodes, saved = graph_size(ts, limit=20_000)
        mem = f", {fmt_bytes(saved)} of saved tensors" if saved else ""
        op = type(ts[0].grad_fn).__name__
        shapes = sorted({str(list(t.shape)) for t in ts})[:3]
        message = (f"`{name}` ({src}) holds tensors ({', '.join(shapes)}) whose autograd graph reaches back to step "
                   f"{step} or earlier ({nodes} graph nodes{mem}; its grad_fn is {op}): a tensor with a grad_fn is "
                   f"stored in it at every step without .detach() (samples of a replay buffer drawn with autograd, a "
                   f"memory written each step), so every step's graph stays chained to the last one although no "
                   f"loss is back-propagated through it, and memory and time grow")
        said = base  # as the updating line names it (`self.x` in the holder's own methods)
        if "." in base and src and _line_has(src, "self." + base.split(".", 1)[1]):
            said = "self." + base.split(".", 1)[1]
        store = f"`{said}.append(x.detach())`" if name.endswith("[...]") else f"`{said}[idx] = x.detach()`"
        hint = (f"Store detached values ({store}, or `= new.detach()`), or update it under torch.no_grad(); keep the "
                f"graph only for what this step's loss needs.")
        m = re.match(r"^\s*([\w.\[\]'\"]+)\s*=(?!=)(.*)$", _line_at(src) if src else "")
        if m and m.group(1) in m.group(2):
            # updated from itself (a path integral, a running sum of parameter changes `W[n] = W[n] - g * (p - prev)`)
            hint = (f"Compute the update without autograd: `with torch.no_grad(): {m.group(1)} = ...` (or detach "
                    f"what enters it, p.detach()); updated from itself with a grad_fn, it chains every step's graph "
                    f"to the last one.")
        self.emit("loss-graph-retained", base, message, hint, step=step, source=src,
                  details={"holder": name, "holder_source": src, "graph_nodes": nodes, "grad_fn": op,
                           "held_shapes": shapes, "held_with_history": True,
                           **({"saved_bytes": saved} if saved else {})})

    def _param_history(self, step: int) -> None:
        """Parameters with a grad_fn: a frozen weight (a target or EMA network) updated in place with autograd on
        (``tp.mul_(1 - tau).add_(tau * p)`` outside ``torch.no_grad()``) joins the graph, which grows at every
        update and is never freed. Trainable leaves cannot get there (torch refuses in-place ops on them)."""
        # Still an nn.Parameter: updated in place. A plain tensor put in a module's _parameters (a learn2learn or
        # MAML clone adapted as `p - lr * g`, rebuilt every step) carries this step's graph on purpose.
        held = [p for p in self._params() if p.grad_fn is not None and isinstance(p, torch.nn.Parameter)]
        if not held:
            return
        ids = {id(p) for p in held}
        named = self.g.named_parameters()
        names = [n for n, p in named if id(p) in ids]
        own = self._variable_of(held)  # a model your code's variable holds (`teacher`): named by it
        if own is not None:
            var, module = own
            names = [f"{var}.{n}" for n, p in module.named_parameters() if id(p) in ids] or names
            self._report_params(step, held, names, [var])
            return
        self._report_params(step, held, names, module_prefixes(names, [n for n, _ in named], limit=6))

    def _variable_of(self, held: List[torch.Tensor]) -> Optional[Tuple[str, torch.nn.Module]]:
        """(variable, module) of the user's variable bound to a module that holds all of `held` (an EMA teacher
        under a global guard, whose paths alone, `0` and `3`, read like the student's layers); None if none."""
        ids = {id(p) for p in held}
        for name, value in _user_modules():
            mine = {id(p) for _, p in zip(range(4096), value.parameters())}
            if ids <= mine and len(mine) < 4 * len(ids) + 8:  # the module itself, not a model around it
                return name, value
        return None

    def _report_params(self, step: int, held: List[torch.Tensor], names: List[str], prefixes: List[str]) -> None:
        self._params_told = True
        self._param_look = 1 << 62
        nodes, _ = graph_size(held[:1], limit=20_000)
        op = type(held[0].grad_fn).__name__
        shown = ", ".join(prefixes[:5]) + (", ..." if len(prefixes) > 5 else "")
        message = (f"{len(held)} parameter(s) carry autograd history ({shown}; {names[0]}'s grad_fn is {op}, "
                   f"{nodes} graph nodes behind it): weights that need no gradient were updated in place with "
                   f"autograd on (a target or EMA network's `tp.mul_(1 - tau).add_(tau * p)` or `tp.copy_(p)` "
                   f"outside torch.no_grad()), so every update adds to a graph that is never freed")
        hint = ("Update target/EMA weights without autograd: `with torch.no_grad(): tp.lerp_(p, tau)` (or "
                "`tp.mul_(1 - tau).add_(p, alpha=tau)` inside torch.no_grad(), or on .data); "
                "torch.optim.swa_utils.AveragedModel does it for you.")
        self.emit("loss-graph-retained", prefixes[0] if prefixes else names[0], message, hint, step=step,
                  source=self.g.source(), details={"parameters": names[:20], "count": len(held), "grad_fn": op,
                                                   "graph_nodes": nodes, "parameters_with_history": True})

    def _outside_params(self, step: int) -> None:
        """The parameter look for modules guard does not watch, held by the user's variables: an EMA teacher beside
        the student given to guard, updated in place with autograd on (at the user-variable looks: rare)."""
        watched = {id(m) for m in self.g.models}
        for name, value in _user_modules():
            if id(value) in watched:
                continue
            held = [(n, p) for _, (n, p) in zip(range(256), value.named_parameters())
                    if p.grad_fn is not None and isinstance(p, torch.nn.Parameter)]
            if held:
                self._report_params(step, [p for _, p in held], [f"{name}.{n}" for n, _ in held], [name])
                return

    def on_wake(self):
        """Sampled by a budget, the steps it sees are not every DEEP_EVERY-th: walk the next graph whole."""
        self._deep_next = True

    def on_backward(self, tensors, kwargs):
        step = self.g.step
        if kwargs and kwargs.get("create_graph") and kwargs.get("inputs") is not None and not self._done:
            # `E.sum().backward(inputs=[pos], create_graph=True)`: pos.grad will carry a graph that holds pos
            ins = kwargs["inputs"]
            ins = [ins] if isinstance(ins, torch.Tensor) else list(ins)
            if self._cg_inputs is None:
                self._cg_inputs = deque(maxlen=4)
            self._cg_inputs.append(([weakref.ref(t) for t in ins if isinstance(t, torch.Tensor) and t.is_leaf
                                     and not isinstance(t, torch.nn.Parameter)][:4], self.g.source()))
        if step >= self._param_look:
            self._param_look = step + PARAM_LOOK if not self._params_told else 1 << 62
            self._param_history(step)
            if not self._done:
                self._buffer_history(step)
        if step >= self._held_look and not self._done:
            # a scan of the user's variables costs a few hundred microseconds: after the first four looks (which
            # judge a leak from the start by step 64), rarer and rarer
            if len(self._look_seqs) >= 3:
                self._held_wait = min(max(self._held_wait * 2, step + PARAM_LOOK), HELD_LOOK_MAX)
            self._held_look = step + self._held_wait
            if not self._params_told:
                self._outside_params(step)
            self._held_history(step, tensors)
        if self._done:
            return
        alive, old = [], set()
        for s, r in self._marks:
            if r() is not None:
                alive.append((s, r))
                if s <= step - OLD:
                    old.add(s)
        self._marks = alive
        if len(old) >= MIN_STEPS and step - min(old) >= self._min_age and not self._before_first_step():
            if self._collected(step):
                self._done = True
                self._report(step, old)
                return
        mark, _ = self._mark_for(step)
        deep = (step % DEEP_EVERY == 0 or self._deep_next) and self._deep_step != step
        if deep:
            self._deep_step, self._deep_next = step, False
        for t in _roots(tensors):
            fn = t.grad_fn
            if fn is None:
                continue
            md = fn.metadata
            if self._key in md:
                continue  # the same graph back-propagated again (retain_graph=True)
            md[self._key] = mark
            if deep:
                self._mark_deep(fn, mark)
        if len(self._marks) > MAX_MARKS:
            self._marks = self._marks[-MAX_MARKS:]

    def _before_first_step(self) -> bool:
        """Whether steps are still counted by backward() because no optimizer has stepped, while the user's code holds
        one that will (a global guard knows an optimizer from its first step): an iteration's several backwards (a
        per-task backward and an inner solver's, CAGrad's) are then all one step, renumbered to it at that step."""
        primary = self.g.watched.primary
        if primary is not None and primary() is not None and not self.g.watched.stand_in:
            return False
        return bool(frame_optimizers())

    def _collected(self, step: int) -> bool:
        """Whether old marks outlive a garbage collection. Graphs in reference cycles wait for Python's cyclic
        collector, nothing holds them (``TanhTransform(cache_size=1)``'s cache: a SAC actor's action): a
        collection frees them, and the next look waits twice as long (a few ms per look, rarer and rarer)."""
        gc.collect()
        old = [s for s, r in self._marks if r() is not None and s <= step - OLD]
        if len(old) >= MIN_STEPS and step - min(old) >= self._min_age:
            return True
        self._marks = [(s, r) for s, r in self._marks if r() is not None]
        self._min_age = min(self._min_age * 2, MAX_AGE)
        return False

    def _mark_for(self, step: int) -> Tuple[_Mark, bool]:
        """The one mark of `step` (shared by all its marked nodes), and whether it is new."""
        cur = self._step_mark
        mark = cur[1]() if cur is not None and cur[0] == step else None
        if mark is not None:
            return mark, False
        mark = _Mark(step)
        self._step_mark = (step, weakref.ref(mark))
        self._marks.append((step, self._step_mark[1]))
        return mark, True

    def watches(self, module) -> bool:
        return False  # model calls (roots) only

    def on_forward(self, module, path, args, kwargs, output, is_root):
        """Mark the model's outputs: a kept output, or a loss computed from it (scaled or not for
        backward()), keeps them alive. One metadata write per output of a model call."""
        if not is_root or self._done or not torch.is_grad_enabled():
            return
        self._call_line = self.g.root_source  # the model call's line (root_source moves to backward()'s line)
        outs = graph_outputs(output)
        if not outs:
            return
        mark, _ = self._mark_for(self.g.step)
        for t in outs:
            md = t.grad_fn.metadata
            if self._key not in md:
                md[self._key] = mark

    def _mark_deep(self, root: Any, mark: _Mark) -> None:
        """Mark the nodes that use leaves (parameters): every tensor of this step's graph reaches one.

        The loss passed to ``backward()`` is often not the tensor that is kept: ``(loss / accum).backward()``
        with ``total += loss``, a kept output or intermediate. Whichever it is, its ``grad_fn`` chain ends
        at the nodes that consume the parameters, so marks there live exactly as long as any part of the
        step's graph. A node marked by an earlier step is part of this backward (a graph legitimately
        reused, retain_graph=True): it takes this step's mark.
        """
        key = self._key
        seen: Set[int] = set()
        keep: List[Any] = []
        stack = [root]
        budget = DEEP_BUDGET
        while stack and budget > 0:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            budget -= 1
            try:
                nxt = node.next_functions
            except Exception:
                continue
            leafy = False
            for n, _ in nxt:
                if n is None:
                    continue
                if type(n).__name__ == "AccumulateGrad":
                    leafy = True
                elif id(n) not in seen:
                    stack.append(n)
            if leafy or node is root:
                try:
                    md = node.metadata
                    prev = md.get(key)
                    if prev is None or prev.step != mark.step:
                        md[key] = mark
                except Exception:
                    continue

    # ------------------------------------------------------------------ naming the holder
    def _grad_cycle(self) -> Optional[Tuple[str, Optional[str]]]:
        """(the input's name, the backward's line) when an input given to `backward(inputs=..., create_graph=True)`
        still has a .grad that carries a graph: the `pos` <-> `pos.grad` cycle PyTorch warns about, or None."""
        for refs, src in self._cg_inputs or ():
            for r in refs:
                t = r()
                g = t.grad if t is not None else None
                if g is not None and g.grad_fn is not None:
                    m = re.search(r"inputs\s*=\s*\[?\s*([A-Za-z_][\w.]*)", _line_at(src) if src else "")
                    return (m.group(1) if m else "the input"), src
        return None

    def _holders(self, before: int, prune: bool = True, parents: bool = False):
        """(name, frame, steps reached, tensors) for graph holders in the user's frames, best first; with `parents`,
        also the attributes of the modules that hold the watched models (read through the garbage collector)."""
        walker = _Walker(before, self._key, prune)
        found = []
        scopes, frames = _user_scopes()
        if frames:
            # the watched models' own attributes, when no variable of the user's names them (a LightningModule
            # built inside `trainer.fit(Classifier(), ...)` keeps `self.running_loss`)
            scopes.append((frames[-1], {self.g.path_of(m): m for m in self.g.roots}))
            if parents:
                # under a global guard the watched model is the LightningModule's `self.net` (its training_step is no
                # module call): the holder is an attribute of that parent (`self.step_losses.append(loss)`)
                scopes.append((frames[-1], _parent_modules(self.g.roots)))
        seen_objs: Set[int] = set()
        for fr, scope in scopes:
            for name, value in list(scope.items()):
                if name.startswith("__") or id(value) in seen_objs:
                    continue
                seen_objs.add(id(value))
                try:
                    for cname, owner, ts in graph_holders(name, value):
                        steps: Set[int] = set()
                        for t in ts:
                            walker.steps_reached(t, steps)
                        if steps:
                            found.append((cname, fr, steps, ts))
                except Exception:
                    continue
            if found and walker.budget.left <= 0:
                break
        found.sort(key=lambda h: (-len(h[2]), len(h[0])))  # ties: the shortest name (not `meter.me.me.total`)
        return found

    def _report(self, step: int, old: Set[int]) -> None:
        t0 = time.perf_counter()
        since = min(old)
        cycle = self._grad_cycle()
        if cycle is not None:
            # not a variable but a reference cycle: the graphs stay alive until Python's cycle collector runs
            name, src = cycle
            self.emit("loss-graph-retained", name,
                      f"`{name}.grad` carries an autograd graph (it was made by backward(create_graph=True)), and that "
                      f"graph holds `{name}` itself: a reference cycle, so every step's graph stays alive until "
                      f"Python's garbage collector gets to it (graphs of {len(old)} earlier steps, since step {since}, "
                      f"are alive now), as PyTorch's own warning about create_graph says",
                      f"Take the input's gradient with torch.autograd.grad(E.sum(), {name}, create_graph=True)[0], "
                      f"which sets no .grad; or set `{name}.grad = None` right after reading it.",
                      step=since, source=src,
                      details={"steps_alive": len(old), "since_step": since, "detected_at_step": step,
                               "holder": f"{name}.grad", "grad_cycle": True})
            return
        holders = self._holders(step)
        carried = False
        if not holders:
            holders = [h for h in self._holders(step, prune=False) if len(h[2]) >= 2]
            carried = bool(holders)
        if not holders:
            holders = self._holders(step, parents=True)
        scan_ms = (time.perf_counter() - t0) * 1e3
        details: Dict[str, Any] = {"steps_alive": len(old), "since_step": since, "detected_at_step": step,
                                   "scan_ms": round(scan_ms, 2)}
        carry = _carry_over(holders) if len(holders) > 1 else None
        if carry is not None:
            holders = [carry[0]] + [h for h in holders if h is not carry[0]]
            carried = True
        elif carried and len(holders) > 1 and self._call_line:
            fed = _fed_back(holders, _line_at(self._call_line))
            if fed is not None:
                holders = [fed] + [h for h in holders if h is not fed]
        if holders:
            name, frame, steps, ts = holders[0]
            roots = {self.g.path_of(m): m for m in self.g.roots}
            parent = roots.get(name.split(".", 1)[0]) if "." in name else None
            if parent is None:
                parent = _parent_of(name, frame)
            src = _update_source(name, frame, parent)
            n = len(steps)
            nodes, saved = graph_size(ts)
            details.update(holder=name, holder_source=src, steps=n, graph_nodes=nodes,
                           others=[h[0] for h in holders[1:5]])
            mem = ""
            if saved:
                details["saved_bytes"] = saved
                mem = f", {fmt_bytes(saved)} of saved tensors"
            rows = name.endswith("[...][...]")  # a list of rows (a per-epoch matrix of losses)
            base = name[:-10] if rows else name[:-5] if name.endswith("[...]") else name
            said = base  # in the fix: as the updating line names it (`self.total` in the model's own methods)
            bare = re.sub(r"\[[^\]]*\]$", "", base)  # `model.knn_cache` for an entry `model.knn_cache[0]`
            if (parent is not None and not isinstance(parent, (dict, list, tuple)) and "." in bare and src
                    and _line_has(src, "self." + bare.split(".", 1)[1])):
                said = "self." + bare.split(".", 1)[1] + base[len(bare):]
            said_bare = re.sub(r"\[[^\]]*\]$", "", said)
            if rows:
                fix = f"`row.append(loss.item())` for the rows of `{said}`"
            elif name.endswith("[...]"):
                # the appended expression as the line writes it (`hist[name].append(out.abs().mean())` in a forward
                # hook: an activation statistic, not a loss), else `loss`
                app = _appended(_line_at(src)) if src else None
                row = re.search(re.escape(said_bare.rsplit(".", 1)[-1]) + r"\s*\[([^\]]*)\]\s*=(?!=)\s*([A-Za-z_][\w.]*)",
                                _line_at(src)) if src else None
                if row is not None:
                    # a row written in place (`self.prio[i] = e`, a replay buffer's priorities): its value detached
                    fix = f"`{said_bare}[{row.group(1).strip()}] = {row.group(2)}.item()`"
                else:
                    fix = (f"`{app[0]}.append({'(' + app[1] + ')' if _OPERATOR.search(app[1]) else app[1]}.item())`"
                           if app else f"`{said}.append(loss.item())`")
            else:
                fix = f"`{said} += loss.item()`"
            # one step's graph held ("graphs of 1 steps (since step 0" read as a typo)
            span = (f"the autograd graph of step {min(steps)} (" if n == 1 else
                    f"the autograd graphs of {n} steps (since step {min(steps)}; ")
            message = f"`{name}` ({src}) holds {span}{nodes} graph nodes{mem}); use `loss.item()`"
            hint = (f"Accumulate Python numbers, e.g. {fix}, or keep `loss.detach()`; every tensor that still "
                    f"has a grad_fn keeps its whole step's graph alive, so memory and time grow each step.")
            if any(t.numel() > 1 for t in ts):
                # not a loss but features kept across steps (a memory bank, a queue, a cached hidden state)
                shapes = sorted({str(list(t.shape)) for t in ts})[:3]
                details["held_shapes"] = shapes
                message = (f"`{name}` ({src}) holds tensors ({', '.join(shapes)}) that carry {span}{nodes} graph "
                           f"nodes{mem}): features kept across steps without .detach()")
                slot = re.search(re.escape(said_bare.rsplit(".", 1)[-1]) + r"\s*\[([^\]]*)\]\s*=(?!=)",
                                 _line_at(src)) if src else None
                if slot is not None:
                    # rows written in place (`self.cache[i] = e`, a memory bank slot, a dict entry `A[m] = ...` of a
                    # hook's statistics): what is written must be detached
                    value = re.match(r"\s*([A-Za-z_][\w.]*)\s*(?:#.*)?$", _line_at(src)[slot.end():])
                    store = (f"Write detached values: `{said_bare}[{slot.group(1).strip() or 'idx'}] = "
                             f"{value.group(1) if value else 'z'}.detach()`")
                elif name.endswith("[...]"):
                    # the appended expression as the line writes it (`all_outputs.append(outputs)`, a helper's
                    # `videos.append(render_video())`), else `value`; a list of lists holds what each call returned
                    app = _appended(_line_at(src)) if src else None
                    arg = app[1] if app and app[0].rsplit(".", 1)[-1] == said_bare.rsplit(".", 1)[-1] else None
                    if arg is not None and name.endswith("[...][...]"):
                        value = f"[t.detach() for t in {arg}]"
                    elif arg is not None and _holds_dicts(frame, said_bare):
                        value = f"{{k: v.detach() for k, v in {arg}.items()}}"  # a dict per entry (fast weights)
                    elif arg is None:
                        value = "value.detach()"
                    else:
                        value = ("(" + arg + ")" if _OPERATOR.search(arg) else arg) + ".detach()"
                    store = f"Store detached values: `{said}.append({value})`"
                elif type(ts[0].grad_fn).__name__ in ("AddBackward0", "LerpBackward0", "LerpBackward1"):
                    # updated from itself (a running statistic, an EMA): the new value's part must be detached
                    store = ("Detach what enters it, as a running average does: `running = momentum * running + "
                             "(1 - momentum) * x.detach()`")
                else:
                    store = f"Store detached values: `{said} = torch.cat([z.detach(), ...])`"
                hint = (f"{store} (or update it under torch.no_grad()); a kept tensor with a grad_fn holds its "
                        f"step's whole graph alive, so memory and time grow each step.")
            if carried:
                # reached through this step's own graph: a state the loop feeds back (`T = model(T)`), whose
                # backward(retain_graph=True) hid "Trying to backward through the graph a second time"
                details["carried"] = True
                if carry is not None:  # `h_prev = h`: detached where it is carried over
                    src = carry[2]
                    details["holder_source"], details["carried_from"] = src, carry[1]
                message = (f"`{name}` ({src}) is carried from one iteration into the next still attached to the "
                           f"graph: it holds {span}{nodes} graph nodes{mem}), and every backward(retain_graph=True) "
                           f"goes through all of them again")
                said = f"{said} = {carry[1]}.detach()" if carry is not None else f"{said} = {said}.detach()"
                hint = (f"Detach the carried state once per iteration, `{said}` before it is used "
                        f"again (truncated backpropagation through time), and drop retain_graph=True: it only hid "
                        f"the error the second backward through the old steps would raise.")
            # (the entries of a list named as a whole, `hist[0]['w']` beside `hist[...]`, are not other holders)
            others = [h[0] for h in holders[1:] if h[0] != name and not (
                name.endswith("[...]") and h[0].startswith(name[:-5] + "["))][:3]
            if others:
                message += f"; also held by {', '.join(f'`{o}`' for o in others)}"
            where = base
            self.emit("loss-graph-retained", where, message, hint, step=min(steps), source=src, details=details)
            return
        message = (f"the autograd graphs of {len(old)} earlier steps (since step {since}) are still alive; "
                   f"something keeps the loss tensors (e.g. `total_loss += loss` or `losses.append(loss)`), "
                   f"guard could not find which variable")
        hint = ("Log and accumulate `loss.item()` (a Python number) or `loss.detach()` instead of the loss "
                "tensor itself; a tensor with a grad_fn keeps its step's whole graph alive.")
        self.emit("loss-graph-retained", "loss", message, hint, step=since, source=self.g.source(),
                  details=details)
