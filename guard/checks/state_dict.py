"""state_dict mismatches: explain why ``load_state_dict`` / ``torch.load`` failed, with the exact fix.

While a guard is active, ``nn.Module.load_state_dict`` and ``torch.load`` are
observed (shared, reversible patches). A failing load gets a note on its
exception (``BaseException.add_note``) and a ``state-dict-mismatch`` finding;
the exception itself propagates unchanged. ``strict=False`` loads are reported
only when nothing at all matched (e.g. a ``module.`` prefix), since partial
loads with ``strict=False`` are usually deliberate.

`explain_state_dict` is the same analysis as a plain function.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._frames import variable_naming
from ..findings import Finding, severity_of
from ._notes import NOTE_PREFIX, add_guard_note
from .base import Check

KIND = "state-dict-mismatch"
_PREFIXES = (
    ("module.", "a DataParallel/DistributedDataParallel-wrapped model"),
    ("_orig_mod.", "a torch.compile'd model"),
)
_NBT = "num_batches_tracked"
_MAX_LIST = 8


def _is_lazy(v: Any) -> bool:
    try:
        return bool(nn.parameter.is_lazy(v))
    except Exception:
        return False


def _strip(keys, prefix: str) -> set:
    return {k[len(prefix):] if k.startswith(prefix) else k for k in keys}


def _top(key: str) -> str:
    return key.split(".", 1)[0] if "." in key else "(top level)"


def _group(keys: List[str], model_keys: set) -> List[Dict[str, Any]]:
    """Group keys by their top-level module; say when a group is the whole module."""
    groups: Dict[str, List[str]] = {}
    for k in sorted(keys):
        groups.setdefault(_top(k), []).append(k)
    out = []
    for prefix, ks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        total = sum(1 for m in model_keys if _top(m) == prefix)
        out.append({"prefix": prefix, "count": len(ks), "examples": ks[:3], "whole_module": total == len(ks)})
    return out


def _fmt_groups(groups: List[Dict[str, Any]]) -> str:
    parts = []
    for g in groups[:_MAX_LIST]:
        ex = ", ".join(g["examples"][:2]) + (", ..." if g["count"] > 2 else "")
        parts.append(f"{g['prefix']}.* ({g['count']}: {ex})" if g["prefix"] != "(top level)"
                     else f"{g['count']} top-level key(s) ({ex})")
    if len(groups) > _MAX_LIST:
        parts.append(f"... {len(groups) - _MAX_LIST} more module(s)")
    return "; ".join(parts)


def _pruning(missing: List[str], unexpected: List[str]) -> Optional[Tuple[str, List[str]]]:
    """torch.nn.utils.prune's reparametrization on one side only: ("checkpoint", names) when the checkpoint holds
    ``x_orig`` and ``x_mask`` where the model has ``x``, ("model", names) for the reverse; None otherwise."""
    for way, plain, split in (("checkpoint", missing, unexpected), ("model", unexpected, missing)):
        have = set(split)
        names = [k for k in plain if k + "_orig" in have and k + "_mask" in have]
        if names and all(k in names or k[:-5] in names for k in split) and len(split) == 2 * len(names):
            return way, names
    return None


def _renames(missing: List[str], unexpected: List[str]) -> List[Tuple[str, str]]:
    """Top-level modules whose keys match apart from their name (``classifier.*`` saved, ``fc.*`` expected)."""
    def suffixes(keys):
        d: Dict[str, set] = {}
        for k in keys:
            if "." in k:
                top, rest = k.split(".", 1)
                d.setdefault(top, set()).add(rest)
        return d

    miss, unexp = suffixes(missing), suffixes(unexpected)
    return [(old, new) for old, so in unexp.items() for new, sn in miss.items() if so == sn]


_STATS = ("running_mean", "running_var", _NBT)


def _running_stats(model: nn.Module, missing: List[str], unexpected: List[str], parts: List[str],
                   hints: List[str], details: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """Explain running-statistics keys of BatchNorm/InstanceNorm layers built with another
    ``track_running_stats`` than the checkpoint's; returns the keys left to explain."""
    def norm_layers(keys: List[str], tracking: bool) -> Dict[str, List[str]]:
        found: Dict[str, List[str]] = {}
        for k in keys:
            prefix, _, leaf = k.rpartition(".")
            if leaf not in _STATS:
                continue
            try:
                mod = model.get_submodule(prefix)
            except (AttributeError, ValueError):
                continue
            if isinstance(mod, nn.modules.batchnorm._NormBase) and bool(mod.track_running_stats) == tracking:
                found.setdefault(prefix, []).append(k)
        # num_batches_tracked alone is the PyTorch-version case, explained below
        return {p: ks for p, ks in found.items() if any(not k.endswith(_NBT) for k in ks)}

    def layers(found: Dict[str, List[str]]) -> str:
        names = [f"{p!r} ({type(model.get_submodule(p)).__name__})" if p else
                 f"the model itself ({type(model).__name__})" for p in sorted(found)]
        return ", ".join(names[:_MAX_LIST]) + (" ..." if len(names) > _MAX_LIST else "")

    def drop(found: Dict[str, List[str]]) -> str:
        keys = sorted(k for ks in found.values() for k in ks)
        return (f"state_dict = {{k: v for k, v in state_dict.items() if k not in {keys[:6]!r}"
                f"{'...' if len(keys) > 6 else ''}}}")

    extra = norm_layers(unexpected, tracking=False)
    if extra:
        details["running_stats_unexpected"] = sorted(extra)
        parts.append(f"the checkpoint has running statistics ({', '.join(_STATS)}) for {len(extra)} normalisation "
                     f"layer(s) the model built with track_running_stats=False: {layers(extra)}; the checkpoint was "
                     f"saved from layers with track_running_stats=True")
        hints.append(f"Build these layers with the checkpoint's setting (e.g. nn.BatchNorm2d(C, "
                     f"track_running_stats=True)) to use its statistics in eval(), or drop those keys to keep "
                     f"normalising with batch statistics: {drop(extra)}.")
    absent = norm_layers(missing, tracking=True)
    if absent:
        details["running_stats_missing"] = sorted(absent)
        parts.append(f"the checkpoint has no running statistics for {len(absent)} normalisation layer(s) the model "
                     f"built with track_running_stats=True: {layers(absent)}; the checkpoint was saved from layers "
                     f"with track_running_stats=False")
        hints.append("Build these layers with track_running_stats=False as in the checkpoint; loading with "
                     "strict=False instead would leave running_mean=0, running_var=1, wrong in eval().")
    done = {k for found in (extra, absent) for ks in found.values() for k in ks}
    return [k for k in missing if k not in done], [k for k in unexpected if k not in done]


