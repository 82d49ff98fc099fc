"""BatchNorm and batches of one: the crash itself, and its prediction from the DataLoader.

* Reactive (``batchnorm-single-sample`` [error]): a ``_BatchNorm`` in training
  mode is about to get one value per channel (batch 1, or batch 1 x spatial 1);
  reported from its forward pre-hook, before PyTorch's "Expected more than 1
  value per channel when training".
* Predictive (``batchnorm-last-batch`` [warning]): at ``iter(loader)`` (epoch
  start) a loader whose sampler length leaves a last batch of 1 with
  ``drop_last=False`` is noted; the warning is given at the end of the next
  forward pass of the model if a BatchNorm trained on inputs with one value per
  sample per channel (``BatchNorm1d`` on ``(N, C)``, or spatial size 1) - those
  are the ones that will crash. A ``BatchNorm2d`` on feature maps survives a
  batch of 1 and gets no warning.
* Small batches (``batchnorm-single-sample`` with severity ``info``, where
  ``"input"``): the first training batch a BatchNorm sees has fewer than
  `SMALL_BATCH` samples, so its statistics are noisy.

Cost: host-only; one dict lookup per module call, shape arithmetic for BatchNorm calls.
"""
from __future__ import annotations

import linecache
import math
import re
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import BatchSampler

from .._frames import user_frame
from ._notes import NOTE_PREFIX, add_guard_note
from .base import Check

_SIZE = r"(?:\.size\(\s*0?\s*\)(?:\[\s*0\s*\])?|\.shape\[\s*0\s*\]|\blen\(\s*(?!sys\.argv)[\w.\[\]'\"]+\s*\))"
#: a loop that handles a short last batch itself: skips batches of one, or stops before the loader's last batch
_SKIPS_SMALL = re.compile(
    _SIZE + r"\s*(?:<=?|==|!=)\s*[12]\b"
    + r"|\b[12]\s*(?:>=?|==|!=)\s*" + _SIZE
    + r"|\bislice\(|\bzip\(\s*range\(")

SMALL_BATCH = 4
FIX = ("drop the incomplete last batch with `DataLoader(..., drop_last=True)` (`BatchSampler(..., drop_last=True)` "
       "for a loader given `batch_sampler=`), use a batch size that does not leave a single sample, or replace "
       "BatchNorm with GroupNorm/LayerNorm, which do not depend on the batch")
# a loader given `batch_sampler=` refuses DataLoader's drop_last: the fix goes to the BatchSampler
FIX_SAMPLER = ("drop the incomplete last batch with `BatchSampler(..., drop_last=True)` (DataLoader's own drop_last "
               "cannot be combined with batch_sampler=), use a batch size that does not leave a single sample, or "
               "replace BatchNorm with GroupNorm/LayerNorm, which do not depend on the batch")


def _training(m: _BatchNorm) -> bool:
    return m.training or (m.running_mean is None and m.running_var is None)


