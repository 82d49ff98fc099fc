"""A loss disconnected from the model: the tensor passed to ``backward()`` reaches no parameter of the optimizer.

``loss = torch.tensor(loss.item(), requires_grad=True)`` (a common "fix" for
"element 0 of tensors does not require grad"), a loss computed from ``.detach()``ed,
``.numpy()``-round-tripped or ``.data`` outputs wrapped in a new tensor with
``requires_grad=True``: ``backward()`` runs without an error, the optimizer steps,
and nothing learns.

At each ``backward()`` (on sampled steps) the autograd graph is walked from the
back-propagated tensors to their leaves (``AccumulateGrad`` nodes), stopping at the
first ``nn.Parameter``: a healthy loss meets one within a few nodes. A walk that finds
none keeps the leaves it did reach, and at the next optimizer step they are compared
with the parameters of every optimizer seen: when none of them is held by an
optimizer, the loss is disconnected. A loss that trains only a head, a GAN's
discriminator loss (it reaches the discriminator's parameters, whichever optimizer
holds them), and optimizing a plain tensor (style transfer: ``LBFGS([image])``) stay
silent; without any optimizer (a manual update) nothing is judged. A graph through a Python
``autograd.Function`` that reaches no parameter is not judged either: such a function may use
parameters the graph does not show (``torch.utils.checkpoint(use_reentrant=True)`` runs the model
inside its backward).

Cost: a graph walk per ``backward()`` that stops at the first parameter (a handful of
nodes on a healthy loss), and on later steps not even that: the path the walk took to the
parameter is followed again first (a few attribute reads). Host only, no device values.
Nothing per module call.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._graphs import user_frames
from .._frames import frame_locals
from .base import Check

MAX_NODES = 20_000
_PY_FUNCTION = torch.autograd.function.BackwardCFunction  # the graph node of a Python autograd.Function
MAX_LEAVES = 16
MAX_PATHS = 4  # graph shapes remembered (a GAN's two losses, a loop with two models)
ORPHAN_STEPS = 4  # steps in a row with backward() over another model and no gradient for the optimizer


def _follow(fn: Any, path: Tuple[int, ...], param: weakref.ref) -> bool:
    """Whether the `next_functions` indices of `path`, followed from node `fn`, end at the leaf of `param`, the
    parameter the walk that found the path met (a model re-created since, whose optimizer still holds the old
    parameters, builds the same graph over new ones)."""
    try:
        for i in path:
            fn = fn.next_functions[i][0]
        return fn.variable is param()
    except Exception:  # another graph shape (index out of range, a node that is no leaf, None)
        return False


def _leaves(roots: List[torch.Tensor], paths: Optional[List[Tuple[Tuple[int, ...], weakref.ref]]] = None,
            held: Optional[Callable[[], Optional[set]]] = None) -> Optional[List[torch.Tensor]]:
    """Leaf tensors the graph behind `roots` accumulates into; None as soon as one is an nn.Parameter.

    `paths` keeps the `next_functions` indices from the first root's node to the parameter found by earlier
    walks: a training loop builds the same graph every step, so that path, followed in a few attribute reads,
    usually ends at a parameter again, and the walk is skipped. A walk that finds one adds its path.
    """
    first = roots[0].grad_fn if roots else None
    if paths and first is not None:
        for path, param in paths:
            if _follow(first, path, param):
                return None
    held_ids: List[Optional[set]] = []  # worked out at the first parameter met (the walk is off the usual path)
    found: List[torch.Tensor] = []
    stack: List[Any] = []
    for t in roots:
        if t.grad_fn is None:
            if isinstance(t, nn.Parameter):
                return None
            if t.requires_grad:
                found.append(t)  # backward() on a leaf: it accumulates into itself only
        else:
            stack.append(t.grad_fn)
    seen = set()
    keep = []  # node objects stay alive during the walk, so ids stay unique
    # id(node) -> (id(parent), index in the parent's next_functions): the path to a parameter, once found
    parent: Dict[int, Tuple[int, int]] = {}
    opaque = False  # met a Python autograd.Function: it may use parameters the graph does not show
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        if isinstance(node, _PY_FUNCTION):
            opaque = True
        if len(seen) > MAX_NODES:
            return None  # too large to judge: assume connected
        try:
            nxt = node.next_functions
        except Exception:
            continue
        for k, (child, _) in enumerate(nxt):
            if child is None:
                continue
            var = getattr(child, "variable", None)
            if var is not None:
                # a parameter no optimizer holds (a prompt left out of the optimizer) is a leaf like any other
                if isinstance(var, nn.Parameter) and not held_ids and held is not None:
                    held_ids.append(held())
                if isinstance(var, nn.Parameter) and (not held_ids or held_ids[0] is None or id(var) in held_ids[0]):
                    # (a path is kept only to a parameter an optimizer holds: before guard knows one, any counts)
                    if paths is not None and first is not None and len(paths) < MAX_PATHS and held_ids \
                            and held_ids[0] is not None:
                        path, at = [k], id(node)
                        while at in parent:
                            at, i = parent[at]
                            path.append(i)
                        if at == id(first):
                            paths.append((tuple(reversed(path)), weakref.ref(var)))
                    return None
                if len(found) < MAX_LEAVES and all(v is not var for v in found):
                    found.append(var)
            elif id(child) not in seen:
                stack.append(child)
                parent.setdefault(id(child), (id(node), k))
    if opaque:
        # torch.utils.checkpoint(use_reentrant=True) runs the model inside its backward: the parameters
        # get their gradients there, and its node lists only the inputs. Such a graph is not judged.
        return None
    return found



def _sharing(optimizer: Any) -> int:
    """How many optimizers (the user's variables, lists of them included) hold `optimizer`'s first parameter: 2 or
    more when an ensemble's optimizers were all built over one member (`[Adam(model.parameters()) for m in members]`).
    Report-time only."""
    first = next((p for grp in optimizer.param_groups for p in grp["params"]), None)
    if first is None:
        return 0
    found: Dict[int, Any] = {}
    for fr in user_frames():
        for scope in (frame_locals(fr), fr.f_globals):
            for v in list(scope.values()):
                vals = v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else (v,)
                for o in list(vals)[:256]:
                    if isinstance(o, torch.optim.Optimizer):
                        found[id(o)] = o
    return sum(1 for o in found.values() if any(p is first for grp in o.param_groups for p in grp["params"]))

class LossDisconnected(Check):
    name = "loss-disconnected"
    costly = True  # sampled under a budget: a property of the code, seen on any step it runs
    kinds = {"loss-disconnected": ("error", "the tensor passed to backward() reaches none of the optimizer's parameters")}
    description = "the tensor passed to backward() reaches none of the optimizer's parameters (torch.tensor(loss.item(), requires_grad=True), detached outputs)"

    # shared with nonfinite, eval-without-no-grad and explain (one wrapper): an inner loop's derivatives
    patches = {"autograd_grad": "torch.autograd.grad"}

    def watches(self, module) -> bool:
        return False

    def on_autograd_grad(self, args, kwargs):
        self._inner_step = self.g.step  # a meta-learning inner loop (MAML) takes derivatives this step

    def __init__(self, guard):
        super().__init__(guard)
        self._inner_step = -10  # the last step torch.autograd.grad ran at (none yet: far before step 0)
        # backwards of this step that reached no nn.Parameter: ([(leaf ref, its version then)], leaf descriptions,
        # source, step, shape)
        self._pending: List[Tuple[List[Tuple[weakref.ref, int]], List[str], Optional[str], int, List[int]]] = []
        self._done = False
        # known paths from a loss's node to a parameter, and that parameter (`_leaves`)
        self._paths: List[Tuple[Tuple[int, ...], weakref.ref]] = []
        self._elsewhere = 0  # `backwards_elsewhere` at the primary optimizer's last step
        self._orphans: List[int] = []  # steps in a row whose backward ran elsewhere and left the optimizer no gradient
        self._inputs: Optional[Tuple[Any, bool]] = None  # (optimizers' key, whether they optimise inputs only)
        # backwards run before guard knew any optimizer (a global guard's first step): (refs to what backward() was
        # called on, source, step), walked again at that step's update, when the optimizer is known
        self._early: List[Tuple[List[weakref.ref], Optional[str], int]] = []

    def _held(self, *extra: Any) -> set:
        """Ids of the parameters of every optimizer seen, watched or not (an attack's own over its delta)."""
        opts = list(self.g.optimizers) + list(extra) + self.g.watched.stepping_optimizers()
        return {id(p) for o in opts for grp in o.param_groups for p in grp["params"]}

    def _walk_held(self) -> Optional[set]:
        """`_held()` for a graph walk; None (any parameter counts) before guard knows an optimizer."""
        return self._held() if self.g.optimizers else None

    def on_backward(self, tensors, kwargs):
        if self._done or not self.g.sampling or len(self._pending) >= 8:
            return
        ts = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in (tensors or ()) if isinstance(t, torch.Tensor)]
        if not ts:
            return
        if not self.g.optimizers and len(self._early) < 4:
            # any parameter counts before guard knows an optimizer: the loss is walked again at the step
            self._early.append(([weakref.ref(t) for t in ts], self.g.root_source, self.g.step))
        self._look(ts, self._walk_held, self.g.root_source, self.g.step)

    def _look(self, ts: List[torch.Tensor], held: Callable[[], Optional[set]], src: Optional[str], step: int) -> None:
        # The walk (not the path followed on later steps) stops only at a parameter an optimizer seen so far holds.
        leaves = _leaves(ts, self._paths, held)
        if leaves is None:
            return
        t0 = ts[0]
        if len(ts) == 1 and t0.grad_fn is None and t0.numel() == 1 and not t0.is_meta and float(t0.detach()) == 0.0:
            # `torch.tensor(0.0, requires_grad=True)`: a batch with nothing to learn (no valid triplet or pair) gets
            # a placeholder loss that trains nothing on purpose; a loss re-wrapped by hand keeps its value (read
            # here, on this path only)
            return
        if leaves and not any(isinstance(l, nn.Parameter) for l in leaves) and \
                not any(p.requires_grad for m in self.g.roots for p in m.parameters()) and not self._inputs_optimized():
            return  # the models are frozen on purpose for this backward: a saliency map, an attack on the input
        descr = [f"{'the loss itself' if any(l is t for t in ts) else 'a parameter' if isinstance(l, nn.Parameter) else 'a tensor'} "
                 f"{self._named(l)}{list(l.shape)} ({'held by no optimizer' if isinstance(l, nn.Parameter) else 'a leaf made with requires_grad=True' if l.grad_fn is None else type(l.grad_fn).__name__})"
                 for l in leaves]
        self._pending.append(([(weakref.ref(l), l._version) for l in leaves], descr, src, step, list(ts[0].shape)))

    def _inputs_optimized(self) -> bool:
        """Whether the optimizers hold only tensors outside the watched models (style transfer's image, a soft
        prompt, dataset distillation's images), or only frozen ones: a backward through the frozen models is then
        the training's own, not a saliency map's."""
        opts = list(self.g.optimizers) + self.g.watched.stepping_optimizers()
        if not opts:
            return False
        key = tuple((id(o), len(o.param_groups)) for o in opts)
        if self._inputs is not None and self._inputs[0] == key:
            return self._inputs[1]
        own = {id(p) for m in self.g.roots for p in m.parameters()}
        held = [p for o in opts for grp in o.param_groups for p in grp["params"]]
        # (or an optimizer over frozen weights only, a soft prompt left out of it: it trains nothing either way)
        self._inputs = (key, bool(held) and (not any(id(p) in own for p in held)
                                             or not any(p.requires_grad for p in held)))
        return self._inputs[1]

    def _optimises_inputs(self, optimizer) -> bool:
        """Whether `optimizer` holds a few tensors (at most 3: an image, synthetic data and its learning rate, a latent),
        none of a watched model: inputs being optimised, not another network's weights (a body guard was not given)."""
        own = {id(p) for _, p in self.g.named_parameters()}
        held = [p for grp in optimizer.param_groups for p in grp["params"]]
        return bool(own) and 0 < len(held) <= 3 and not any(id(p) in own for p in held)

    def _named(self, leaf: torch.Tensor) -> str:
        """``name `` of a parameter of the watched models (a positional fallback names nothing)."""
        if not isinstance(leaf, nn.Parameter):
            return ""
        name = self.g.param_name(leaf)
        return f"{name} " if name and not name.startswith(("param", "parameters")) and "[" not in name else ""

    def on_step_pre(self, optimizer):
        if self.g.backwards_elsewhere != self._elsewhere and not self._done and self.g.is_primary(optimizer):
            self._elsewhere = self.g.backwards_elsewhere
            self._orphan_step(optimizer)
        elif self._orphans:
            self._orphans = []
        if self._early:
            early, self._early = self._early, []
            if not self._pending and not self._done:
                for refs, src, step in early:
                    ts = [t for r in refs if (t := r()) is not None]
                    if ts and len(ts) == len(refs):
                        self._look(ts, lambda: self._held(optimizer), src, step)
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        held = self._held(optimizer)
        # a backward that trains a plain tensor an optimizer holds (style transfer's image): nothing to judge
        pending = [e for e in pending if not any((l := r()) is not None and id(l) in held for r, _ in e[0])]
        if not pending:
            return
        own = [p for grp in optimizer.param_groups for p in grp["params"] if p.requires_grad]
        if own and all(p.grad is not None for p in own):
            # the loss reached none of them, yet each has a gradient by the step: handed over by hand (fp32 master
            # weights fed from a half-precision model's gradients, gradient surgery into other tensors)
            self._done = True
            return
        for refs, descr, src, step, shape in pending:
            live = [(l, v) for r, v in refs if (l := r()) is not None]
            if refs and not live:
                continue  # its leaves are gone by the step: a helper's own backward (temperature scaling), not the loop's
            if any(id(l) in held or l._version != v for l, v in live):
                # it trains a plain tensor an optimizer holds (style transfer), or one that an optimizer guard does
                # not see (given one optimizer, guard hooks that one only) updated in place since that backward
                continue
            kinds = {isinstance(l, nn.Parameter) for l, _ in live}
            if kinds == {True, False}:
                # inputs that require grad beside them (a PINN's collocation points, differentiated by autograd.grad)
                # are no part of the story: the parameters no optimizer holds are
                keep = [i for i, (l, _) in enumerate(live) if isinstance(l, nn.Parameter)]
                if len(descr) == len(live):
                    descr = [descr[i] for i in keep]
                live = [live[i] for i in keep]
            shapes = {tuple(p.shape) for grp in optimizer.param_groups for p in grp["params"]}
            copies = bool(live) and all(l.grad_fn is None and l.dim() and tuple(l.shape) in shapes for l, _ in live)
            # `torch.func.stack_module_state(members)`: the K members' parameters stacked along a new first dimension,
            # one leaf per parameter name, while the optimizer holds all K members' own
            held = sorted(tuple(p.shape) for grp in optimizer.param_groups for p in grp["params"])
            ks = {l.shape[0] for l, _ in live if l.grad_fn is None and l.dim() >= 1}
            k = ks.pop() if len(ks) == 1 else 0
            stacked = (not copies and k >= 2 and len(live) * k == len(held)
                       and sorted(tuple(l.shape[1:]) for l, _ in live for _ in range(k)) == held)
            inputs = (copies and not stacked and not all(isinstance(l, nn.Parameter) for l, _ in live)
                      and self._inputs_optimized())
            # every tensor the optimizer holds has its double on the loss's path: a copy of the whole model
            whole = copies and sorted(tuple(l.shape) for l, _ in live) == held
            # new leaves with the trailing shape of a tensor the optimizer holds but another number of rows: it was
            # re-created grown or pruned (3D Gaussian splatting's densification) and not put back in the optimizer
            # (one of its rows is one of the old tensor's: the new tensor was made from it, by rows)
            olds = [q for grp in optimizer.param_groups for q in grp["params"] if q.dim() >= 2]
            resized = (not copies and not stacked and bool(live) and all(
                l.grad_fn is None and l.dim() >= 2 and tuple(l.shape) not in shapes and l.numel() and any(
                    q.shape[1:] == l.shape[1:] and q.device == l.device and q.dtype == l.dtype
                    and bool((q.detach() == l.detach()[0]).flatten(1).all(-1).any()) for q in olds)
                for l, _ in live))
            self._emit(optimizer, descr, src, step, shape, copies or stacked, stacked, inputs, whole, resized)
            self._done = True  # a code property: reported once, then no more walks
            return

    def _orphan_step(self, optimizer) -> None:
        """A step of the primary optimizer after backward() ran with no watched model called: when none of its
        parameters (all trainable) has a gradient, ORPHAN_STEPS times in a row, the loss is
        another model's: one re-created after the optimizer was built (`model = Net(); model.load_state_dict(...)`
        in a "restart from the best checkpoint"), which the optimizer never updates."""
        params = [p for grp in optimizer.param_groups for p in grp["params"]]
        if not params or any(p.grad is not None or not p.requires_grad for p in params):
            self._orphans = []
            return
        self._orphans.append(self.g.step)
        if len(self._orphans) < ORPHAN_STEPS:
            return
        self._done = True
        opt, since = type(optimizer).__name__, self._orphans[0]
        models = ", ".join(self.g.path_of(m) for m in self.g.models) or "the watched model"
        self.emit("loss-disconnected", "loss",
                  f"since step {since} backward() reaches none of {opt}'s {len(params)} parameters: {models} is not "
                  f"called any more and no parameter {opt} holds gets a gradient, while backward() runs over another "
                  f"model's graph: a model re-created after {opt} was built (`model = Net(); "
                  f"model.load_state_dict(...)` to restart from a checkpoint, a copy) trains with no optimizer, and "
                  f"{opt}.step() updates the old one, which nothing uses",
                  f"Build the optimizer again over the model in use after re-creating it (`optimizer = "
                  f"torch.optim.{opt}(model.parameters(), ...)`, then `load_state_dict` of its saved state to keep "
                  f"it), or load the checkpoint into the existing model instead of a new instance.",
                  step=since, source=self.g.source(),
                  details={"optimizer": opt, "parameters": len(params), "steps_without_gradient": len(self._orphans),
                           "model_not_called": True})

    def _emit(self, optimizer, descr: List[str], src: Optional[str], step: int, shape: List[int],
              copies: bool = False, stacked: bool = False, inputs: bool = False, whole: bool = False,
              resized: bool = False) -> None:
        opt = type(optimizer).__name__
        if not descr:
            reaches = "nothing that requires a gradient"
        elif len(descr) == 1 and descr[0].startswith("the loss itself"):
            reaches = ("only itself: it is a new leaf tensor made with requires_grad=True (such as "
                       "torch.tensor(loss.item(), requires_grad=True), or a loss computed under torch.no_grad() and "
                       "then given requires_grad_()), cut off from the model")
        elif all(d.startswith("a parameter") for d in descr):
            reaches = (f"only {len(descr)} parameter(s) that no optimizer holds: {'; '.join(descr[:4])}"
                       + (" ..." if len(descr) > 4 else "")
                       + (f" (each shaped like one {opt} holds, which are other tensors: {opt} trains a copy of the "
                          f"model, deep-copied or built again after {opt} was built, while the loss is computed with "
                          f"the other one)" if whole else
                          f" (re-created with another number of rows after {opt} was built: points densified or "
                          f"pruned)" if resized else " (left out when the optimizer was built)"))
        elif stacked:
            reaches = (f"only {len(descr)} leaf tensor(s) that stack tensors shaped like {opt}'s parameters along a "
                       f"first dimension: {'; '.join(descr[:4])}" + (" ..." if len(descr) > 4 else "")
                       + " (an ensemble's parameters from torch.func.stack_module_state(members), used by vmap: they "
                       "are new tensors, and the optimizer holds the members' own parameters, which the forward never "
                       "uses)")
        elif inputs:
            reaches = (f"only {len(descr)} new tensor(s) shaped like the one(s) {opt} optimises: {'; '.join(descr[:4])}"
                       + (" ..." if len(descr) > 4 else "") + f" (the optimised tensor's name was re-bound, `img = "
                       f"img.detach().requires_grad_()` or `img = img.clamp(0, 1)`, and {opt} keeps updating the first "
                       f"tensor, which the loss no longer uses)")
        elif copies:
            reaches = (f"only {len(descr)} leaf tensor(s) shaped like {opt}'s parameters: {'; '.join(descr[:4])}"
                       + (" ..." if len(descr) > 4 else "") + " (copies used in the parameters' place, such as a "
                       "params dict passed to torch.func.functional_call or weights cloned with requires_grad_(): the "
                       "optimizer holds the originals, which the forward never uses)")
        elif resized:
            reaches = (f"only {len(descr)} new leaf tensor(s) with the rows of one {opt} optimises grown or pruned: "
                       f"{'; '.join(descr[:4])}" + (" ..." if len(descr) > 4 else "") + f" (re-created with another "
                       f"number of rows, points densified or pruned, and {opt} keeps updating the old tensor, which "
                       f"the loss no longer uses)")
        else:
            reaches = (f"only {len(descr)} tensor(s) that are not parameters: {'; '.join(descr[:4])}"
                       + (" ..." if len(descr) > 4 else "") + " (the graph was cut by .detach(), .item(), "
                       ".numpy(), .data or torch.no_grad() and restarted with requires_grad=True)")
        effect = (f"their gradients reach no optimizer, so {opt}.step() does not update them"
                  if descr and all(d.startswith("a parameter") for d in descr) else
                  f"backward() computes no gradient for the model and {opt}.step() changes nothing")
        message = (f"the tensor passed to backward() (shape {shape}, at {src}) reaches no parameter of {opt} "
                   f"or any other optimizer: it reaches {reaches}; {effect}")
        hint = ("Compute the loss from the model's outputs without leaving autograd: no .item(), .detach(), "
                ".numpy() or .data on the way, no torch.tensor(..., requires_grad=True) around the loss, and no "
                "torch.no_grad() (or @torch.no_grad() on the function computing it) followed by "
                "loss.requires_grad_(); use loss.item() only for logging.")
        if resized:
            hint = (f"Put the re-created tensor in the optimizer in the old one's place, with its state cut or grown "
                    f"the same way: group['params'][i] = new; {opt.lower()}.state[new] = {{k: v[keep] ...}} for the "
                    f"old tensor's state (or del its state to restart it); or build the optimizer again after each "
                    f"densification.")
        elif whole and all(d.startswith("a parameter") for d in descr) and (n := _sharing(optimizer)) >= 2:
            message = message.replace(
                f"{opt} trains a copy of the model, deep-copied or built again after {opt} was built, while the loss "
                f"is computed with the other one",
                f"{n} optimizers hold the same parameters, one model's: an ensemble's optimizers were all built over "
                f"one member, and the others train with none")
            hint = (f"Build each optimizer over its own member: [torch.optim.{opt}(m.parameters(), ...) for m in "
                    f"members] (a comprehension over `m` that reads the last loop's `model` builds them all over one "
                    f"model).")
        elif whole and all(d.startswith("a parameter") for d in descr):
            hint = (f"Build the optimizer over the model the loss is computed with, after its last re-assignment: "
                    f"optimizer = torch.optim.{opt}(model.parameters(), ...). A copy kept aside (a best checkpoint, an "
                    f"EMA model) takes the trained weights by copy (ema.load_state_dict(model.state_dict())); it does "
                    f"not get the optimizer.")
        elif all(d.startswith("a parameter") for d in descr) and self._optimises_inputs(optimizer):
            # the optimizer holds tensors of no model (an image, synthetic data, a latent): the network the loss
            # reaches is what they are optimised against, and the optimised tensors were cut off on the way
            message = message.replace(" (left out when the optimizer was built)", "")
            message += (f" ({opt} optimises tensors that belong to no model, an input, an image or synthetic data, "
                        f"and the loss no longer reaches them: something between them and the loss cut them off)")
            hint = ("Keep the optimised tensor in the graph up to the loss: no torch.no_grad() around what is computed "
                    "from it (an augmentation or a jitter applied under no_grad and then used), no .detach(), and "
                    "create_graph=True on an inner torch.autograd.grad whose result the loss uses (dataset "
                    "distillation's unrolled step). Freeze the network it is optimised against (requires_grad_(False)) "
                    "rather than handing it to the optimizer.")
        elif all(d.startswith("a parameter") for d in descr):
            hint = ("Hand them to the optimizer: torch.optim.X([*params_to_train], ...) or "
                    "optimizer.add_param_group({'params': [...]}); an optimizer over frozen parameters only trains "
                    "nothing. Build the optimizer after the model is final: parameters replaced after it was built "
                    "(an init function assigning new nn.Parameter objects, a layer swapped, a model re-created and "
                    "loaded from a checkpoint, `model = Net(); model.load_state_dict(...)`) are not the ones it "
                    "holds.")
        elif stacked:
            hint = ("Build the optimizer over the stacked tensors the vmapped forward uses: params, buffers = "
                    "stack_module_state(members); optimizer = torch.optim.Adam(params.values(), ...) (copy them back "
                    "into the members, if you need them, after training).")
        elif inputs:
            hint = ("Change the optimised tensor in place, under torch.no_grad(): img.clamp_(0, 1), img.copy_(new) "
                    "(it stays the tensor the optimizer holds); or build a new optimizer over the new tensor.")
        elif copies and self._inner_step >= step - 1:
            # copies adapted in an inner loop (MAML's fast weights): they are rebuilt for every task, so the optimizer
            # cannot hold them; the adaptation must start from the parameters themselves
            hint = ("Start the inner loop from the parameters themselves, not detached copies: fast = "
                    "dict(model.named_parameters()) (or {k: v.clone() for k, v in model.named_parameters()}: clone() "
                    "keeps the graph), then fast = {k: w - lr * g ...} with torch.autograd.grad(..., create_graph=True) "
                    "for second order; the meta-loss then reaches the parameters the optimizer holds. "
                    "`.detach().clone().requires_grad_()` cuts them off.")
        elif copies:
            hint = ("Build the optimizer over the tensors the forward uses (torch.optim.Adam(params.values()) for a "
                    "functional_call params dict), or pass the module's own parameters (dict(model.named_parameters())) "
                    "to functional_call.")
        self.emit("loss-disconnected", "loss", message, hint, step=step, source=src,
                  details={"reaches": descr[:MAX_LEAVES], "optimizer": opt, "loss_shape": shape,
                           **({"stacked_copies": True} if stacked else {}),
                           **({"model_copy": True} if whole and all(d.startswith("a parameter") for d in descr) else {}),
                           **({"rebound_input": True} if inputs else {}),
                           **({"resized": True} if resized else {}),
                           **({"inner_loop": True} if copies and self._inner_step >= step - 1 else {})})
