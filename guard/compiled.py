"""The torch.compile boundary: a compiled watched model is checked around its compiled call, never inside.

Hooks inside compiled code are traced by dynamo (they return at once there, see `hooks._eager_only`),
so per-layer hooks would cost without seeing anything. A guarded ``OptimizedModule`` gets hooks on
itself only; ``torch.compile(model)`` of a watched model moves the model's hooks to the wrapper;
``model.compile()`` (before or after the guard starts) is checked around its ``_compiled_call_impl``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from torch import nn

from . import hooks as _hooks
from .watched import is_compiled


class CompileBoundary:
    """Moves a guard's hooks to the boundary of compiled models (one per guard)."""

    def __init__(self, guard: Any, hooks: Dict[str, Callable], handles: Dict[int, Any], installer: Any,
                 model_mode: bool):
        self.g = guard
        self.pre, self.post = hooks["pre"], hooks["post"]
        self.pre_global, self.post_global = hooks["pre_global"], hooks["post_global"]
        self.handles, self.installer, self.model_mode = handles, installer, model_mode

    def root(self, model: nn.Module) -> bool:
        """Whether `model` (a watched model) runs compiled: then only its boundary is hooked."""
        if is_compiled(model):
            self.g.watched.compiled_notice(model)
            return True
        if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile()
            self.g.watched.compiled_notice(model)
            self.wrap_call(model)
            return True
        return False

    def wrap_call(self, module: nn.Module) -> None:
        """After ``module.compile()`` even its own hooks run inside the compiled call: check around it."""
        compiled = module._compiled_call_impl
        if getattr(compiled, "_guard_boundary", None) is self:
            return
        model_mode = self.model_mode

        def boundary(*args: Any, **kwargs: Any) -> Any:
            if model_mode:
                self.pre(module, args, kwargs)
            else:
                self.pre_global(module, args)
            try:
                out = compiled(*args, **kwargs)
            except BaseException as exc:
                if not model_mode:
                    self.post_global(module, args, exc)
                raise
            if model_mode:
                self.post(module, args, kwargs, out)
            else:
                self.post_global(module, args, kwargs, out)
            return out

        boundary._guard_boundary = self  # type: ignore[attr-defined]
        self.installer.attr(module, "_compiled_call_impl", boundary)

    def drop_module_hooks(self, model: nn.Module) -> None:
        """The model is compiled now: its layers' hooks would only be traced, the boundary replaces its own."""
        for mod in model.modules():
            for h in self.handles.pop(id(mod), ()) or ():
                if h is not None:
                    h.remove()

    def mw_compile(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        """``torch.compile(model)`` while guard runs: the wrapper becomes the model's checked boundary."""
        result = call(*args, **kwargs)
        g = self.g
        try:
            orig = getattr(result, "_orig_mod", None)
            if g.active and self.model_mode and is_compiled(result) and id(orig) in g.watched.root_ids:
                g.watched.compiled_notice(result)
                g.watched.paths_by_id[id(result)] = g.path_of(orig)
                g.watched.root_ids.add(id(result))
                self.drop_module_hooks(orig)
                self.installer.module_hooks(result, self.pre, self.post)
            _hooks.eager_frames()
        except Exception as exc:
            g.contain(None, exc)
        return result

    def mw_module_compile(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        """``model.compile()`` while guard runs: check around the compiled call of a watched model."""
        result = call(*args, **kwargs)
        g = self.g
        try:
            module = args[0] if args else None
            if g.active and isinstance(module, nn.Module) and (not self.model_mode or id(module) in g.watched.root_ids):
                g.watched.compiled_notice(module)
                if self.model_mode:
                    self.drop_module_hooks(module)
                self.wrap_call(module)
            _hooks.eager_frames()
        except Exception as exc:
            g.contain(None, exc)
        return result
