"""The floor of the per-step cost: the least any tool must do per step for the exact screens the contract asks
for, written as plainly as it can be, with none of guard's bookkeeping.

Per step: the model call's input and output screened (one reduction each, in a pre-hook and a hook on the root
module), the loss screened (a patched ``Tensor.backward``, since no hook sees the loss), and the gradients
screened before the update (an optimizer step pre-hook: ``_foreach_norm``, a stack and a sum), then one read
of the four values and a test on the host. It names nothing, keeps no history and runs no other check: what it
costs is a lower bound for guard's fixed cost per step (``instructions_step.py MODEL floor``).
"""
import math

import torch


class Floor:
    """Install with ``Floor(model, opt)``; ``remove()`` takes everything back."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.staged = []
        self.bad = 0
        self.loss = None
        self.handles = [
            model.register_forward_pre_hook(self._pre),
            model.register_forward_hook(self._post),
            opt.register_step_pre_hook(self._step),
        ]
        self._backward = torch.Tensor.backward
        floor = self

        def backward(tensor, *args, **kwargs):
            floor.loss = tensor.detach()
            return floor._backward(tensor, *args, **kwargs)
        torch.Tensor.backward = backward
        self.params = [p for g in opt.param_groups for p in g["params"]]

    def _pre(self, module, args):
        self.staged.append(args[0].sum())

    def _post(self, module, args, out):
        self.staged.append(out.sum())

    def _step(self, opt, args, kwargs):
        grads = [p.grad for p in self.params if p.grad is not None]
        self.staged.append(torch.stack(torch._foreach_norm(grads)).sum())
        if self.loss is not None:
            self.staged.append(self.loss)
        values = [v.item() for v in self.staged]  # on the CPU, reading each is cheaper than stacking them
        self.staged.clear()
        if not all(map(math.isfinite, values)):
            self.bad += 1

    def remove(self):
        for h in self.handles:
            h.remove()
        torch.Tensor.backward = self._backward
