"""Training batches that each hold one class: a dataset sorted by label behind a DataLoader with
``shuffle=False``.

Each step then trains on one class only; the model follows the last class it
saw and the loss curve looks like a saw. Observed through declared patches of
``DataLoader.__iter__`` (shared with the ``batchnorm`` check) and of the loader
iterator's ``__next__``. Only loaders that iterate in dataset order are
followed: a ``SequentialSampler`` (``shuffle=False``, no sampler given) inside
torch's own ``BatchSampler`` with ``batch_size >= 2`` (or a ``DistributedSampler(shuffle=False)``, a strided one); shuffled loaders, custom
samplers and batch samplers, and iterable-style datasets are never looked at.

Per batch of such a loader, the labels are the second element of an ``(x, y, ...)``
tuple or list, or ``batch["label"|"labels"|"target"|"targets"|"y"]`` of a mapping (a dict,
HF's ``BatchEncoding``), or that field of a dataclass batch, when that is a
1-d integer tensor on the CPU, or a 1-d float one holding whole numbers (BCE's 0/1 targets): a 2-d target (a
language model's next tokens, a tagger's tags), soft float targets (probabilities, smoothed labels) and the targets
of other losses (regression, time series) are not classes and are skipped, and so are batches whose labels are not in those places. And they are labels
only once a classification loss (``cross_entropy``, ``nll_loss``, the two BCE forms) of
that batch takes them as its target (on the CPU: the same values; on an accelerator:
as many): sequence lengths in the labels' place (a length-sorted CTC loader, packed
sequences) or series ids are no labels, and bucketing by length is no sorting by class. ``aminmax`` on the host tells whether
the batch holds a single class. A batch counts as a training batch only when a
``backward()`` follows it before the loader's next batch (validation loaders,
unshuffled on purpose, never count). Reported when, after at least `MIN_BATCHES`
training batches, `FRACTION` of them hold a single class, at least two
different classes fill whole batches (one majority class alone is class
imbalance, not sorting), and that many single-class batches are beyond chance:
with the class frequencies seen so far, a batch of data in random order holds
one class with probability ``q = sum(p_k ** batch_size)`` (a half for two
balanced classes in batches of 2), and the binomial tail of the count must be
below `ALPHA`. A loader is followed for at most `MAX_BATCHES` batches.
Nothing on the device.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any, List, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from .._frames import frame_locals, user_frame
from .base import Check

MIN_BATCHES = 4
FRACTION = 0.5  # of the batches so far: the chance test below tells sorting from luck
MAX_BATCHES = 400
ALPHA = 1e-3  # chance of that many single-class batches from data in random order, below which it is sorting
_LABEL_KEYS = ("label", "labels", "target", "targets", "y")
_CLASS_LOSSES = ("cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits")
_INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _Loader:
    __slots__ = ("name", "source", "seen", "counted", "single", "classes", "lo", "hi", "since", "done", "desc", "ref",
                 "hist", "size")

    def __init__(self, name: Optional[str], source: Optional[str], desc: str):
        self.name, self.source, self.desc = name, source, desc
        self.ref: Any = None  # weakref to the DataLoader
        self.seen = self.counted = self.single = 0
        self.classes: List[int] = []  # labels that filled a whole batch, in order of first sight
        self.lo: Optional[int] = None
        self.hi: Optional[int] = None
        self.since = 0
        self.done = False
        self.hist: dict = {}  # label -> how many samples of the counted batches hold it
        self.size = 0  # the loader's batch size


def _chance(hist: dict, size: int) -> float:
    """Probability that a batch of `size` drawn in random order holds a single class, for these frequencies."""
    total = sum(hist.values())
    return sum((c / total) ** size for c in hist.values()) if total else 1.0


def _tail(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    if q >= 1.0:
        return 1.0
    return min(1.0, sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(k, n + 1)))


def _labels(batch: Any) -> List[torch.Tensor]:
    """The batch's tensors that may be its labels, most likely first (the loss's target tells which one is)."""
    if isinstance(batch, Mapping):  # a dict, or HF's BatchEncoding (a UserDict) from tokenizer.pad/collators
        for k in _LABEL_KEYS:
            t = batch.get(k)
            if isinstance(t, torch.Tensor):
                return [t]
        return []
    if isinstance(batch, (list, tuple)):
        # (x, y) first; then the last (fastai's and wide-and-deep's (cat, cont, y)), then the others
        order = [1, len(batch) - 1] + list(range(2, len(batch) - 1)) if len(batch) >= 2 else []
        out: List[torch.Tensor] = []
        for i in order:
            t = batch[i]
            if isinstance(t, torch.Tensor) and all(t is not o for o in out):
                out.append(t)
        return out
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # a collate_fn's Batch(x=..., y=...)
        for k in _LABEL_KEYS:
            t = getattr(batch, k, None)
            if isinstance(t, torch.Tensor):
                return [t]
    return []


def _name_of(loader: Any, depth: int = 3) -> Optional[str]:
    f = user_frame(depth)
    if f is None:
        return None
    for scope in (frame_locals(f), f.f_globals):
        for k, v in list(scope.items()):
            if v is loader and not k.startswith("_"):
                return k
    return None


class UnshuffledLabels(Check):
    name = "unshuffled-labels"
    kinds = {"unshuffled-labels": ("warning", "training batches each hold one class (dataset sorted by label, "
                                              "shuffle=False)")}
    description = "training batches that each hold one class: a label-sorted dataset with shuffle=False"
    patches = {"dataloader_iter": "torch.utils.data.DataLoader.__iter__",
               "dataloader_next": "torch.utils.data.dataloader._BaseDataLoaderIter.__next__",
               # the same events as loss-fn's and loss-constant's: one dispatch per loss call for all
               **{fn: f"torch.nn.functional.{fn}" for fn in _CLASS_LOSSES}}

    def __init__(self, guard):
        super().__init__(guard)
        self._loaders: "weakref.WeakKeyDictionary[Any, _Loader]" = weakref.WeakKeyDictionary()
        self._iters: "weakref.WeakKeyDictionary[Any, _Loader]" = weakref.WeakKeyDictionary()
        self._pending: Optional[tuple] = None  # (loader state, single class?, label) of the latest batch
        self._weights_told = False

    def on_dataloader_iter_done(self, args, kwargs, result):
        loader = args[0] if args else None
        st = self._loaders.get(loader) if loader is not None else None
        if st is None:
            bs = getattr(loader, "batch_sampler", None)
            if type(bs) is BatchSampler and type(bs.sampler) is WeightedRandomSampler:
                self._weighted(loader, bs.sampler)
            sampler = getattr(bs, "sampler", None)
            # a DistributedSampler(shuffle=False) is a strided SequentialSampler: the validation sampler's setting
            # copied into training (the rank's share of a sorted dataset is sorted too)
            dist = type(sampler) is DistributedSampler and not sampler.shuffle
            if (type(bs) is not BatchSampler or (type(sampler) is not SequentialSampler and not dist)
                    or not isinstance(bs.batch_size, int) or bs.batch_size < 2
                    or isinstance(getattr(loader, "dataset", None), IterableDataset)):
                return
            ds = loader.dataset
            try:
                size = f" of {len(ds)}"
            except Exception:
                size = ""
            desc = (f"DistributedSampler(shuffle=False) over {type(ds).__name__}{size}, batch_size={bs.batch_size}"
                    if dist else
                    f"shuffle=False: SequentialSampler over {type(ds).__name__}{size}, batch_size={bs.batch_size}")
            # The loader's variable name is looked up only when reporting: reading a frame's f_locals keeps a
            # snapshot of its variables alive (Python < 3.13), which would hold the user's model and optimizer.
            st = self._loaders[loader] = _Loader(None, self.g.source(), desc)
            st.ref = weakref.ref(loader)
            st.size = bs.batch_size
        if not st.done and result is not None:
            self._iters[result] = st

    def _weighted(self, loader: Any, sampler: WeightedRandomSampler) -> None:
        """A WeightedRandomSampler with fewer weights than the dataset has samples draws only from the first ones:
        one weight per class given where one per sample was meant (`WeightedRandomSampler(class_w, len(y))`)."""
        if self._weights_told:
            return
        try:
            n, k = len(loader.dataset), len(sampler.weights)
        except Exception:
            return
        if not 2 <= k < n:
            return
        self._weights_told = True
        self.emit("unshuffled-labels", "DataLoader",
                  f"the DataLoader's WeightedRandomSampler has {k} weights for a dataset of {n} samples: it draws "
                  f"indices from range({k}) only, so every batch repeats the dataset's first {k} samples (one class, "
                  f"if the dataset is sorted by label), and the other {n - k} are never seen: one weight per class was "
                  f"given where one per sample is meant",
                  "Give every sample its class's weight: WeightedRandomSampler(class_weights[labels], "
                  "num_samples=len(labels), replacement=True), with labels the dataset's label per sample.",
                  source=self.g.source(), details={"sampler": "WeightedRandomSampler", "weights": k, "dataset": n})

    def on_dataloader_next_done(self, args, kwargs, result):
        st = self._iters.get(args[0]) if args else None
        if st is None or st.done:
            return
        st.seen += 1
        if st.seen > MAX_BATCHES:
            st.done = True
            return
        cands = [y for y in _labels(result) if y.dim() == 1 and (y.dtype in _INT or y.dtype in _FLOAT)
                 and y.numel() >= 2 and y.device.type == "cpu"]
        self._pending = (st, cands, [None]) if cands else None

    def _target(self, args: tuple, kwargs: dict) -> None:
        """A classification loss of this batch: which of the batch's candidate labels is its target? (Sequence
        lengths or ids in the label's place never are: a length-sorted CTC or packed-sequence loader is no sorted
        dataset.)"""
        pending = self._pending
        if pending is None or pending[2][0] is not None:
            return
        t = args[1] if len(args) > 1 else kwargs.get("target")
        if not isinstance(t, torch.Tensor):
            return
        for i, y in enumerate(pending[1]):
            if t.numel() != y.numel():
                continue
            if t.device.type == "cpu":  # on an accelerator the target is a copy: its size is what can be told
                try:
                    if not torch.equal(t.detach().reshape(-1).to(y.dtype), y):
                        continue
                except Exception:
                    continue
            pending[2][0] = i
            return

    def on_cross_entropy(self, args: tuple, kwargs: dict) -> None:
        self._target(args, kwargs)

    on_nll_loss = on_binary_cross_entropy = on_binary_cross_entropy_with_logits = on_cross_entropy

    def on_backward(self, tensors, kwargs):
        pending, self._pending = self._pending, None
        if pending is None or pending[2][0] is None:
            return  # no classification loss took these labels as its target
        st, y = pending[0], pending[1][pending[2][0]]
        if st.done:
            return
        if y.dtype in _FLOAT:
            # float 0/1 targets, as BCE takes them (or class indices stored as floats): classes when whole numbers;
            # soft targets (probabilities, smoothed labels) are not counted
            if not bool((y == y.round()).all()):
                return
            y = y.long()
        lo, hi = torch.aminmax(y)
        lo, hi = int(lo), int(hi)
        single = lo == hi
        if st.counted == 0:
            st.since = self.g.step
        st.counted += 1
        st.lo = lo if st.lo is None else min(st.lo, lo)
        st.hi = hi if st.hi is None else max(st.hi, hi)
        hist = st.hist
        if single:
            st.single += 1
            if lo not in st.classes:
                st.classes.append(lo)
            hist[lo] = hist.get(lo, 0) + y.numel()
        else:
            labels, counts = torch.unique(y, return_counts=True)
            for label, c in zip(labels.tolist(), counts.tolist()):
                hist[label] = hist.get(label, 0) + c
        if (st.counted >= MIN_BATCHES and st.single >= FRACTION * st.counted and len(st.classes) >= 2
                and _tail(st.single, st.counted, _chance(hist, st.size)) < ALPHA):
            st.done = True
            self._report(st)

    def _report(self, st: _Loader) -> None:
        loader = st.ref() if st.ref is not None else None
        if st.name is None and loader is not None:
            st.name = _name_of(loader, 2)
        name = f"`{st.name}`" if st.name else "a DataLoader"
        where = st.name or "DataLoader"
        at = f" (iterated at {st.source})" if st.source else ""
        filled = ", ".join(map(str, st.classes[:8])) + (", ..." if len(st.classes) > 8 else "")
        q = _chance(st.hist, st.size)
        self.emit("unshuffled-labels", where,
                  f"{name}{at} gives training batches that each hold one class: {st.single} of the first "
                  f"{st.counted} batches hold a single class (labels {st.lo}-{st.hi} seen so far; classes "
                  f"{filled} each fill whole batches; shuffled, {_expected(q * st.counted)} would), with "
                  f"{st.desc}: the dataset is sorted by label, so each step "
                  f"trains on one class and the model follows the last class it saw",
                  ("Shuffle the training data: DistributedSampler(dataset, shuffle=True) (its default), with "
                   "sampler.set_epoch(epoch) at every epoch. Keep shuffle=False for validation only."
                   if st.desc.startswith("Distributed") else
                   "Shuffle the training data: DataLoader(dataset, batch_size=..., shuffle=True) (or a RandomSampler; "
                   "DistributedSampler(shuffle=True) under DDP). Keep shuffle=False for validation only."),
                  step=st.since, seen=self.g.step, source=st.source,
                  details={"loader": st.name, "single_class_batches": st.single, "batches": st.counted,
                           "classes_filling_batches": st.classes[:20], "label_range": [st.lo, st.hi],
                           "sampler": "DistributedSampler" if st.desc.startswith("Distributed") else "SequentialSampler",
                           "chance_single_class": q})


def _expected(n: float) -> str:
    """How many single-class batches shuffling would give, in words ("almost none" rather than "about 0.0")."""
    return "almost none" if n < 0.5 else f"about {n:.1f}"
