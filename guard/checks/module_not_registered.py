"""Submodules kept in a plain ``list``/``dict``/``tuple`` attribute instead of ``nn.ModuleList``/``nn.ModuleDict``.

``self.hidden = [nn.Linear(32, 32) for _ in range(3)]`` runs in ``forward`` and its
weights get gradients, yet ``model.parameters()``, ``.to(device)``, ``state_dict()``
and an optimizer built from ``model.parameters()`` all miss them: they never train
and are not saved.

Found from the model's attributes: at the first call of each root model (model and
global mode alike), every registered module's ``__dict__`` is searched for plain
containers (nested up to `DEPTH` levels) holding ``nn.Module`` objects that are not
registered anywhere in that model. A module shared on purpose with a registered
parent is registered, so it does not count; lists of functions or tensors hold no
modules. To leave deliberate hiding alone (a frozen teacher kept in a list so that
``state_dict()`` skips it), the finding needs evidence that the hidden modules are
trained: at an optimizer step, one of their parameters holds a gradient and is in no
optimizer (the silent bug: it is never updated).

Also a module with trainable parameters constructed inside a watched module's
``forward`` (``gate = nn.Linear(16, 16)`` as a local variable) on two different
steps at the same line: a fresh, randomly initialised layer at every call, which
no optimizer holds and nothing saves. Seen through a declared patch of
``nn.Module.__init__``: a construction looks up the stack for a watched module's
call (only then: constructions outside a forward cost one frame walk and nothing
more); lazily built layers assigned to ``self`` (registered) are left alone.

Cost: one attribute walk per root model (once); at each optimizer step, until found,
a ``p.grad is None`` test of the few candidate parameters. Nothing per module call,
no device values.
"""
from __future__ import annotations

import re
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._frames import is_skipped, short_path as _short, source_match
from .base import Check