class BatchNormBatch(Check):
    name = "batchnorm"
    kinds = {
        "batchnorm-single-sample": ("error", "a BatchNorm in training mode gets one value per channel"),
        "batchnorm-last-batch": ("warning", "a DataLoader will yield a final batch of 1 to a model with BatchNorm"),
    }
    description = "BatchNorm fed one value per channel in training (caught first, and predicted from the DataLoader)"
    patches = {"dataloader_iter": "torch.utils.data.DataLoader.__iter__"}

    def watches(self, module) -> bool:
        return isinstance(module, _BatchNorm)  # other layers only matter as the root call

    def __init__(self, guard):
        super().__init__(guard)
        self._bn: Dict[type, bool] = {}  # module type -> is a BatchNorm
        self._first: set = set()  # BatchNorm paths whose first training batch was looked at
        self._pending: List[Dict[str, Any]] = []  # loader predictions waiting for the next forward pass
        self._crashy: Dict[str, Tuple[int, ...]] = {}  # BatchNorms that trained on one value/sample/channel, this pass
        self._has_bn: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
        self._handled: Dict[int, Tuple[Any, bool]] = {}  # id(code) -> (code, whether it handles a short last batch)
        # the last single-sample error (path, step, the model's batch when the forward pooled it), for the note
        self._note: Optional[Tuple[str, int, Optional[int]]] = None
        self._root_batch: Optional[int] = None  # the batch size of the model call under way
        # (batch size, samples) of the last loader iterated whose batches are never of one sample: a batch of one
        # after it was made by the code (a per-sample loop over the loader's batch), not by the loader
        self._no_single: Optional[Tuple[int, int]] = None
        self._loader_bs: Optional[int] = None  # the batch size of the last loader iterated

    # ------------------------------------------------------------------ per module call
    def on_forward_pre(self, module, path, args, kwargs, is_root):
        if is_root:
            x = args[0] if args else None
            self._root_batch = x.shape[0] if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() >= 1 else None
        is_bn = self._bn.get(type(module))  # by type: one dict lookup per module call
        if is_bn is None:
            is_bn = self._bn[type(module)] = issubclass(type(module), _BatchNorm)
        if not is_bn:
            return
        if not _training(module):
            if self._pending and not is_root and not torch.is_grad_enabled():
                # the loader just iterated feeds a BatchNorm in eval mode (features extracted from part of the model,
                # `model.backbone(x)`, for a k-NN evaluation): its short last batch is no training batch
                self._pending = []
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return
        shape = tuple(x.shape)
        n, spatial = shape[0], math.prod(shape[2:])
        if n * spatial == 1:
            rb = self._root_batch
            pooled = n == 1 and rb is not None and rb > 1
            self._note = (path, self.g.step, rb if pooled else None)
            if pooled:
                hint = (f"The model got a batch of {rb} samples but this BatchNorm gets 1: its forward reduces the "
                        f"batch dimension before it (x.mean(0, keepdim=True) or x.sum(0) pools over the samples; a "
                        f"view/reshape can move them into other dimensions). Reduce over the dimension you mean "
                        f"(x.mean(1) for features), or normalise with LayerNorm/GroupNorm after pooling over samples.")
            elif self._no_single is not None:
                bs, total = self._no_single
                hint = (f"The loader's batches hold {bs} samples ({total} samples: no last batch of one), so this "
                        f"batch of one was made by your code, a per-sample loop over the batch (x[i:i + 1]) such as an "
                        f"attack or saliency pass: run that pass on the whole batch at once, or with model.eval() "
                        f"around it (model.train() after), so that BatchNorm uses its running statistics.")
            else:
                hint = (f"A batch of one sample reached BatchNorm during training: {FIX}; for single-sample "
                        f"inference call `model.eval()` first.")
            self.emit("batchnorm-single-sample", path,
                      f"{path} ({type(module).__name__}) is in training mode and gets an input of shape {shape}: "
                      f"one value per channel, so no batch statistics exist; PyTorch would fail with "
                      f"'Expected more than 1 value per channel when training'",
                      hint, source=self.g.root_source,
                      details={"module": type(module).__name__, "input_shape": list(shape), "model_batch": rb,
                               **({"loader_batch": self._no_single[0]} if self._no_single and not pooled else {})})
            return
        if spatial == 1:
            self._crashy[path] = shape
        if path not in self._first:
            self._first.add(path)
            if n < SMALL_BATCH:
                per = f", {n * spatial} values per channel" if spatial > 1 else ""
                self.emit("batchnorm-single-sample", "input",
                          f"{path} ({type(module).__name__}) trains on batches of {n} sample(s) (input {shape}{per}): "
                          f"its batch statistics follow each batch's few samples, and the running estimates that "
                          f"eval mode uses are noisy",
                          (f"The loader's batches hold {self._loader_bs} samples, so batches of {n} come from your code, a "
                           f"per-sample (or per-few) loop over the batch such as an attack or saliency pass: run it on "
                           f"the whole batch at once, or under model.eval() (model.train() after)."
                           if self._loader_bs is not None and self._loader_bs >= SMALL_BATCH and n < self._loader_bs
                           and self._root_batch == n else
                           "Use a larger batch (16 or more per device is typical for BatchNorm), SyncBatchNorm across "
                           "devices, or GroupNorm/LayerNorm, which do not depend on the batch size."),
                          severity="info", source=self.g.root_source,
                          details={"module": path, "batch_size": n, "input_shape": list(shape),
                                   "threshold": SMALL_BATCH})

    def on_exception(self, exc):
        """PyTorch's own error for the batch of one escapes: point it at the finding (and keep explain quiet)."""
        if self._note is not None and isinstance(exc, ValueError) and "more than 1 value per channel" in str(exc):
            path, step, pooled = self._note
            self._note = None
            if pooled:  # the model's batch was larger: the forward pooled it away before this BatchNorm
                add_guard_note(exc, f"{NOTE_PREFIX}batchnorm-single-sample at {path} (step {step}): the model got a "
                                    f"batch of {pooled} samples, but its forward reduced the batch dimension before "
                                    f"this BatchNorm\n  fix: reduce over the dimension you mean (x.mean(1) for "
                                    f"features, not x.mean(0, keepdim=True)), or normalise with LayerNorm/GroupNorm "
                                    f"after pooling over samples")
                return
            if self._no_single is not None:
                add_guard_note(exc, f"{NOTE_PREFIX}batchnorm-single-sample at {path} (step {step}): a batch of one "
                                    f"sample reached BatchNorm in training mode, though the loader's batches hold "
                                    f"{self._no_single[0]}: your code made it (a per-sample loop, x[i:i + 1])\n  fix: "
                                    f"run that pass on the whole batch, or under model.eval() (model.train() after)")
                return
            add_guard_note(exc, f"{NOTE_PREFIX}batchnorm-single-sample at {path} (step {step}): a batch of one "
                                f"sample reached BatchNorm in training mode\n  fix: {FIX}")

    def on_forward(self, module, path, args, kwargs, output, is_root):
        if not is_root:
            return
        pending, crashy = self._pending, self._crashy
        self._crashy = {}
        if not pending:
            return
        self._pending = []
        if crashy:
            for p in pending:
                # Only a BatchNorm whose batch dimension is the loader's samples gets one value per channel
                # from a last batch of one: nodes of a graph batch or flattened time steps are not samples.
                mine = {path: shape for path, shape in crashy.items() if shape[0] == p["batch_size"]}
                if mine:
                    self._report_last_batch(p, mine)

    # ------------------------------------------------------------------ DataLoader epochs
    def on_dataloader_iter(self, args, kwargs):
        loader = args[0] if args else None
        bs_sampler = getattr(loader, "batch_sampler", None)
        self._no_single = self._loader_bs = None
        if type(bs_sampler) is not BatchSampler:  # a custom batch sampler decides its own batch sizes
            return
        bs, drop = bs_sampler.batch_size, bs_sampler.drop_last
        self._loader_bs = bs if isinstance(bs, int) else None
        if not isinstance(bs, int) or bs < 2:
            return
        try:
            n = len(bs_sampler.sampler)
        except TypeError:  # iterable-style dataset: length unknown
            return
        if drop or n % bs != 1:
            self._no_single = (bs, n) if n > 1 else None
            return
        models = self.g.models
        if models and not any(self._model_has_bn(m) for m in models):
            return
        if self._handles_small_batches(user_frame(2)):
            return
        try:
            size: Optional[int] = len(loader.dataset)
        except Exception:
            size = None
        if len(self._pending) < 16:
            self._pending.append({"samples": n, "dataset_size": size, "batch_size": bs, "batches": n // bs + 1,
                                  "sampler": type(bs_sampler.sampler).__name__, "step": self.g.step,
                                  "source": self.g.source(),
                                  # DataLoader(batch_sampler=...) leaves its own batch_size None
                                  "batch_sampler_given": getattr(loader, "batch_size", 0) is None})

    def _handles_small_batches(self, frame: Any) -> bool:
        """Whether the code iterating the loader deals with a short last batch itself: it skips small batches
        (``if x.size(0) < 2: continue``) or stops before the last one (``islice(loader, len(loader) - 1)``,
        ``zip(range(n), loader)``). Read once per function from its source."""
        if frame is None:
            return False
        code = frame.f_code
        hit = self._handled.get(id(code))
        if hit is not None and hit[0] is code:
            return hit[1]
        lines = linecache.getlines(code.co_filename)
        numbers = [ln for _, _, ln in code.co_lines() if ln is not None]
        text = "".join(lines[code.co_firstlineno - 1:max(numbers, default=code.co_firstlineno)])
        text = re.sub(r"#[^\n]*", "", text)
        found = bool(_SKIPS_SMALL.search(text))
        if len(self._handled) > 256:
            self._handled.clear()
        self._handled[id(code)] = (code, found)
        return found

    def _model_has_bn(self, model) -> bool:
        hit = self._has_bn.get(model)
        if hit is None:
            hit = any(isinstance(m, _BatchNorm) for m in model.modules())
            self._has_bn[model] = hit
        return hit

    def _report_last_batch(self, p: Dict[str, Any], crashy: Dict[str, Tuple[int, ...]]) -> None:
        n, bs = p["samples"], p["batch_size"]
        names = list(crashy)
        size = p["dataset_size"]
        what = f"{n} samples" if size in (None, n) else f"{n} samples from its {p['sampler']} (dataset of {size})"
        alt = next((b for d in range(1, bs) for b in (bs + d, bs - d) if b > 1 and n % b != 1), None)
        given = p.get("batch_sampler_given")
        setting = (f"BatchSampler(batch_size={bs}, drop_last=False) given as batch_sampler=" if given
                   else f"batch_size={bs}, drop_last=False")
        self.emit("batchnorm-last-batch", "input",
                  f"this DataLoader ends every epoch with a batch of 1: {what}, {setting} "
                  f"-> {n // bs} full batches and a last batch of 1 sample; BatchNorm {', '.join(names[:3])} "
                  f"{'trains' if len(names) == 1 else 'train'} on one value per sample per channel and "
                  f"will fail at batch {n // bs + 1} of the epoch with 'Expected more than 1 value per channel "
                  f"when training'",
                  f"Fix before the epoch ends: {FIX_SAMPLER if given else FIX}"
                  + (f" (e.g. batch_size={alt})." if alt else "."),
                  step=p["step"], source=p["source"],
                  details={"dataset_size": size, "samples_per_epoch": n, "batch_size": bs, "last_batch_size": 1,
                           "batches_per_epoch": p["batches"], "sampler": p["sampler"], "batchnorm_modules": names,
                           "suggested_batch_size": alt})
