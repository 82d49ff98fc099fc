"""`wrap`: a module that runs the model under a started guard, transparently."""
from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn

from .config import ConfigError
from .session import Guard

# Set on the wrapper itself, never passed to the model: its own call machinery (compile(), backward hooks).
_OWN = frozenset({"_guard_model", "guard", "forward", "__class__", "__dict__", "_compiled_call_impl",
                  "_is_full_backward_hook"})
# The model's own tables, shared by the wrapper: register_buffer/register_parameter/add_module,
# get_buffer/get_parameter/get_submodule and state-dict hooks on the wrapper are the model's.
_SHARED = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_state_dict_hooks",
           "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class GuardedModule(nn.Module):
    """Calls the wrapped model under ``self.guard``; everything else passes straight through.

    Unlike ``DataParallel`` there is no ``module.`` prefix: ``state_dict()`` keys,
    ``load_state_dict()``, ``parameters()`` and attribute access are the model's own.
    """

    def __init__(self, model: nn.Module, g: Guard):
        super().__init__()
        object.__setattr__(self, "_guard_model", model)
        object.__setattr__(self, "guard", g)
        for name in _SHARED:
            if name in model.__dict__:
                object.__setattr__(self, name, model.__dict__[name])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._guard_model
        try:
            return model(*args, **kwargs)
        except BaseException as exc:
            self.guard.exception(exc)  # the model's own exception propagates unchanged
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_guard_model"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._guard_model, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN:
            object.__delattr__(self, name)
        else:
            delattr(self._guard_model, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self._guard_model)))

    def __repr__(self) -> str:
        return f"GuardedModule({self._guard_model!r})"

    # A copy or a pickle of the wrapper is the plain model: no guard in it, loadable without guard.
    def __reduce_ex__(self, protocol: Any) -> Any:
        # Rebuilt as ``max((model,))``: the model itself, by a builtin (no guard import on load; a model
        # pickled next to its wrapper stays one object).
        return (max, ((self._guard_model,),))

    def __copy__(self) -> nn.Module:
        return copy.copy(self._guard_model)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        return copy.deepcopy(self._guard_model, memo)

    # containers (Sequential, ModuleList, ModuleDict) index through the wrapper too
    def __getitem__(self, key: Any) -> Any:
        return self._guard_model[key]

    def __len__(self) -> int:
        return len(self._guard_model)

    def __iter__(self):
        return iter(self._guard_model)

    # nn.Module API that would otherwise look at the (empty) wrapper itself
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard_model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard_model.load_state_dict(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._guard_model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self._guard_model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._guard_model.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any):
        return self._guard_model.named_buffers(*args, **kwargs)

    def children(self):
        return self._guard_model.children()

    def named_children(self):
        return self._guard_model.named_children()

    def modules(self):
        return self._guard_model.modules()

    def named_modules(self, *args: Any, **kwargs: Any):
        return self._guard_model.named_modules(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> "GuardedModule":
        # half/double/bfloat16/float/type/to_empty/share_memory/to/cuda all come here: the model's own
        # _apply converts its root-level parameters and buffers too (and runs its overrides, e.g. RNNs').
        self._guard_model._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return self._guard_model.extra_repr()

    def get_extra_state(self) -> Any:
        return self._guard_model.get_extra_state()

    def set_extra_state(self, state: Any) -> None:
        self._guard_model.set_extra_state(state)

    def requires_grad_(self, requires_grad: bool = True) -> "GuardedModule":
        self._guard_model.requires_grad_(requires_grad)
        return self

    def train(self, mode: bool = True) -> "GuardedModule":
        self._guard_model.train(mode)
        return self

    def eval(self) -> "GuardedModule":
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> "GuardedModule":
        self._guard_model.to(*args, **kwargs)
        return self

    def cuda(self, device: Optional[Any] = None) -> "GuardedModule":
        self._guard_model.cuda(device)
        return self

    def cpu(self) -> "GuardedModule":
        self._guard_model.cpu()
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._guard_model.zero_grad(set_to_none)

    def apply(self, fn: Any) -> "GuardedModule":
        self._guard_model.apply(fn)
        return self

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self._guard_model.training

    @training.setter
    def training(self, value: bool) -> None:
        pass  # nn.Module.__init__ sets it; the model's own flag is the truth


def wrap(model: nn.Module, optimizer: Any = None, **options: Any) -> GuardedModule:
    """Return a module that runs `model` under a started guard (``.guard`` holds it; ``.guard.close()`` ends it)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"guard.wrap: model={type(model).__name__} object is not an nn.Module; allowed: an nn.Module")
    g = Guard(model, optimizer, **options).start()
    return GuardedModule(model, g)
