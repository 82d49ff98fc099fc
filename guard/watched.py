"""What a guard watches: the models, their module paths, parameter names and the module table."""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._frames import CO_OPTIMIZED, frame_locals, is_skipped, variable_naming
from ._modules import tree_stats
from .record import Record
from .tensors import first_tensor
from ._weak import WeakIdMap

MAX_MODULES = 5000
REPLACED = 16  # steps of other optimizers without one of the primary: the primary was replaced
SUCCEEDS = 2  # own steps of an optimizer of all the primary's parameters without the primary: its successor
#: ... or this many in a row, each without a call of a model the primary trains: its model is done (models
#: trained one after another under a global guard), where a GAN's critic steps still call the generator
FINISHED = 8  # above the 5 critic steps per generator step of WGAN (which need not call the generator)
PLAIN_WAIT = 64  # the same for an optimizer over plain tensors only, while the primary holds nn.Parameters

DP_TYPES: Tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def wrapper_types() -> Tuple[type, ...]:
    """Modules that wrap the user's model and hand it out as ``.module``: DataParallel, DDP, and Lightning
    Fabric's ``_FabricModule`` once Fabric is imported (paths and names are the model's own, not
    ``_forward_module.0.weight``)."""
    fab = sys.modules.get("lightning.fabric.wrappers") or sys.modules.get("lightning_fabric.wrappers")
    extra = getattr(fab, "_FabricModule", None) if fab is not None else None
    return DP_TYPES + (extra,) if isinstance(extra, type) else DP_TYPES


def unwrapped_optimizer(opt: torch.optim.Optimizer) -> Optional[torch.optim.Optimizer]:
    """The real optimizer inside a wrapper that subclasses Optimizer without its machinery (accelerate's
    ``AcceleratedOptimizer`` in ``.optimizer``, timm's ``Lookahead`` in ``._base_optimizer``: no step hooks
    of their own; their ``step()`` calls the wrapped one's). None when there is no such optimizer inside."""
    for _ in range(4):
        hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
        if hooks is not None:
            inner = getattr(opt, "optimizer", None)
            if (isinstance(inner, torch.optim.Optimizer) and inner is not opt
                    and getattr(inner, "_optimizer_step_pre_hooks", None) is hooks):
                # Lightning Fabric's FabricSGD: a subclass of SGD whose __dict__ is a copy of the wrapped one's, hook
                # tables included; the hooks fire from the wrapped optimizer's step(), with it as the optimizer
                return inner
            return opt
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = next((v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer) and v is not opt), None)
        if inner is None:
            return None
        opt = inner
    return opt if hasattr(opt, "_optimizer_step_pre_hooks") else None


def held_optimizers(obj: Any) -> Optional[List[torch.optim.Optimizer]]:
    """The optimizers inside a holder that is no Optimizer itself (a ``MultipleOptimizer`` with ``.optimizers``,
    a plain ``Lookahead`` class with ``.optimizer``, apex's ``LARC`` with ``.optim``, or the one optimizer in any
    other attribute): its ``step()`` calls theirs, whose hooks guard watches. None for anything else."""
    if isinstance(obj, torch.optim.Optimizer) or not callable(getattr(obj, "step", None)):
        return None
    many = getattr(obj, "optimizers", None)
    if isinstance(many, (list, tuple)) and many and all(isinstance(o, torch.optim.Optimizer) for o in many):
        return list(many)
    for name in ("optimizer", "base_optimizer", "_optimizer", "inner_optimizer", "optim"):
        inner = getattr(obj, name, None)
        if isinstance(inner, torch.optim.Optimizer):
            return [inner]
    # any other attribute holding exactly one optimizer (apex's LARC keeps it in `.optim`)
    found = [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.optim.Optimizer)]
    return found if len(found) == 1 else None


def unheld(optimizer: Any) -> Any:
    """`optimizer` with holders that are no Optimizer (``.optimizers``, ``.optimizer``) replaced by what they hold."""
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
    out = []
    for it in items:
        held = held_optimizers(it)
        out.extend(held if held is not None else [it])
    return out or None