DEPTH = 3  # nesting of plain containers searched (list of lists, dict of lists, ...)
_CALL_IMPL = nn.Module._call_impl.__code__
MAX_UP = 64  # frames looked at above a module construction for a module call
MADE_STEPS = 2  # steps at which one line constructed unregistered layers, before it is reported
MAX_ITEMS = 10_000
_SKIP_ATTRS = frozenset(("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set",
                         "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                         "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                         "_state_dict_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                         "_forward_hooks_always_called"))


def _modules_in(value: Any, depth: int = 0) -> List[nn.Module]:
    """The nn.Module objects inside plain list/tuple/dict `value` (nested up to DEPTH)."""
    if depth >= DEPTH:
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = list(value)
    else:
        return []
    out: List[nn.Module] = []
    for v in items[:MAX_ITEMS]:
        if isinstance(v, nn.Module):
            out.append(v)
        elif isinstance(v, (list, tuple, dict)):
            out.extend(_modules_in(v, depth + 1))
    return out


def _assignment_source(owner: type, attr: str) -> Optional[str]:
    """``file:line`` of ``self.<attr> = ...`` in the owner class's source (its __init__ usually), if found."""
    pat = re.compile(rf"\bself\.{re.escape(attr)}\s*(?::[^=]*)?=(?!=)")
    for cls in owner.__mro__:
        if cls.__module__.startswith("torch."):
            break
        hit = source_match(cls, lambda text: pat.search(text) is not None
                           and not re.search(r"Module(List|Dict)\(|Sequential\(", text))
        if hit is not None:
            return hit
    return None


def _container(value: Any) -> str:
    return "dict" if isinstance(value, dict) else "tuple" if isinstance(value, tuple) else "list"


class _Candidate:
    __slots__ = ("where", "container", "types", "n_modules", "params", "n_params", "source", "owner")

    def __init__(self, where: str, container: str, mods: List[nn.Module], owner: type):
        self.where, self.container = where, container
        self.owner = owner.__name__  # the class whose __init__ should register them (not always the model's)
        self.source = _assignment_source(owner, where.rsplit(".", 1)[-1])
        self.types = list(dict.fromkeys(type(m).__name__ for m in mods))
        self.n_modules = len(mods)
        ps = list({id(p): p for m in mods for p in m.parameters()}.values())
        self.params = [weakref.ref(p) for p in ps if p.requires_grad]
        self.n_params = sum(p.numel() for p in ps)


def scan(root: nn.Module, root_path: str) -> List[_Candidate]:
    """Plain-container attributes of `root`'s modules that hold modules `root` does not register."""
    registered = {id(m) for m in root.modules()}
    found: List[_Candidate] = []
    for path, mod in root.named_modules():
        for attr, value in vars(mod).items():
            if attr in _SKIP_ATTRS or not isinstance(value, (list, tuple, dict)):
                continue
            mods = [m for m in _modules_in(value) if id(m) not in registered]
            if not mods:
                continue
            mods = list({id(m): m for m in mods}.values())
            where = f"{path}.{attr}" if path else attr
            found.append(_Candidate(where, _container(value), mods, type(mod)))
    return found


class ModuleNotRegistered(Check):
    name = "module-not-registered"
    kinds = {"module-not-registered": ("error", "submodules kept in a plain list/dict/tuple attribute are missed by "
                                                 "parameters(), .to(), state_dict()")}
    description = "modules in a plain list/dict/tuple attribute (not nn.ModuleList/ModuleDict): never trained or saved"

    patches = {"module_init": "torch.nn.Module.__init__"}

    def watches(self, module) -> bool:
        return False  # root model calls only

    def __init__(self, guard):
        super().__init__(guard)
        self._scanned: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._cands: Dict[int, Tuple[weakref.ref, List[_Candidate]]] = {}
        # modules constructed inside a watched module's forward, held until that model call ends (a local
        # `gate = nn.Linear(...)` dies with the forward): (module, owner path, line, step)
        self._made: List[Tuple[nn.Module, str, Optional[str], int]] = []
        self._made_lines: Dict[Optional[str], set] = {}  # line -> steps it made unregistered layers
        self._made_told: set = set()

    def on_module_init(self, args, kwargs):
        if not args or len(self._made) >= 64:
            return
        me = args[0]
        f, below = sys._getframe(1), None
        for _ in range(MAX_UP):
            if f is None:
                return
            code = f.f_code
            if code is _CALL_IMPL:
                owner = f.f_locals.get("self")
                path = self.g.known_path(owner) if owner is not None else None
                if path is None or below is None:
                    return  # constructed in an unwatched module's forward (or none)
                # the forward's line that builds it (through a helper or a class of the user's own, too)
                line = f"{_short(below.f_code.co_filename)}:{below.f_lineno}"
                self._made.append((me, path, line, self.g.step))
                return
            if code.co_name == "__init__" and isinstance(f.f_locals.get("self"), nn.Module) and f.f_locals.get("self") is not me:
                return  # a part of a module under construction (nn.Linear inside a Gate): the Gate counts
            if not is_skipped(code.co_filename):
                below = f  # the outermost frame of the user's below the module call: its forward
            f = f.f_back

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if self._made and is_root:
            self._judge_made()
        if not is_root or module in self._scanned:
            return
        self._scanned.add(module)
        cands = scan(module, "")
        if cands:
            for c in cands:
                c.source = c.source or self.g.root_source
            self._cands[id(module)] = (weakref.ref(module), cands)

    def on_step_pre(self, optimizer):
        if not self._cands or not self.g.is_primary(optimizer):
            return
        held = None
        for key, (mref, cands) in list(self._cands.items()):
            model = mref()
            if model is None:
                del self._cands[key]
                continue
            keep = []
            for c in cands:
                trained = [p for r in c.params if (p := r()) is not None and p.is_leaf and p.grad is not None]
                if not trained:
                    keep.append(c)
                    continue
                if held is None:
                    held = {id(p) for o in self.g.optimizers for grp in o.param_groups for p in grp["params"]}
                if all(id(p) in held for p in trained):
                    continue  # wired into an optimizer by hand: deliberate, leave it alone
                self._emit(model, c, len([p for p in trained if id(p) not in held]))
            if keep:
                self._cands[key] = (mref, keep)
            else:
                del self._cands[key]

    def _judge_made(self) -> None:
        """Layers built in a forward since the last step: the unregistered ones with trainable parameters."""
        made, self._made = self._made, []
        known = None
        for m, path, line, step in made:
            if line in self._made_told:
                continue
            params = [p for p in m.parameters() if p.requires_grad]
            if not params:
                continue  # a loss module or an activation built per call: nothing to train
            if known is None:
                known = {id(p) for _, p in self.g.named_parameters()}
            if any(id(p) in known for p in params):
                continue  # registered (a lazily built `self.proj = nn.Linear(...)`)
            steps = self._made_lines.setdefault(line, set())
            steps.add(step)
            if len(steps) >= MADE_STEPS:
                self._made_told.add(line)
                self._emit_made(m, path, line, min(steps), sum(p.numel() for p in params))

    def on_exit(self):
        self._made = []  # constructed in a forward that never ended under the guard: let them go

    def _emit_made(self, m: nn.Module, path: str, line: Optional[str], since: int, n: int) -> None:
        t = type(m).__name__
        self.emit("module-not-registered", path,
                  f"a {t} ({n:,} parameters) is constructed inside {path}'s forward ({line}) at every call: each "
                  f"step uses a fresh, randomly initialised layer, which no optimizer holds, nothing trains and "
                  f"state_dict() does not save",
                  f"Create it once in __init__ (self.<name> = {t}(...)) and call that attribute in forward; for a "
                  f"parameter-free operation use torch.nn.functional instead of building a module per call.",
                  step=since, source=line,
                  details={"constructed": t, "parameters": n, "in_forward_of": path, "constructed_at": line})

    def _emit(self, model: nn.Module, c: _Candidate, n_untrained: int) -> None:
        mpath = self.g.path_of(model)
        types = ", ".join(c.types[:4]) + (", ..." if len(c.types) > 4 else "")
        fix = "nn.ModuleDict" if c.container == "dict" else "nn.ModuleList"
        owner = mpath if "." not in c.where else f"{c.owner} ({mpath}.{c.where.rsplit('.', 1)[0]})"
        message = (f"{mpath}.{c.where} is a plain Python {c.container} holding {c.n_modules} module(s) ({types}; "
                   f"{c.n_params:,} parameters) that {owner} does not register: they run in forward and get "
                   f"gradients, but model.parameters(), .to(device), state_dict() and the optimizer miss them, so "
                   f"they are never updated ({n_untrained} parameter tensors with gradients in no optimizer) "
                   f"and not saved")
        attr = c.where.rsplit(".", 1)[-1]
        hint = (f"Use {fix} instead of a plain {c.container} in {c.owner}.__init__: self.{attr} = {fix}(...); then "
                f"parameters() (and an "
                f"optimizer built after it), .to() and state_dict() include them.")
        self.emit("module-not-registered", c.where, message, hint, source=c.source,
                  details={"attribute": c.where, "container": c.container, "modules": c.n_modules,
                           "types": c.types[:20], "parameters": c.n_params, "untrained_tensors": n_untrained,
                           "model": mpath})
