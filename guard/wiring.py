"""How a guard is wired into torch: its hooks and patches, and the step bookkeeping they drive.

`Wiring` is a mixin of `guard.session.Guard`, kept apart so that the session file holds the lifecycle
and the public API. Everything here is on the hot path of a training step: module hooks, optimizer
step hooks (closures included), the backward patch; each adds its own time to the guard's meter.
"""
from __future__ import annotations

import os
import sys
import threading
from threading import get_ident as _thread_id
from time import perf_counter as _clock
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import hooks as _hooks
from ._dist import remember_rank
from ._frames import DEEP_LIBRARY, user_source
from .callstack import pop_call, push_call
from . import watched as _watched
from .router import in_transform
from .findings import GuardError

#: -1 unless autograd's engine is running a backward (on any of its threads)
_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)

_NO_OUTPUT = object()

#: a global guard's optimizer over plain tensors only is replaced as the step counter by one over nn.Parameters
#: that first steps within this many steps (watched.Watched.watch_optimizer)
EARLY_STEPS = 64

#: optimizers taking the step count over that are told on stderr (the rest go to the dump's notices only)
HANDOVERS_TOLD = 2

#: a parametrized weight read (``layer.weight`` under torch.nn.utils.parametrize) calls this module: it is a
#: parameter read, never a model call, wherever it happens
_PARAM_READ = torch.nn.utils.parametrize.ParametrizationList


def _newest_node(tensors: Any, default: int) -> int:
    """Autograd's largest sequence number among the grad_fns of `tensors` (a tensor or a list), else `default`."""
    if isinstance(tensors, torch.Tensor):
        fn = tensors.grad_fn
        return fn._sequence_nr() if fn is not None else default
    if isinstance(tensors, (list, tuple)):
        return max((t.grad_fn._sequence_nr() for t in tensors
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None), default=default)
    return default


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GUARD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _in_torch(thread: int) -> bool:
    """Whether that thread is running torch or guard code now (a forward, backward or step under way)."""
    f = sys._current_frames().get(thread)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_TORCH_DIR) or name.startswith(_GUARD_DIR):
            return True
        f = f.f_back
    return False