def _fits(keys: set, exp: set) -> bool:
    return bool(keys & exp) and all(k in exp or k.endswith(_NBT) for k in keys)


def _other_prefix(exp: set, got: set, details: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A prefix other than the wrappers' that maps one side's keys onto the other's: a Lightning checkpoint's `model.`
    (its LightningModule's attribute), a whole model's checkpoint loaded into its submodule, or the reverse."""
    tops = {k.split(".", 1)[0] for k in got if "." in k}
    for top in sorted(tops):
        p = top + "."
        sub = {k[len(p):] for k in got if k.startswith(p)}
        if not _fits(sub, exp) or not exp <= sub | {k for k in exp if k.endswith(_NBT)}:
            continue
        details.update(prefix=p, direction="checkpoint")
        if all(k.startswith(p) for k in got):
            return {"message": (f"every checkpoint key starts with {p!r}, and stripped of it they are the model's "
                                f"keys: the checkpoint was saved from a module holding this model as `{top}` (a "
                                f"LightningModule's `self.{top}`, a wrapper of your own)"),
                    "hint": (f"Strip the prefix: model.load_state_dict({{k.removeprefix({p!r}): v for k, v in "
                             f"state_dict.items()}}); strict=False only hides that nothing is loaded."),
                    "details": details}
        details["other_keys"] = len(got) - len(sub)
        return {"message": (f"the checkpoint is of a larger model: its keys under {p!r} are this module's keys, and "
                            f"{len(got) - len(sub)} other key(s) belong to the rest of that model"),
                "hint": (f"Load the part for this module: module.load_state_dict({{k.removeprefix({p!r}): v for k, v "
                         f"in state_dict.items() if k.startswith({p!r})}}), or load the whole checkpoint into the "
                         f"whole model."),
                "details": details}
    tops = {k.split(".", 1)[0] for k in exp if "." in k}
    for top in sorted(tops):
        p = top + "."
        sub = {k[len(p):] for k in exp if k.startswith(p)}
        if got <= sub | {k for k in got if k.endswith(_NBT)} and got & sub and not any(k.startswith(p) for k in got):
            details.update(prefix=p, direction="model")
            return {"message": (f"the checkpoint's keys are those of this model's `{top}` without its prefix {p!r}: "
                                f"it was saved from that submodule alone, and is loaded into the whole model"),
                    "hint": (f"Load it into the submodule: model.{top}.load_state_dict(state_dict) (or add the "
                             f"prefix: {{{p!r} + k: v for k, v in state_dict.items()}} with strict=False)."),
                    "details": details}
    return None


def analyse(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Optional[Dict[str, Any]]:
    """``{"message", "hint", "details"}`` explaining how `state_dict` differs from `model`, or None if it fits."""
    if not isinstance(state_dict, Mapping):
        return None
    own = model.state_dict()
    exp, got = set(own), set(state_dict)
    details: Dict[str, Any] = {"model": type(model).__name__, "checkpoint_keys": len(got), "model_keys": len(exp)}
    # A prefix on every key: DataParallel/DDP (module.) or torch.compile (_orig_mod.).
    for prefix, origin in _PREFIXES:
        if exp != got and got and all(k.startswith(prefix) for k in got) and not any(k.startswith(prefix) for k in exp):
            stripped = _strip(got, prefix)
            # Stripped, every checkpoint key is a model key: the prefix is the cause, even when the model has keys
            # the checkpoint lacks on purpose (a new head whose keys were dropped before strict=False).
            if stripped & exp and all(k in exp or k.endswith(_NBT) for k in stripped):
                left = sorted(k for k in exp - stripped if not k.endswith(_NBT))
                details.update(prefix=prefix, direction="checkpoint")
                if left:
                    details["missing_after_strip"] = _group(left, exp)
                also = (f"; stripped, it still lacks {len(left)} key(s) the model has "
                        f"({_fmt_groups(details['missing_after_strip'])}), which keep their initial values"
                        if left else "")
                return {
                    "message": (f"every checkpoint key starts with {prefix!r} but the model's keys do not: the "
                                f"checkpoint was saved from {origin} and is loaded into the plain model{also}"),
                    "hint": (f"Strip the prefix: model.load_state_dict({{k.removeprefix({prefix!r}): v for k, v in "
                             f"state_dict.items()}}{', strict=False' if left else ''}); save "
                             f"{'model.module.state_dict()' if prefix == 'module.' else 'the original model' + chr(39) + 's state_dict()'}"
                             f" next time." + (" strict=False then leaves out only the keys it lacks on purpose." if left
                                         else "")),
                    "details": details,
                }
        if exp != got and exp and all(k.startswith(prefix) for k in exp) and not any(k.startswith(prefix) for k in got):
            rest = _strip(exp, prefix) ^ got
            if not rest or all(k.endswith(_NBT) for k in rest):
                details.update(prefix=prefix, direction="model")
                return {
                    "message": (f"every model key starts with {prefix!r} but the checkpoint's keys do not: the model "
                                f"is {origin} and the checkpoint was saved from the plain model"),
                    "hint": ("Load into the wrapped model: model.module.load_state_dict(state_dict)"
                             if prefix == "module." else
                             "Load into the original model: model._orig_mod.load_state_dict(state_dict)"),
                    "details": details,
                }
    found = _other_prefix(exp, got, details) if exp != got and exp and got else None
    if found is not None:
        return found
    missing, unexpected = sorted(exp - got), sorted(got - exp)
    shapes = []
    for k in sorted(exp & got):
        a, b = state_dict[k], own[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not _is_lazy(b) and a.shape != b.shape:
            shapes.append({"key": k, "checkpoint": list(a.shape), "model": list(b.shape)})
    if not missing and not unexpected and not shapes:
        return None
    if not strict and not shapes and (exp & got or not exp):
        return None  # a deliberate partial load
    details.update(missing=missing[:50], unexpected=unexpected[:50], missing_count=len(missing),
                   unexpected_count=len(unexpected), shape_mismatches=shapes[:50])
    parts, hints = [], []
    missing, unexpected = _running_stats(model, missing, unexpected, parts, hints, details)
    diff = missing + unexpected
    if diff and all(k.endswith(_NBT) for k in diff):
        which = ", ".join(diff[:_MAX_LIST]) + (" ..." if len(diff) > _MAX_LIST else "")
        if missing:
            parts.append(f"only BatchNorm {_NBT} buffers are missing from the checkpoint ({which}): it was saved "
                         f"by PyTorch older than 0.4.1, which had no such buffer")
            hints.append(f"Safe to add them: for k in {missing[:3]!r}{'...' if len(missing) > 3 else ''}: "
                         f"state_dict[k] = torch.tensor(0); or load with strict=False - only these keys differ.")
        if unexpected:
            parts.append(f"only {_NBT} buffers are unexpected ({which}): the checkpoint comes from a newer "
                         f"PyTorch (>= 0.4.1) or from BatchNorm layers with track_running_stats=True")
            hints.append(f"Safe to drop them: state_dict = {{k: v for k, v in state_dict.items() if not "
                         f"k.endswith('{_NBT}')}}; or load with strict=False - only these keys differ.")
        details["num_batches_tracked_only"] = True
    elif diff:
        renames = _renames(missing, unexpected)
        pruned = _pruning(missing, unexpected)
        if missing:
            details["missing_groups"] = _group(missing, exp)
            parts.append(f"{len(missing)} key(s) the model expects are missing: {_fmt_groups(details['missing_groups'])}")
        if unexpected:
            details["unexpected_groups"] = _group(unexpected, got)
            parts.append(f"{len(unexpected)} checkpoint key(s) are unexpected: "
                         f"{_fmt_groups(details['unexpected_groups'])}")
        # the whole checkpoint passed (torch.save({"epoch": ..., "model": model.state_dict(), ...})): one of its
        # values is the state_dict the model expects
        nested = next((k for k, v in state_dict.items() if isinstance(v, Mapping) and exp & set(v.keys())), None)
        if nested is not None:
            details["nested_state_dict"] = nested
            parts.append(f"the checkpoint's {nested!r} entry holds the model's keys: the whole checkpoint was passed "
                         f"instead of its state_dict")
            hints.append(f"Pass the model's part: model.load_state_dict(checkpoint[{nested!r}]) (the file also holds "
                         f"{', '.join(repr(k) for k in list(state_dict)[:4] if k != nested)}).")
        elif pruned:
            way, names = pruned
            details["pruning"] = {"direction": way, "tensors": names[:50]}
            shown = ", ".join(names[:_MAX_LIST]) + (" ..." if len(names) > _MAX_LIST else "")
            if way == "checkpoint":
                parts.append(f"the checkpoint was saved from a pruned model: torch.nn.utils.prune keeps "
                             f"`<name>_orig` and `<name>_mask` in place of each pruned tensor ({shown}), and this model "
                             f"is not pruned")
                hints.append("Call prune.remove(module, 'weight') on each pruned module before saving (the masked "
                             "weight becomes a plain parameter), or prune this model the same way before loading "
                             "(prune.identity(module, 'weight') makes the weight_orig/weight_mask entries the checkpoint "
                             "fills). strict=False would leave these weights at their initial values.")
            else:
                parts.append(f"this model is pruned (torch.nn.utils.prune keeps `<name>_orig` and `<name>_mask` in "
                             f"place of {shown}) and the checkpoint holds the plain tensors")
                hints.append("Load the plain values into `<name>_orig` and keep the masks (a lottery-ticket rewind): "
                             "state = model.state_dict(); state.update({(k + '_orig' if k + '_orig' in state else k): v "
                             "for k, v in checkpoint.items()}); model.load_state_dict(state). Or load before pruning. "
                             "strict=False would leave the pruned weights as they are.")
        elif renames:
            details["renamed"] = [list(r) for r in renames]
            old, new = renames[0]
            hints.append(f"The module looks renamed ({old} -> {new}): state_dict = {{('{new}.' + k[{len(old) + 1}:] "
                         f"if k.startswith('{old}.') else k): v for k, v in state_dict.items()}}.")
        else:
            hints.append("The checkpoint is from a different architecture or version of the model: build the model "
                         "with the checkpoint's configuration, or load with strict=False only if the missing modules "
                         "are meant to stay freshly initialised (e.g. a new head).")
    if shapes:
        listed = "; ".join(f"{s['key']}: checkpoint {s['checkpoint']} vs model {s['model']}" for s in shapes[:_MAX_LIST])
        parts.append(f"{len(shapes)} tensor(s) have a different shape ({listed}"
                     + (" ..." if len(shapes) > _MAX_LIST else "") + ")")
        hints.append("Shapes differ because the model was built with other sizes (e.g. num_classes): build it with the "
                     "checkpoint's sizes, or drop these keys and load with strict=False to re-initialise them: "
                     f"state_dict = {{k: v for k, v in state_dict.items() if k not in {[s['key'] for s in shapes[:3]]!r}"
                     f"{'...' if len(shapes) > 3 else ''}}}.")
    return {"message": "; ".join(parts), "hint": " ".join(hints), "details": details}


def explain_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> Optional[Finding]:
    """Explain why `state_dict` would not load into `model` (strictly): a ``state-dict-mismatch`` Finding, or None.

    The Finding's ``message`` says what differs (``module.`` prefix, ``num_batches_tracked`` only, shape
    changes, missing/unexpected keys grouped by module), ``hint`` the one-line fix, ``details`` the keys.
    Needs no active guard; ``step`` is 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"explain_state_dict: model={type(model).__name__} object is not an nn.Module")
    res = analyse(model, state_dict)
    if res is None:
        return None
    return Finding(kind=KIND, severity=severity_of(KIND), message=res["message"], hint=res["hint"],
                   where=type(model).__name__, step=0, details=res["details"])