def is_compiled(module: Any) -> bool:
    """A ``torch.compile`` wrapper (``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule"


def model_labels(models: List[Any], frame: Any) -> List[str]:
    """Names that tell several watched models apart in paths (``G.main.0``, ``D.main.0``): the user's
    variable (or ``self`` attribute) naming each model in `frame`, the frame that made the guard,
    where every model has exactly one; else class names, numbered where two models share one."""
    names: List[Optional[str]] = [None] * len(models)
    if frame is not None:
        try:
            local = frame_locals(frame)
            scopes = [local]
            owner = local.get("self")
            if owner is not None and hasattr(owner, "__dict__"):
                scopes.append(vars(owner))
            if frame.f_globals is not local:
                scopes.append(frame.f_globals)
            for i, m in enumerate(models):
                for scope in scopes:
                    found = [k for k, v in list(scope.items()) if v is m and not k.startswith("_")]
                    if found:
                        names[i] = found[0] if len(found) == 1 else None
                        break
        except Exception:
            names = [None] * len(models)
    if all(names) and len(set(names)) == len(names):
        return names  # type: ignore[return-value]
    kinds = [type(getattr(m, "module", m) if isinstance(m, wrapper_types()) else m).__name__ for m in models]
    return [k if kinds.count(k) == 1 else f"{k}[{i}]" for i, k in enumerate(kinds)]


def _holds_parameters(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` holds an ``nn.Parameter`` (not only plain tensors made with requires_grad=True)."""
    return any(isinstance(p, nn.Parameter) for g in opt.param_groups for p in g["params"])


#: tensors an inner solve's optimizer holds at most (task weights, a step size); a model's optimizer holds more
SOLVE_TENSORS = 8