class Wiring:
    """Hook installation and the hooks themselves (a mixin of `Guard`; uses its state)."""

    def model_call(self, module: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as a call of the watched `module` with those arguments.

        For frameworks whose step method is the model call (a LightningModule's ``training_step``
        calling ``self.net(x)``): the batch is the model's input, the step's forward is the model's,
        and the user's method is the source line. Nested real calls of `module` stay correct.
        """
        if not self._active or id(module) not in self._root_ids:
            return fn(*args, **kwargs)
        self._hook_pre(module, args, kwargs)
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
        if code is not None:
            from ._frames import is_skipped, short_path

            if not is_skipped(code.co_filename):
                self._tls.root_source = self._tls.model_source = f"{short_path(code.co_filename)}:{code.co_firstlineno}"
        out = fn(*args, **kwargs)
        self._hook_post(module, args, kwargs, out)
        return out

    # ------------------------------------------------------------------ installation
    def _install(self) -> None:
        inst = self._installer
        self._handovers = 0  # optimizers that took the step count over (_hook_step_post)
        router = self.router
        if self._models:
            # Every module's first call is seen from its start (pre-hook) and end (post-hook: the module
            # table). A layer called outside any call of its model stands in for the model (`_standin`);
            # the others lose the hooks no check keeps when settled (`_after_forward`).
            for mref in self._models:
                model = mref()
                if model is None:
                    continue
                inner = self.watched.index(model)
                self.room.note(inner)
                compiled = self.compile.root(inner)
                for mod in dict.fromkeys(m for _, m in inner.named_modules()) if not compiled else (inner,):
                    if isinstance(mod, torch.jit.ScriptModule):
                        continue  # register_forward_*hook raises on ScriptModules
                    if compiled and getattr(mod, "_compiled_call_impl", None) is not None:
                        continue  # model.compile(): the boundary around its compiled call does the root's part
                    handles = inst.module_hooks(mod, self._hook_pre, self._hook_post)
                    if id(mod) not in self._mod_handles:
                        self._mod_handles[id(mod)] = (handles[0], handles[-1])
        else:
            inst.global_module_hooks(self._hook_pre_global, self._hook_post_global)
        inst.module_registrations(self._on_register)
        if self._optimizers:
            for oref in self._optimizers:
                opt = oref()
                if opt is not None:
                    inst.optimizer_hooks(opt, self._hook_step_pre, self._hook_step_post)
        # Without a given optimizer, any optimizer stepping may be ours (global hooks, filtered). With one, another
        # optimizer built later over the watched models (re-created to resume, or each round) must be seen too:
        # global hooks that leave the given ones to their own.
        if not self._optimizers:
            inst.optimizer_hooks(None, self._hook_step_pre, self._hook_step_post)
        elif self._models:
            inst.optimizer_hooks(None, *self._other_optimizer_hooks())
        inst.patch("torch.autograd.backward", self._mw_backward)
        if torch.distributed.is_available():
            inst.patch("torch.distributed.destroy_process_group", remember_rank)
        inst.patch("torch.compile", self.compile.mw_compile)
        inst.patch("torch.nn.Module.compile", self.compile.mw_module_compile)
        _hooks.eager_frames()
        if not self._models:  # the global hooks fire for torch.compile's wrapper too; guard counts it once
            inst.ignore_warning(r"Using `torch\.compile\(module\)` when there are global hooks on modules")
        by_target: Dict[str, List[str]] = {}  # one wrapper layer per target, whatever the number of checks on it
        for ev, target in router.patch_targets().items():
            by_target.setdefault(target, []).append(ev)
        for target, evs in by_target.items():
            try:
                inst.patch(target, router.patch_middleware(tuple(evs), self._accepts_quietly, self._tls, self.meter))
            except (AttributeError, ImportError, ValueError):
                pass  # a target this torch version lacks (private hooks points): the check does without
        # a model's own attributes too (a LightningModule's `self.loss_fn = F.cross_entropy`, set in __init__)
        _hooks.rebind_aliases([vars(m) for m in self.watched.models])
        inst.on_copy = self._note_copy
        inst.process_exit(self)

    def _on_register(self, parent: nn.Module, name: str, module: Any) -> None:
        """A module added to a watched one mid-run (progressive growing, a new head): named by its path,
        and hooked under a model guard like the layers that were there at the start."""
        if not isinstance(module, nn.Module):
            return
        added = self.watched.name_added(parent, name, module)
        if added and self._models and not any(_watched.is_compiled(m) or getattr(m, "_compiled_call_impl", None)
                                              is not None for m in self.watched.models):
            # (not inside a compiled model: dynamo would trace guard's hooks)
            for mod in added:
                if not isinstance(mod, torch.jit.ScriptModule):
                    handles = self._installer.module_hooks(mod, self._hook_pre, self._hook_post)
                    self._mod_handles.setdefault(id(mod), (handles[0], handles[-1]))

    def _note_copy(self, module: nn.Module) -> None:
        """A watched model is copied or pickled (``copy.deepcopy``, ``torch.save``): where, for a later notice."""
        if self._copied_at is None and any(m is module for m in self.watched.models):
            self._copied_at = user_source(2)

    # ------------------------------------------------------------------ threads
    def _accepts(self) -> bool:
        """Active, and this thread is the one training (patched functions ask at every call)."""
        return self._active and not (self._owner is not None and self._owner[0] != _thread_id() and self._foreign())

    def _accepts_quietly(self) -> bool:
        """`_accepts` for the patched functions (losses, DataLoader iteration): another thread calling them (a
        producer thread filling a queue from a DataLoader) is left alone without a notice of training there."""
        return self._active and not (self._owner is not None and self._owner[0] != _thread_id()
                                     and self._foreign(quiet=True))

    def _foreign(self, stepping: bool = False, quiet: bool = False) -> bool:
        """An event from another thread than the one training (whose optimizer steps guard counts; until it
        steps, the first to call a model): ignored while that thread lives. Two threads training at once under
        one guard would mix their steps, and a check of one would read the other's gradients while its
        backward writes them. A thread that steps first takes over from one that only called a model."""
        owner = self._owner
        if owner is None or owner[0] == _thread_id():
            return False
        if stepping and not owner[2] and not _in_torch(owner[0]):
            # the followed thread only called a model and is not in torch now (it waits: a shape check before
            # starting the training thread): the thread that steps takes over, with nothing of the other's
            # under way
            self._owner = (_thread_id(), threading.current_thread(), False)
            return False
        if owner[1].is_alive():
            if not self._told_threads:
                self._told_threads = True
                self.watched.narrow(owner[0])
            if owner[2] and not self._noticed_threads and not quiet:
                self._noticed_threads = True
                self.notice(f"guard: {threading.current_thread().name} runs the model or an optimizer while "
                            f"{owner[1].name} trains: this guard follows {owner[1].name} until it ends and leaves "
                            f"the other threads alone. To watch each, start a guard inside each thread's function.")
            return True
        left = self._left_alone.get(_thread_id())
        if left is threading.current_thread():
            # a thread that trained beside the followed one stays left alone: picked up mid-run, its steps
            # would count on from the ended thread's and its checks would start halfway
            return True
        self._owner = None  # the training thread ended: the next one to step is followed
        if self._told_threads:
            self._told_threads = False
            self.watched.narrow(None)
        return False

    def _skip_pre(self) -> bool:
        """Whether this module call is left alone (another thread is followed); its post hook agrees, even
        when the followed thread changes meanwhile (calls skipped are counted per thread)."""
        tls = self._tls
        n = getattr(tls, "skipping", 0)
        owner = self._owner
        if n or (owner is not None and owner[0] != _thread_id() and self._foreign()):
            tls.skipping = n + 1
            return True
        return False

    def _skip_post(self) -> bool:
        tls = self._tls
        n = getattr(tls, "skipping", 0)
        if n:
            tls.skipping = n - 1
            return True
        return False

    def _own_step(self) -> None:
        owner = self._owner
        if owner is None or not owner[2] or owner[0] != _thread_id():
            self._owner = (_thread_id(), threading.current_thread(), True)

    def _counts_steps(self, opt: torch.optim.Optimizer) -> bool:
        """Whether `opt`'s steps are (or may become) the ones guard counts."""
        primary = self.watched.primary
        return primary is None or primary() is None or primary() is opt

    def _own_call(self) -> None:
        """A model call starts while no thread trains yet: its thread is followed until another steps first."""
        self._owner = (_thread_id(), threading.current_thread(), False)

    # ------------------------------------------------------------------ hooks (hot paths)
    def _hook_pre_global(self, module: nn.Module, args: tuple) -> None:
        if self._skip_pre():
            return
        t0 = _clock()
        frame = _hooks.caller_frame()
        depth = push_call(self._tls, frame)
        if depth == 0 and isinstance(module, _PARAM_READ):  # a weight read outside the model: its calls are
            self._tls.calls.pop()                           # left alone, as another thread's are
            self._tls.skipping = 1
            return
        # A call that starts inside backward() is a recomputation (torch.utils.checkpoint), never a model
        # call of the user's: its layers are checked, but it is no outermost call (no saved-tensor hooks of
        # guard above checkpoint's own, no forward counted against the next backward).
        root = depth == 0 and _task_id() == -1
        if root:
            try:
                if module not in self._paths_weak:
                    self.watched.adopt_root(module, frame)
                    self.room.note(module)
                self._enter_root(module)
            except GuardError:
                raise
            except Exception as exc:  # guard's own bookkeeping must never fail the user's forward
                self.contain(None, exc)
        # (inside vmap/grad the values are functorch's wrapped tensors, which checks must not keep: as for patches)
        if self.router.forward_pre and self._active and not in_transform():
            self.router.dispatch_forward_pre(module, args, {}, root)
        self.meter.own += _clock() - t0

    def _enter_root(self, module: nn.Module) -> None:
        """An outermost model call starts: remember where it came from."""
        if self._backward_pending and self._active:
            # first: ending the step (no optimizer) resets the step's forward count, this call counts after it
            self._advance_backward_step()
        if self._owner is None and torch.is_grad_enabled():  # a shape check or evaluation trains nothing
            self._own_call()
        if not self.watched.primary_called:
            self.watched.note_call(module)
        self.room.make()
        tls = self._tls
        tls.root_source = tls.model_source = user_source(3)
        tls.forwards = getattr(tls, "forwards", 0) + 1
        self._fresh_step = False

    def _hook_pre(self, module: nn.Module, args: tuple, kwargs: Optional[dict] = None) -> None:
        # (without kwargs: a copy of this hook registered plainly on a module swapped in for a watched one, as
        # torch.ao's prepare_qat/convert do; the post hook below takes that call form too)
        if self._skip_pre():
            return
        t0 = _clock()
        if id(module) in self._root_ids:
            is_root = _task_id() == -1  # (see _hook_pre_global)
            self._root_seen = True
            if self._standins:
                push_call(self._tls, _hooks.caller_frame())
        elif self._standins or not self._root_seen:
            is_root = self._standin(module, _hooks.caller_frame())
        else:
            is_root = False
        if is_root:
            self._enter_root(module)
        if self.router.forward_pre and self._active and not in_transform():
            self.router.dispatch_forward_pre(module, args, kwargs or {}, is_root)
        self.meter.own += _clock() - t0

    def _standin(self, module: nn.Module, frame: Any) -> bool:
        """Whether this call of a watched layer is an outermost call that stands in for its model's.

        A model that is a container (``nn.ModuleDict`` of an encoder and a decoder) or a wrapper whose
        parts the loop calls itself (``m.head(m.encoder(x))``) is never called: the layers called
        outside any call of it, before it is ever called, take its place as model calls (inputs and
        outputs screened, the step's forwards counted). Once chosen, such a layer is a model call
        whenever it is called outside every other one (calls in flight are kept per thread).
        """
        mid = id(module)
        if mid not in self._standins:
            if self._root_seen or mid in self.watched.module_ids.data or _task_id() != -1 or not self._active \
                    or isinstance(module, _PARAM_READ):
                return False
            if push_call(self._tls, frame):  # nested in another stand-in's call
                self._tls.calls.pop()
                return False
            self._standins.add(mid)
            return True
        return push_call(self._tls, frame) == 0 and _task_id() == -1

    def _hook_post_global(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = _NO_OUTPUT) -> None:
        if self._skip_post():
            return
        if output is _NO_OUTPUT:  # forward raised: torch calls always_call global hooks as (module, args, result)
            kwargs, output = {}, kwargs
        self._after_forward(module, args, kwargs, output, pop_call(self._tls) and _task_id() == -1)

    def _hook_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = _NO_OUTPUT) -> None:
        if self._skip_post():
            return
        if output is _NO_OUTPUT:  # a plain (module, args, output) call: see _hook_pre
            kwargs, output = {}, kwargs
        mid = id(module)
        if mid in self._root_ids:
            if self._standins:
                pop_call(self._tls)
            is_root = _task_id() == -1
        else:
            is_root = mid in self._standins and pop_call(self._tls) and _task_id() == -1
        self._after_forward(module, args, kwargs, output, is_root)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, is_root: bool) -> None:
        if not self._active:
            return
        t0 = _clock()
        first = id(module) not in self.watched.module_ids.data
        if first:
            self.watched.record_module(module, output, self.record)
        if in_transform():  # (see _hook_pre_global: a call inside vmap/grad is seen, not checked)
            self.meter.own += _clock() - t0
            return
        r = self.router
        handlers = r.forward if is_root else r.layer_handlers(r.post_for, r.all_forward, module)
        try:
            if handlers:
                r.dispatch_forward(handlers, module, args, kwargs, output, is_root)
            if first and not is_root and output is not None:
                # A layer no check keeps loses its hooks (model mode): torch's hook-free speed from now on.
                keep_pre, keep_post = self.router.settle(module, output)
                handles = self._mod_handles.get(id(module))
                if handles is not None and id(module) not in self._root_ids and id(module) not in self._standins:
                    if handles[0] is not None and not keep_pre:
                        handles[0].remove()
                    if not keep_post:
                        handles[1].remove()
        finally:
            self.meter.own += _clock() - t0

    def _other_optimizer_hooks(self) -> Tuple[Callable, Callable]:
        """Step hooks for optimizers not given to guard (the given ones have their own)."""
        given = {id(o): r for r in self._optimizers if (o := r()) is not None}

        def mine(opt: torch.optim.Optimizer) -> bool:
            r = given.get(id(opt))
            return r is not None and r() is opt

        def pre(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
            return None if mine(opt) else self._hook_step_pre(opt, args, kwargs)

        def post(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            if not mine(opt):
                self._hook_step_post(opt, args, kwargs)
        return pre, post

    def _watches_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        known, became = self.watched.watch_optimizer(opt, early=self.step < EARLY_STEPS)
        if became is not None:
            if became and self.step:
                self._renumber_to_first_step()
            self._backward_pending = False
        return known

    def _renumber_to_first_step(self) -> None:
        """The first optimizer step arrives after several backward() calls (gradient accumulation
        under a global guard): they were all part of step 0, not steps of their own."""
        self.step = 0
        self.sampling = True
        self.record.restart_at_step_zero()

    def _hook_step_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        if not self._active:
            return None
        owner = self._owner
        self._tls.step_skip = skip = (owner is not None and owner[0] != _thread_id()
                                      and self._foreign(stepping=self._counts_steps(opt)))
        if skip:
            self._left_alone[_thread_id()] = threading.current_thread()
        if skip or not self._watches_optimizer(opt):
            return None
        if self._lagging is not None:  # the step of a trailing optimizer raised: its post hook never came
            self._lagging, self.step = None, self.step + 1
        if self._fresh_step and self.step and not self.is_primary(opt):
            # `opt_a.step(); opt_b.step()`: an optimizer stepping right after the one steps are counted by, with
            # no forward or backward between, updates from that same step's gradients: it belongs to that step.
            self._lagging, self.step = opt, self.step - 1
        # torch passes the bound call's args: (optimizer, closure?) — the optimizer first.
        closure = args[1] if len(args) > 1 and args[0] is opt else (args[0] if args and args[0] is not opt else kwargs.get("closure"))
        if callable(closure) and not getattr(closure, "_guard_closure", False):
            return self._wrap_closure(opt, closure, args, kwargs)
        self._before_update(opt)
        return None

    def _wrap_closure(self, opt: torch.optim.Optimizer, closure: Callable, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(closure)``: the closure's forward and backward belong to the step it serves.

        The step's pre-update work (``step_pre`` and the resolution of the closure's screens) runs
        after the closure's first call, before the optimizer applies anything, so a NaN input is
        reported as such and ``mode="raise"`` stops before the update. Later calls (LBFGS line
        search) are resolved each in turn.
        """
        calls = [0]

        def guarded_closure(*a: Any, **k: Any) -> Any:
            result = closure(*a, **k)
            calls[0] += 1
            if self._active:
                if calls[0] == 1:
                    self._before_update(opt)
                elif self.is_primary(opt):
                    try:
                        self._resolve()
                    except GuardError:
                        raise
                    except Exception as exc:
                        self.contain(None, exc)
            return result

        guarded_closure._guard_closure = True  # type: ignore[attr-defined]
        lead = 1 if args and args[0] is opt else 0
        if len(args) > lead:
            return tuple(args[:lead]) + (guarded_closure,) + tuple(args[lead + 1:]), kwargs
        return args, {**kwargs, "closure": guarded_closure}

    def _line_at(self, depth: int) -> Optional[str]:
        """`user_source(depth)`, except through a framework that runs the loop (Lightning calls backward() and step()
        from inside `trainer.fit(...)`, dozens of library frames down): the latest model call's line, in the user's
        training_step, says where instead of the `fit` line."""
        libs: list = []
        line = user_source(depth, libs)
        if libs and libs[0] >= DEEP_LIBRARY:
            model = getattr(self._tls, "model_source", None)
            if model is not None:
                return model
        return line

    def _before_update(self, opt: torch.optim.Optimizer) -> None:
        t0 = _clock()
        try:
            self.dispatch("step_pre", opt)
            if self.is_primary(opt):
                self._resolve()
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)
        finally:
            self.meter.own += _clock() - t0

    def _hook_step_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._active or getattr(self._tls, "step_skip", False) or not self._watches_optimizer(opt):
            return
        t0 = _clock()
        try:
            w = self.watched
            if w.stepped_in.get(id(opt)) != _thread_id():
                w.stepped_in[id(opt)] = _thread_id()
                if self._told_threads:
                    w.narrow(_thread_id())  # threads train at once: this optimizer joins the followed thread's
            self.dispatch("step_post", opt)
            if not self.is_primary(opt):
                # its next step may come before the counted step ends (5 critic steps a generator step, a controller's
                # burst): its gradient norms are computed anew then, not read from this one's cache
                self.staging.forget_grad_norms(opt)
            if self._lagging is not None:
                self._lagging, self.step = None, self.step + 1
            if self.is_primary(opt):
                self.watched.primary_stepped()
                self._own_step()
                self._end_step(t0)
            else:
                n, why = self.watched.takes_over(opt)
                if n:
                    if why == "back":
                        self.notice(f"guard: {type(opt).__name__}, whose steps guard counted before, steps again: "
                                    f"its steps count again (the other optimizer's steps in between were counted "
                                    f"as steps too).")
                    else:
                        why = {"done": "whose models are no longer called (training moved on: the next model, "
                                       "or tensors outside any model)",
                               "replaced": "which no longer steps (replaced by this one, or its part of the "
                                           "training is over) or steps far less often (a policy updated once per "
                                           "20 critic updates)",
                               "successor": "which it replaces (it steps all of that one's parameters, or all of "
                                            "the model's after they were replaced: re-created to resume, or for "
                                            "the next round)"}[why]
                        # A search or k-fold run hands over once per trial: the first few are told, the rest
                        # only kept in the dump (each line is right; thirteen of them are noise).
                        self._handovers += 1
                        if self._handovers == HANDOVERS_TOLD + 1:
                            self.notice("guard: more optimizers take the step count over (a new one per trial, "
                                        "fold or model): they are listed in the report's notices, not here.")
                        self.notice(f"guard: {type(opt).__name__} has stepped {n} times without a step of the "
                                    f"optimizer guard counted steps by, {why}: its steps count from now on"
                                    + (f" (findings of steps {self.step}-{self.step + n - 1} carry step {self.step})"
                                       if n > 1 else "") + ".", console=self._handovers <= HANDOVERS_TOLD)
                    self._resolve()
                    self.step += n - 1  # the steps it made meanwhile count too: numbers follow the loop again
                    self._end_step(t0)
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)

    def skipped_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An AMP ``GradScaler`` skipped ``optimizer.step()`` (inf/NaN grads): end the step without step hooks.

        The step still counts (step numbers follow the training loop) and is marked ``skipped`` in
        the timeline; its scaled, non-finite gradient norms are dropped.
        """
        if not self._active or not self._watches_optimizer(optimizer) or not self.is_primary(optimizer):
            return
        try:
            self.staging.forget_grad_norms(optimizer)
            self.timeline_note(skipped=True)
            self._resolve()
            self._end_step()
        except GuardError:
            raise
        except Exception as exc:
            self.contain(None, exc)

    def _end_step(self, t0: Optional[float] = None) -> None:
        self._tls.forwards = 0  # forwards combined into one loss leave a surplus; a step settles it
        if self.step == 0 and self._models and not self.watched.module_ids and not self.watched.scripted:
            copied = self._copied_at
            if copied is not None and not any(p.grad is not None for o in self.optimizers
                                              for grp in o.param_groups for p in grp["params"]):
                # a copy trained while the optimizer's parameters got nothing (fp32 master weights whose
                # gradients are copied over from a half-precision copy do get them: the generic notice then)
                self.notice(f"guard: optimizer steps ran but no call of the watched model was seen, and the model "
                            f"was copied at {copied} (copy.deepcopy): if the copy is what trains, the optimizer, "
                            f"built over the original's parameters, never updates it. Build the optimizer over the "
                            f"copy's parameters (or train the original), and guard the module that is trained.")
            elif "torch._dynamo" in sys.modules:
                self.notice("guard: optimizer steps ran but no call of the watched model was seen: if it runs "
                            "inside torch.compile (compiled code skips module hooks), guard the compiled module "
                            "instead (`guard(torch.compile(model), opt)`), or, for a compiled function that calls "
                            "the model, call the model outside it; if another module computes the loss (a "
                            "half-precision copy of fp32 master weights), guard that one; until then only "
                            "gradients and parameters are checked, not the inputs, outputs or loss.")
        self.dispatch("step_end", self.step)
        meter = self.meter
        if t0 is not None:
            meter.own += _clock() - t0
        meter.end_step(self.step)
        self.step += 1
        self._fresh_step = True
        self.sampling = self.step % self.config.every == 0
        self.costly_step = meter.costly_step(self.step)
        self.router.wake(self.costly_step)

    def _advance_backward_step(self) -> None:
        """Without an optimizer a backward() ends the step; advance lazily at the next forward/backward."""
        self._backward_pending = False
        if self.watched.primary is None:
            self._end_step()

    def _mw_backward(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        tls = self._tls
        # (another thread's backward of a model this guard does not watch is passed through before the thread
        # test, which would tell of that thread as if it trained this guard's model)
        if (self._models and not self.watched.scripted and not getattr(tls, "forwards", 0)) or not self._accepts() \
                or getattr(tls, "in_backward", False):
            if self._models and not getattr(tls, "in_backward", False):
                self.backwards_elsewhere += 1  # another model's (one re-created after the optimizer was built?)
            return call(*args, **kwargs)
        tensors = args[0] if args else kwargs.get("tensors")
        tls.in_backward = True
        self._fresh_step = False
        t0 = _clock()
        try:
            try:
                if self._backward_pending:
                    self._advance_backward_step()
                tls.root_source = self._line_at(3)
                if self.sampling:
                    self.staging.add_loss(tensors)
                # (Tensor.backward passes retain_graph and create_graph by position: the checks read them by name)
                self.dispatch("backward", tensors, kwargs if len(args) < 4 else
                              {"retain_graph": args[2], "create_graph": args[3], **kwargs})
            except GuardError:
                raise
            except Exception as exc:
                self.contain(None, exc)
            self.meter.own += _clock() - t0
            try:
                result = call(*args, **kwargs)
            except RuntimeError as exc:
                # explained later, once the exception has left the user's `with torch.no_grad():`: the mode it
                # ran under is noted now
                try:
                    exc.guard_grad_enabled = torch.is_grad_enabled()  # type: ignore[attr-defined]
                except Exception:
                    pass
                raise
            t0 = _clock()
            try:
                self.graph_seq = _newest_node(tensors, self.graph_seq)
                if self.first_graph_seq < 0:
                    self.first_graph_seq = self.graph_seq
                self.dispatch("backward_done", tensors, kwargs)
                if self.watched.primary is None:
                    if self.sampling:
                        self._resolve()
                    self._backward_pending = True
            except GuardError:
                raise
            except Exception as exc:
                self.contain(None, exc)
            return result
        finally:
            self.meter.own += _clock() - t0
            tls.in_backward = False
            # A model guard owns a backward only while its model has forwards not yet back-propagated
            # in this thread (two forwards, two backwards: both are ours; another model's: not).
            tls.forwards = max(0, getattr(tls, "forwards", 0) - 1)