def _load_location(args: tuple, kwargs: dict) -> Optional[str]:
    """The checkpoint's path (a file object's name), or None (a buffer)."""
    f = args[0] if args else kwargs.get("f")
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) and name else None


def _aliased(module: nn.Module, state_dict: Mapping[str, Any]) -> List[str]:
    """The parameter keys of `state_dict` whose tensors are the module's own (``best = model.state_dict()``
    without a copy), when every parameter it shares with the module is; else []."""
    own = dict(module.named_parameters())
    same, shared = [], 0
    for k, v in state_dict.items():
        p = own.get(k)
        if p is None or not isinstance(v, torch.Tensor) or v.is_meta or p.is_meta or v.shape != p.shape \
                or v.layout is not torch.strided or p.layout is not torch.strided:  # sparse: no data pointer
            continue
        shared += 1
        if v.data_ptr() == p.data_ptr() and v.data_ptr() != 0:
            same.append(k)
    return same if same and len(same) == shared else []


def _alias_report(module: nn.Module, keys: List[str], rebuilt: bool = False) -> Dict[str, Any]:
    """`rebuilt`: the dict loaded is not what state_dict() returned but one built from it (`{k: v.cpu() ...}`)."""
    res = {
        "message": (f"load_state_dict() got a state_dict whose {len(keys)} parameter tensor(s) are the model's own "
                    f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): state_dict() returns references, "
                    f"not copies, so every in-place change of the model since it was taken (training steps, or a "
                    f"load_state_dict() of other weights, as in an EMA swap for validation) changed it too, and "
                    f"loading it changes nothing. Weights it was meant to restore (the best epoch's, the initial "
                    f"ones to rewind to, the training weights behind an EMA swap) were never kept"),
        "hint": ("Keep a copy when taking the snapshot: best = copy.deepcopy(model.state_dict()) (or "
                 "{k: v.detach().clone() for k, v in model.state_dict().items()}), then "
                 "model.load_state_dict(best)."),
        "details": {"model": type(module).__name__, "aliased": True, "aliased_keys": len(keys),
                    "examples": keys[:5]},
    }
    if rebuilt:
        # `{k: v.cpu() for k, v in model.state_dict().items()}`: a copy on a GPU, the same tensors on a CPU run
        res["message"] += (" (the dict was built from state_dict()'s tensors without copying them: a shallow "
                           "dict(...), or .cpu() / .to(device), which return the very same tensor when it is already "
                           "there: on a CPU run they copy nothing)")
        res["hint"] = ("Copy explicitly when taking the snapshot: {k: v.detach().clone().cpu() for k, v in "
                       "model.state_dict().items()} (or v.to('cpu', copy=True)), or copy.deepcopy(model.state_dict()); "
                       "then model.load_state_dict(best).")
        res["details"]["rebuilt_dict"] = True
    return res