class Watched:
    """The watched models and optimizers (weakly held) and the names guard gives their modules and parameters.

    `notice(message)` says once what guard cannot see; `contain(None, exc)` reports guard's own failure.
    """

    def __init__(self, models: List[weakref.ref], optimizers: List[weakref.ref], notice: Callable[[str], None],
                 contain: Callable[[Any, BaseException], None], labels: Optional[List[str]] = None):
        self.refs = models
        #: with several models: each one's label, the first part of its paths and parameter names
        self.labels = labels
        self._prefix: Dict[int, str] = {}  # id(root) -> its label, for roots whose names carry one
        self.seen_optimizers: List[weakref.ref] = list(optimizers)
        #: the optimizer whose step ends the guard's step (the first given, else the first seen stepping)
        self.primary: Optional[weakref.ref] = optimizers[0] if optimizers else None
        self._opt_watch = WeakIdMap()  # optimizer -> whether it steps the watched models
        self._plain_primary = False  # the primary holds plain tensors only (a global guard's stand-in, see watch_optimizer)
        self._plains: Dict[Tuple[int, int], Tuple[Any, bool]] = {}  # (id(optimizer), id(primary)) -> (ref, `_plain`)
        self._successors: Dict[int, Tuple[Any, Any, bool]] = {}  # id(optimizer) -> (it, primary, steps all of its)
        self.former: Optional[Any] = None  # weak reference to the optimizer that counted steps before the primary
        self.idle = 0  # steps of other optimizers since the primary's last one
        self._own_idle: Dict[int, int] = {}  # id(optimizer) -> its own steps since the primary's last one
        for r in optimizers:
            if r() is not None:
                self._opt_watch[r()] = True
        self._notice = notice
        self._contain = contain
        self.paths_by_id: Dict[int, str] = {}
        self.root_ids: set = set()
        self.paths_weak: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self.roots_seen: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self.scripted = False  # a TorchScript model runs no Python hooks
        # modules called so far (only gates the one-time module table entry); an entry dies with its module, so a
        # module that a global guard meets at a dead one's address gets its own entry
        self.module_ids = WeakIdMap()
        self.module_paths: set = set()
        self._param_names = WeakIdMap()  # param -> name; an entry dies with its parameter (ids are reused)
        self._stale_names = False  # a known module moved within a watched one: names to take afresh
        self.stepped_in: Dict[int, int] = {}  # id(optimizer) -> ident of the thread it last stepped in
        self.primary_called = True  # a model the primary optimizer trains was called since the last step
        self.quiet = 0  # steps of other optimizers in a row with no call of the primary's models
        self._primary_ids: set = set()  # ids of the primary optimizer's parameters (note_call)
        self._primary_holds: Dict[int, Dict[int, Any]] = {}  # id(primary) -> {id(model): (ref, holds any of them)}
        #: while threads train at once: (optimizers, roots) of the thread guard follows (`narrow`)
        self._narrow: Optional[Tuple[List[weakref.ref], List[weakref.ref]]] = None

    def narrow(self, thread: Optional[int]) -> None:
        """Watch only the optimizers that step in `thread` and the models they train (None: all again).

        Checks read the gradients of every watched model; another thread's backward writes them without
        Python's lock, and reading them then can crash the process."""
        if thread is None:
            self._narrow = None
            return
        self._narrow = None
        opts = [o for o in self.optimizers if self.stepped_in.get(id(o)) == thread]
        ids = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
        roots = [m for m in self.roots if any(id(p) in ids for p in m.parameters())]
        self._narrow = ([weakref.ref(o) for o in opts], [weakref.ref(m) for m in roots])
        if opts and all(o is not (self.primary() if self.primary is not None else None) for o in opts):
            self.primary = weakref.ref(opts[0])  # steps are counted by the followed thread's optimizer

    @property
    def models(self) -> List[nn.Module]:
        """The watched models (unwrapped from DataParallel/DDP), alive ones only."""
        if self._narrow is not None and self.refs:
            return [m for m in (r() for r in self._narrow[1]) if m is not None]
        out = []
        for r in self.refs:
            m = r()
            if m is not None:
                m = m.module if isinstance(m, wrapper_types()) else m
                out.append(m._orig_mod if is_compiled(m) else m)  # torch.compile's wrapper: the user's names
        return out

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """Optimizers given to the guard or seen stepping while it was active."""
        refs = self.seen_optimizers if self._narrow is None else self._narrow[0]
        return [o for o in (r() for r in refs) if o is not None]

    @property
    def stand_in(self) -> bool:
        """Whether the optimizer steps are counted by is a stand-in over plain tensors only (an inner solve stepping
        before the model's optimizer's first step, under a global guard: see `watch_optimizer`). Looked at again while
        it holds: an optimizer stepped with a closure (``opt.step(closure)``) takes its first step before the model's
        first call, inside that step, so its parameters were no model's yet when it was judged."""
        if self._plain_primary:
            primary = self.primary() if self.primary is not None else None
            if primary is not None and self._holds_model_parameters(primary):
                self._plain_primary = False
        return self._plain_primary

    def is_primary(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.primary is not None and self.primary() is optimizer

    def takes_over(self, optimizer: torch.optim.Optimizer) -> Tuple[int, str]:
        """A watched optimizer other than the primary stepped. It becomes the primary when the primary has not
        stepped during `REPLACED` steps of others (it was replaced, as Adam by SGD mid-run, but is still
        referenced), or during `FINISHED` steps of others in a row that called none of its models (its
        model's training is over: the next model trains). A GAN's optimizers alternate and never get there.

        The optimizer that counted before steps again (a probe's own optimizer trained meanwhile): it takes
        the count back at once.

        Returns (the steps made without the primary, counting this one; why: "done", "replaced", "successor"
        or "back"), (0, "") when `optimizer` does not take over."""
        self.idle += 1
        mine = self._own_idle[id(optimizer)] = self._own_idle.get(id(optimizer), 0) + 1
        self.quiet = 0 if self.primary_called else self.quiet + 1
        self.primary_called = False
        # An optimizer over plain tensors only, while the primary holds nn.Parameters, is an inner solve between
        # the primary's steps (task weights found with a fresh SGD([w]) every iteration): it waits far longer.
        plain = self._plain(optimizer)
        finished, replaced = (PLAIN_WAIT, PLAIN_WAIT) if plain else (FINISHED, REPLACED)
        done = self.quiet >= finished
        # One that steps every parameter the primary steps, twice without it, is its successor (re-created to
        # resume, or for the next round): two optimizers of one set of parameters do not take turns.
        former = self.former() if self.former is not None else None
        back = former is optimizer  # the optimizer that counted before (a probe's own trained meanwhile) steps again
        # (its own steps: several optimizers over one set of parameters, all stepping at every step, take turns)
        succeeds = not back and not done and self.idle < replaced and mine >= SUCCEEDS and self._succeeds(optimizer)
        if not back and self.idle < replaced and not done and not succeeds:
            return 0, ""
        why = "back" if back else "done" if done else "successor" if succeeds else "replaced"
        n, self.idle = (1 if back else self.idle), 0
        self.former = self.primary
        self.primary = weakref.ref(optimizer)
        self.primary_stepped()
        return n, why

    def _plain(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` holds plain tensors only while the primary holds an ``nn.Parameter`` (decided once
        per pair)."""
        primary = self.primary() if self.primary is not None else None
        key = (id(optimizer), id(primary))
        hit = self._plains.get(key)
        if hit is None or hit[0]() is not optimizer:
            plain = primary is not None and not self._holds_model_parameters(optimizer) and _holds_parameters(primary)
            if len(self._plains) > 64:
                self._plains.clear()
            hit = self._plains[key] = (weakref.ref(optimizer), plain)
        return hit[1]

    def _succeeds(self, optimizer: torch.optim.Optimizer) -> bool:
        primary = self.primary() if self.primary is not None else None
        if primary is None:
            return False
        hit = self._successors.get(id(optimizer))
        if hit is None or hit[0]() is not optimizer or hit[1]() is not primary:
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            covers = all(id(p) in mine for g in primary.param_groups for p in g["params"])
            if not covers and self.models:
                # or the watched models' parameters were replaced (load_state_dict(..., assign=True)), so the
                # primary holds none of them any more and this one, re-created after, holds them all
                current = [p for m in self.models for p in m.parameters() if p.requires_grad]
                prim = {id(p) for g in primary.param_groups for p in g["params"]}
                covers = bool(current) and all(id(p) in mine and id(p) not in prim for p in current)
            hit = self._successors[id(optimizer)] = (weakref.ref(optimizer), weakref.ref(primary), covers)
        return hit[2]

    def primary_stepped(self) -> None:
        """The primary optimizer stepped (or changed): watch again whether its models are called."""
        self.idle, self.quiet, self.primary_called = 0, 0, False
        self._own_idle.clear()

    def note_call(self, module: nn.Module) -> None:
        """A model call starts (while none of the primary's models was called since its last step)."""
        primary = self.primary() if self.primary is not None else None
        if primary is None:
            self.primary_called = True
            return
        held = self._primary_holds.get(id(primary))
        if held is None:
            ids = {id(p) for g in primary.param_groups for p in g["params"]}
            held = {}
            self._primary_holds = {id(primary): held}  # one primary at a time
            self._primary_ids = ids
        hit = held.get(id(module))  # decided once per model (a model's parameters are read once, not per step)
        if hit is None or hit[0]() is not module:
            hit = held[id(module)] = (weakref.ref(module), any(id(p) in self._primary_ids for p in module.parameters()))
        self.primary_called = hit[1]

    def _holds_model_parameters(self, opt: torch.optim.Optimizer) -> bool:
        """Whether `opt` holds an ``nn.Parameter`` of a model: under a global guard, a few free-standing ones that no
        model seen called registers (CAGrad's task weights as ``nn.Parameter(torch.zeros(T))`` with a fresh
        ``SGD([w])`` every iteration) are an inner solve's plain tensors too. Decided once per optimizer."""
        params = [p for g in opt.param_groups for p in g["params"] if isinstance(p, nn.Parameter)]
        if not params:
            return False
        if self.models or len(params) > SOLVE_TENSORS:
            return True
        ids = {id(p) for p in params}
        return any(id(p) in ids for m in list(self.roots_seen) for p in m.parameters())

    def watch_optimizer(self, opt: torch.optim.Optimizer, early: bool = False) -> Tuple[bool, Optional[bool]]:
        """Whether `opt` steps parameters of the watched models (decided once per optimizer), and
        whether it just became the primary optimizer: None if not, else whether steps start again at 0
        (there was none before, or it replaces a stand-in: below).

        Under a global guard an optimizer over plain tensors only (an inner solve for task weights with a fresh
        ``SGD([w])`` each iteration, CAGrad/MGDA-style) counts steps only until one over ``nn.Parameter``s
        steps, if that comes `early` (within the first steps): that one trains the model."""
        known = self._opt_watch.data.get(id(opt))
        became = None
        if known is None:
            models = self.models
            if not models:
                known = True
            else:
                ids = {id(p) for m in models for p in m.parameters()}
                known = any(id(p) in ids for g in opt.param_groups for p in g["params"])
            self._opt_watch[opt] = known
            if known:
                if all(r() is not opt for r in self.seen_optimizers):
                    self.seen_optimizers.append(weakref.ref(opt))
                plain = not models and not self._holds_model_parameters(opt)
                if self.primary is None or self.primary() is None:
                    became = self.primary is None or (self._plain_primary and early and not plain)
                    self.primary = weakref.ref(opt)
                    self._plain_primary = plain
                elif self._plain_primary and not plain and early:
                    became, self.primary, self._plain_primary = True, weakref.ref(opt), False
        return known, became

    def stepping_optimizers(self) -> List[torch.optim.Optimizer]:
        """Every live optimizer seen stepping, watched or not (an attack's own optimizer over its delta)."""
        return list(self._opt_watch.keys())

    @property
    def roots(self) -> List[nn.Module]:
        """The watched models, or under a global guard the outermost modules seen called."""
        if self._narrow is not None:
            return [m for m in (r() for r in self._narrow[1]) if m is not None]
        return self.models or list(self.roots_seen)

    def path_of(self, module: nn.Module) -> str:
        """The module's path in its model (``layer4.1.conv2``); the root is its class name."""
        p = self.paths_by_id.get(id(module))
        if p is None:
            p = self.paths_weak.get(module)
            if p is None:
                p = type(module).__name__
        return p

    def known_path(self, module: Any) -> Optional[str]:
        """The path of a module of the watched model(s) (or seen under a global guard), else None."""
        if not isinstance(module, nn.Module):
            return None
        p = self.paths_by_id.get(id(module))
        return p if p is not None else self.paths_weak.get(module)

    def param_name(self, param: torch.Tensor, optimizers: List[torch.optim.Optimizer]) -> str:
        """A parameter's qualified name in the watched model(s), or a positional fallback."""
        if self._stale_names:
            self._stale_names, self._param_names = False, WeakIdMap()
        names = self._param_names
        name = names.data.get(id(param))
        if name is None:
            for m in self.roots:
                pre = self._prefix.get(id(m))
                for n, p in m.named_parameters(remove_duplicate=False):
                    if id(p) not in names.data:
                        names[p] = f"{pre}.{n}" if pre else n
            name = names.data.get(id(param))
        if name is None:
            # a parameter outside every model (GradNorm's task weights, a learned temperature): its variable
            var = variable_naming(param)
            if var is not None:
                names[param] = var
                return var
            for o in optimizers:
                for gi, group in enumerate(o.param_groups):
                    for pi, p in enumerate(group["params"]):
                        if p is param:
                            label = group.get("name")  # a group named by the code (3D Gaussian splatting's "xyz")
                            if isinstance(label, str) and label.isprintable() and 0 < len(label) <= 64:
                                return label if len(group["params"]) == 1 else f"{label}[{pi}]"
                            return f"param_groups[{gi}].params[{pi}]"
            return f"param{tuple(param.shape)}"
        return name

    def named_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters of the watched models (or of the root modules seen, in global mode)."""
        out, seen = [], set()
        for m in self.roots:
            pre = self._prefix.get(id(m))
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{pre}.{n}" if pre else n, p))
        return out

    def compiled_notice(self, module: nn.Module) -> None:
        self._notice(
            f"guard: {self.path_of(getattr(module, '_orig_mod', module))} runs under torch.compile: guard checks it at "
            f"the compiled call's boundary (its inputs and outputs, the loss, gradients, parameters and optimizer "
            f"steps) and stays out of the compiled code (no graph break, no recompile); checks of the layers inside "
            f"(NaN origin, BatchNorm, device, eval mode) do not run there. For full checks run a few steps uncompiled "
            f"under guard.")

    def index(self, model: nn.Module) -> nn.Module:
        """Name the modules of a watched model (model mode); returns the model inside any DP/DDP wrapper."""
        inner = model.module if isinstance(model, wrapper_types()) else model
        compiled = is_compiled(inner)
        label = None
        if self.labels:
            label = next((lb for r, lb in zip(self.refs, self.labels) if r() is model), None)
            if label is not None:
                self._prefix[id(inner._orig_mod if compiled else inner)] = label
        for path, mod in inner.named_modules():
            mod_type = type(mod).__name__
            if compiled:
                path = path[len("_orig_mod."):]  # the user's names, not torch.compile's wrapper
                mod_type = type(inner._orig_mod).__name__ if mod is inner else mod_type
            if label is not None:
                path = f"{label}.{path}" if path else label
            self.paths_by_id[id(mod)] = path or mod_type
        self.roots_seen.add(inner)
        self.root_ids.add(id(inner))
        if isinstance(inner, torch.jit.ScriptModule):
            self.scripted = True
            self._notice(f"guard: {type(inner).__name__} is a TorchScript module: it runs no Python hooks, "
                         f"so guard checks its losses, gradients and optimizer steps, not its layers.")
        else:
            scripted = [p for p, m in inner.named_modules() if p and isinstance(m, torch.jit.ScriptModule)]
            top = [p for p in scripted if not any(p.startswith(q + ".") for q in scripted)]
            if top:
                names = ", ".join(self.paths_by_id.get(id(inner.get_submodule(p)), p) for p in top[:4])
                self._notice(f"guard: {names} {'is a TorchScript module' if len(top) == 1 else 'are TorchScript modules'} "
                             f"inside the model: {'its' if len(top) == 1 else 'their'} own layers run no Python hooks, "
                             f"so guard checks what goes in and out of {'it' if len(top) == 1 else 'them'}, not the "
                             f"layers inside.")
        return inner

    def adopt_root(self, module: nn.Module, frame: Any = None) -> None:
        """An outermost module call under a global guard: name its modules (paths as in the user's model).

        Called from a method of a module that holds it (a LightningModule's ``training_step`` calling
        ``self.net(x)``), its paths start with its attribute path there (``net.0``), as a guard given that
        module would name them."""
        wrapper = None
        if isinstance(module, wrapper_types()):  # without DDP's "module."
            if isinstance(module, DP_TYPES):
                self.paths_weak[module] = type(module).__name__  # DataParallel/DDP keep their own name
            else:
                wrapper = module  # Fabric's: named as the model it wraps, once that one is named (below)
            module = module.module
        if is_compiled(module):
            # torch.compile's wrapper runs eagerly (hooks fire here); its _orig_mod carries the user's names.
            self.compiled_notice(module)
            self.paths_weak[module] = type(module._orig_mod).__name__
            module = module._orig_mod
        if isinstance(module, wrapper_types()):
            return
        try:
            known = self.paths_weak
            mods = list(module.named_modules())
            # A second model whose paths are those of another (a GAN's G.main.0 and D.main.0): its names
            # carry a label, its class name (numbered when taken), so that findings tell them apart.
            own = {id(mod) for _, mod in mods}
            taken = {p for m, p in known.items() if id(m) not in own} if known else set()
            label = _owner_path(module, frame) if frame is not None else None
            if label is not None:
                self._prefix[id(module)] = label
            elif taken and any((path or type(mod).__name__) in taken for path, mod in mods if mod not in known):
                # the script's variable holding it (`pose_net` beside `depth_net`, both nn.Sequential), else its class
                label = base = _script_variable(module, frame, taken) or type(module).__name__
                n = 1
                while label in taken or any(p.startswith(label + ".") for p in taken):
                    n += 1
                    label = f"{base}#{n}"
                self._prefix[id(module)] = label
            for path, mod in mods:
                if path == "" or mod not in known or known[mod] == type(mod).__name__:
                    name = path or type(mod).__name__
                    known[mod] = (f"{label}.{path}" if path else label) if label else name
            if wrapper is not None:
                known[wrapper] = known.get(module, type(module).__name__)
            self.roots_seen.add(module)
        except Exception as exc:
            self._contain(None, exc)

    def name_added(self, parent: nn.Module, name: str, module: nn.Module) -> List[nn.Module]:
        """Name a module registered on a named one mid-run (a block appended, a head replaced); the modules
        that had no name before, which the caller hooks."""
        ppath = self.known_path(parent)
        if ppath is None:
            return []
        if self.known_path(module) is not None or self.known_path(parent._modules.get(name)) is not None:
            # A known module moved (`model.old_head = model.head`, then a new `model.head`): its parameters'
            # names, cached from first sight, are taken afresh at the next name asked (the hook runs before
            # the assignment, so not now).
            self._stale_names = True
        if id(parent) in self.root_ids or parent in self.roots_seen:
            label = self._prefix.get(id(parent))
            base = f"{label}.{name}" if label else name
        else:
            base = f"{ppath}.{name}"
        new = []
        for sub, mod in module.named_modules():
            if self.known_path(mod) is None:
                self.paths_weak[mod] = f"{base}.{sub}" if sub else base
                new.append(mod)
        return new

    def record_module(self, module: nn.Module, output: Any, record: Record) -> None:
        """Add a module's first call to the module table of `record` (path, type, output shape, ...)."""
        try:
            self.module_ids[module] = True
            if len(self.module_paths) >= MAX_MODULES:
                return
            path = self.path_of(module)
            if path in self.module_paths:
                return
            t = first_tensor(output)
            self.module_paths.add(path)
            record.add_module({
                "path": path,
                "type": type(module).__name__,
                "output_shape": list(t.shape) if t is not None and not t.is_nested else None,
                "dtype": str(t.dtype) if t is not None else None,
                "device": str(t.device) if t is not None else None,
                "params": tree_stats(module)[1],  # no recursion: this runs at the deepest point of a forward
            })
        except Exception as exc:
            self._contain(None, exc)


def _owner_path(module: nn.Module, frame: Any) -> Optional[str]:
    """`module`'s attribute path in the module whose method calls it (the first frame of the user's code,
    its ``self``), or None."""
    from ._frames import is_skipped

    f, hops = frame, 0
    while f is not None and hops < 12 and is_skipped(f.f_code.co_filename):
        f, hops = f.f_back, hops + 1
    if f is None:
        return None
    if "self" in f.f_code.co_varnames[:max(f.f_code.co_argcount, 1)]:
        owner = f.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner is not module:
            return _path_in(owner, module)
        if owner is not None and not isinstance(owner, nn.Module) and hasattr(owner, "__dict__"):
            # a Trainer's method calling `self.model.backbone(x)`: the model among its attributes; a single
            # layer beside the model (`self.head`) takes its attribute's name
            return _path_in_any(vars(owner), module, direct=True)
        return None
    # a loop calling a model's parts (`model.backbone(x)`, `model.head(h)`): the model among its variables.
    # A function's f_locals is, before Python 3.13, a snapshot that the frame keeps until it returns: read in a
    # long training loop, it would keep that moment's tensors (a loss and its graph) alive for the whole run.
    # So only a script's top level (its locals are its globals) or a write-through proxy (3.13+) is read.
    if f.f_code.co_flags & CO_OPTIMIZED and sys.version_info < (3, 13):
        return None
    # (a single layer held directly by a variable, `h1 = nn.Linear(8, 1)`, is named by it: its parameters would be a
    # bare `weight`, the same as any other single layer's)
    return _path_in_any(f.f_locals, module, direct=True)


def _script_variable(module: nn.Module, frame: Any, taken: set) -> Optional[str]:
    """The name of a script's top-level variable that holds `module` itself (not read from a function's frame:
    before Python 3.13 that would make the frame keep a snapshot of its variables), unless a path uses it."""
    f, hops = frame, 0
    while f is not None and hops < 16:
        if not is_skipped(f.f_code.co_filename) and not (f.f_code.co_flags & CO_OPTIMIZED):
            for k, v in list(f.f_globals.items()):
                if v is module and not k.startswith("_") and k.isidentifier():
                    return None if k in taken or any(p.startswith(k + ".") for p in taken) else k
        f, hops = f.f_back, hops + 1
    return None


def _path_in(owner: nn.Module, module: nn.Module) -> Optional[str]:
    for path, m in owner.named_modules():
        if m is module:
            return path or None
    return None


def _path_in_any(names: Dict[str, Any], module: nn.Module, limit: int = 16, direct: bool = False) -> Optional[str]:
    """`module`'s path in the first of the (at most `limit`) modules among `names`' values that holds it; for
    a single layer (no submodules, whose parameters would be a bare ``weight``) held directly, its name there."""
    allow, n, found_direct = direct, 0, None
    for k, v in list(names.items()):
        if v is module:
            found_direct = found_direct or k
        elif isinstance(v, nn.Module) and not isinstance(v, wrapper_types()) and not is_compiled(v):
            # (a DDP/DataParallel/compile wrapper of the model is no model holding it: no `module.` prefix)
            n += 1
            if n > limit:
                break
            found = _path_in(v, module)
            if found is not None:
                return found
    if (allow and found_direct is not None and isinstance(found_direct, str) and not found_direct.startswith("_")
            and next(module.children(), None) is None):
        return found_direct
    return None