def _equal_to_own(module: nn.Module, sd: Mapping[str, Any]) -> bool:
    """Whether every parameter tensor of `sd` equals `module`'s own values (to float rounding), new tensors though
    they are: an average of snapshots that were all the live weights. Read once, at a load."""
    own = dict(module.named_parameters())
    pairs = [(sd[k], p) for k, p in own.items() if isinstance(sd.get(k), torch.Tensor) and sd[k].shape == p.shape]
    if not pairs or len(pairs) < len(own):
        return False
    try:
        with torch.no_grad():
            return all(v.is_floating_point() and torch.allclose(v.detach().to(p.device, p.dtype), p, rtol=1e-5, atol=1e-6)
                       for v, p in pairs)
    except Exception:
        return False


def _averaged_report(module: nn.Module, steps: List[int], source: Optional[str] = None) -> Dict[str, Any]:
    shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    whose = f"{source}'s" if source else "the model's"
    return {
        "message": (f"load_state_dict() got new tensors equal to {whose} current weights, while {len(steps)} "
                    f"state_dict() snapshots kept alive (taken at steps {shown}) are all {whose} own tensors: "
                    f"state_dict() returns references, not copies, so each snapshot holds the latest weights, and "
                    f"an average of them (checkpoint averaging, SWA by hand) is the last weights, not an average "
                    f"over those steps"),
        "hint": ("Copy each snapshot when taking it: snaps.append(copy.deepcopy(model.state_dict())) (or "
                 "{k: v.detach().clone() for k, v in model.state_dict().items()}), then average the copies."),
        "details": {"model": type(module).__name__, "aliased": True, "averaged_snapshots": len(steps),
                    "snapshot_steps": steps[:10]},
    }


class StateDictMismatch(Check):
    name = "state-dict"
    kinds = {
        KIND: ("error", "load_state_dict keys differ"),
    }
    description = ("explains load_state_dict key/shape mismatches and GPU checkpoints loaded without a GPU; a "
                   "state_dict snapshot taken without a copy, restored after training changed it")
    patches = {"load_state_dict": "torch.nn.Module.load_state_dict", "torch_load": "torch.load",
               "state_dict": "torch.nn.Module.state_dict", "torch_save": "torch.save"}
    MAX_SNAPSHOTS = 8

    def __init__(self, guard):
        super().__init__(guard)
        # id(state_dict returned) -> (weak reference to it, its tensors' version counters then): an aliased snapshot
        # loaded back before anything changed it (the best epoch was the last) restores what it should
        self._snaps: Dict[int, Tuple[weakref.ref, Dict[str, int], int]] = {}  # ... and the step it was taken at
        self._loaded: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules a state_dict was loaded into
        self._told_save = False
        self._told_avg = False

    def on_state_dict_done(self, args, kwargs, result):
        if len(args) > 1 or kwargs.get("destination") is not None or not isinstance(result, Mapping):
            return  # a submodule's part of its parent's state_dict()
        try:
            ref = weakref.ref(result)
        except TypeError:
            return
        self._snaps = {k: v for k, v in self._snaps.items() if v[0]() is not None}
        if len(self._snaps) >= self.MAX_SNAPSHOTS:
            self._snaps.pop(next(iter(self._snaps)))
        self._snaps[id(result)] = (ref, {k: v._version for k, v in result.items() if isinstance(v, torch.Tensor)},
                                   self.g.step)

    def on_torch_save(self, args, kwargs):
        """torch.save of a state_dict snapshot taken earlier without a copy, whose tensors training has changed since
        (`best_state = model.state_dict()`, saved after the run): the file gets the latest weights."""
        obj = args[0] if args else kwargs.get("obj")
        if not self._snaps or self._told_save:
            return
        dicts = [obj] + ([v for v in obj.values() if isinstance(v, Mapping)] if isinstance(obj, Mapping) else [])
        for d in dicts:
            snap = self._snaps.get(id(d))
            if snap is None or snap[0]() is not d or snap[2] < 1:
                continue  # (one taken before training, kept as a live view of the weights, is saved as such)
            moved = [k for k, v in d.items() if isinstance(v, torch.Tensor) and k in snap[1] and v._version != snap[1][k]]
            if not moved:
                continue
            self._told_save = True
            shown = ", ".join(moved[:3]) + (", ..." if len(moved) > 3 else "")
            self.emit(KIND, "torch.save",
                      f"torch.save() writes a state_dict snapshot taken at step {snap[2]} without a copy: "
                      f"state_dict() returns references to the model's own tensors, and {len(moved)} of them changed "
                      f"in place since ({shown}), so the file holds the weights of now, not the snapshot's (the best "
                      f"epoch's)",
                      "Copy when taking the snapshot: best_state = copy.deepcopy(model.state_dict()) (or {k: "
                      "v.detach().clone() for k, v in model.state_dict().items()}), or torch.save() it at once.",
                      source=self.g.source(), details={"aliased": True, "snapshot_step": snap[2],
                                                       "changed": moved[:20], "saved": True})
            return

    @staticmethod
    def _args(args: tuple, kwargs: dict) -> Tuple[Any, Any, bool]:
        module = args[0] if args else None
        sd = args[1] if len(args) > 1 else kwargs.get("state_dict")
        strict = args[2] if len(args) > 2 else kwargs.get("strict", True)
        return module, sd, bool(strict)

    def _report(self, module: nn.Module, res: Dict[str, Any], exc: Optional[BaseException]) -> None:
        where = self.g.path_of(module)
        source = self.g.source()
        if exc is not None:
            add_guard_note(exc, f"{NOTE_PREFIX}{res['message']}\n  fix: {res['hint']}")
        self.emit(KIND, where, res["message"], res["hint"], source=source, details=res["details"])

    def on_load_state_dict(self, args, kwargs):
        module, sd, _ = self._args(args, kwargs)
        try:
            self._on_load(module, sd)
        finally:
            if isinstance(module, nn.Module):
                self._loaded.add(module)

    def _on_load(self, module: Any, sd: Any) -> None:
        if isinstance(module, nn.Module) and isinstance(sd, Mapping) and self.g.step > 0:
            keys = _aliased(module, sd)
            snap = self._snaps.get(id(sd))
            if keys and snap is not None and snap[0]() is sd and all(
                    isinstance(sd[k], torch.Tensor) and sd[k]._version == snap[1].get(k) for k in keys):
                return  # nothing changed it since it was taken: loading it restores what it should
            if keys:
                self._report(module, _alias_report(module, keys, rebuilt=snap is None), None)
            elif snap is None and self._snaps:
                # the average may go into the model the snapshots alias or into another (FedAvg: the client reset
                # from the global model every round, `states.append(client.state_dict())`, the mean loaded into the
                # global model or back into the client)
                for source in [module] + [r for r in self.g.roots if r is not module][:8]:
                    steps = self._stale_snapshots(source) if not self._told_avg else []
                    if len(steps) >= 2 and _equal_to_own(source, sd):
                        self._told_avg = True  # (a code property: every round's average is the same bug)
                        name = None if source is module else f"`{variable_naming(source) or self.g.path_of(source)}`"
                        self._report(module, _averaged_report(source, steps, name), None)
                        break
            elif snap is not None and snap[0]() is sd and module not in self._loaded:
                # (a model's first load: a target network synced again and again from a dict it knows to be live is
                # not this)
                moved = self._moved_elsewhere(module, sd, snap[1])
                if moved:
                    source, keys = moved
                    res = _alias_report(module, keys)
                    res["message"] = (
                        f"load_state_dict() got a state_dict whose {len(keys)} parameter tensor(s) are {source}'s own "
                        f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}), changed in place by training "
                        f"since the snapshot was taken (state_dict() returns references, not copies): "
                        f"`{variable_naming(module) or type(module).__name__}` gets {source}'s latest weights, not "
                        f"the ones the snapshot was meant to keep (the best epoch's)")
                    res["details"].update(aliased_to=source)
                    self._report(module, res, None)

    def _stale_snapshots(self, module: nn.Module) -> List[int]:
        """Steps of the live `state_dict()` results whose parameter tensors are all `module`'s own and changed since
        they were taken: snapshots kept without a copy (`snaps.append(model.state_dict())`)."""
        steps, changed = [], False
        for ref, versions, step in self._snaps.values():
            snap = ref()
            if snap is None:
                continue
            keys = _aliased(module, snap)
            if keys:
                steps.append(step)
                changed = changed or any(snap[k]._version != versions.get(k) for k in keys)
        return sorted(steps) if changed else []

    def _moved_elsewhere(self, module: nn.Module, sd: Mapping[str, Any], versions: Dict[str, int]):
        """(the watched model whose parameters the snapshot `sd` holds, the keys changed since it was taken) when
        that model is not `module` (the snapshot loaded into a fresh copy), else None."""
        for root in self.g.roots:
            if root is module:
                continue
            own = {p.data_ptr() for p in root.parameters() if p.layout is torch.strided and not p.is_meta}
            keys = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.layout is torch.strided
                    and not v.is_meta and v.data_ptr() in own and v.data_ptr() != 0]
            if keys and any(sd[k]._version != versions.get(k) for k in keys):
                return f"`{variable_naming(root) or self.g.path_of(root)}`", keys
        return None

    def on_load_state_dict_error(self, args, kwargs, exc):
        module, sd, strict = self._args(args, kwargs)
        if not isinstance(module, nn.Module) or not isinstance(exc, RuntimeError):
            return
        res = analyse(module, sd, strict=True)
        if res is not None:
            self._report(module, res, exc)

    def on_load_state_dict_done(self, args, kwargs, result):
        module, sd, strict = self._args(args, kwargs)
        if strict or not isinstance(module, nn.Module):
            return
        if not (getattr(result, "missing_keys", None) or getattr(result, "unexpected_keys", None)):
            return
        res = analyse(module, sd, strict=False)
        if res is not None:
            res["message"] += " (strict=False hid this: nothing was loaded)"
            self._report(module, res, None)

    def on_torch_load_error(self, args, kwargs, exc):
        text = str(exc)
        if "deserialize object on" not in text or "CUDA" not in text:
            return
        path = _load_location(args, kwargs)
        where, f = (path, repr(path)) if path is not None else ("torch.load", "f")  # a buffer: its variable
        if "is_available() is False" in text:
            msg = ("the checkpoint holds tensors saved on a GPU, and this machine has no usable CUDA device, so "
                   "torch.load cannot put them back where they were")
            hint = (f"Load onto the CPU: torch.load({f}, map_location='cpu'), then move the model with "
                    f".to(device); or map_location=torch.device('cuda') when a GPU is present.")
        else:
            msg = "the checkpoint names a CUDA device index this machine does not have"
            hint = (f"Remap the devices: torch.load({f}, map_location='cuda:0') (or map_location='cpu'), "
                    f"then .to(device).")
        add_guard_note(exc, f"{NOTE_PREFIX}{msg}\n  fix: {hint}")
        self.emit(KIND, where, msg, hint, source=self.g.source(), details={"error": text.splitlines()[0][:300]})
