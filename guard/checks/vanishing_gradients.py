"""Vanishing gradients: the first layers' gradients tiny next to the last ones', step after step.

Every `EVERY`-th sampled optimizer step (a sampled check; ``details["sampled_every"]``
says so), the per-element RMS of the gradient of the first weight matrix in
execution order is divided by that of the last one, on the device (two
reductions), and staged with the step's other values. `RUN` samples in a row
under `RATIO` (1e-5) are reported: a deep sigmoid/tanh stack without
normalization or residuals, where the first layers barely learn.

Layers are the watched modules of one model (the one with most such layers among
those whose weights the primary optimizer updates) in the order of their first call
(the module table), with a weight of two or more dimensions that requires a gradient:
biases and norm scales are left out, as are ``nn.Embedding`` weights (a
pretrained embedding's sparse, tiny gradient is normal), attention query and key
projections (near-zero attention logits at init give them tiny gradients by
construction) and frozen layers (also when frozen after the pairing). Nets
with fewer than `MIN_LAYERS` such layers (but two or more) are looked at for a cut only: a first
layer's gradient exactly 0 while the last one's is not.
"""
from __future__ import annotations

import math
import re
import weakref
from typing import List, Optional, Tuple

import torch

from .._frames import source_match
from ..tensors import as_float
from .base import Check

_CHECKPOINT_CALL = re.compile(r"\bcheckpoint(_sequential)?\s*\(")

# An attention's query and key projections: at a transformer's usual init (weights ~ N(0, 0.02)) the attention logits
# are near 0 and so are these projections' gradients, by construction, while the rest of the layer learns
_QUERY_KEY = re.compile(r"(query|key|q|k|wq|wk|q_proj|k_proj|q_lin|k_lin|to_q|to_k|q_linear|k_linear)$", re.I)

EVERY = 5
RUN = 4
RATIO = 1e-5
MIN_LAYERS = 4
SHALLOW_EVERY = 25  # the sampling period for nets under MIN_LAYERS (a cut is told after RUN such samples)


#: a ratio this small at an attention layer is no shrinking through depth (residual paths): what it attends to is empty
ATTENTION_CUT = 1e-12


class VanishingGradients(Check):
    name = "vanishing-gradients"
    kinds = {"vanishing-gradients": ("warning", "the first layers' gradient norms are tiny next to the last ones' "
                                                "for many steps")}
    description = (f"first layer's gradient RMS < {RATIO:g} x the last layer's for {RUN} samples "
                   f"(sampled every {EVERY} steps)")

    def __init__(self, guard):
        super().__init__(guard)
        self._pair: Optional[Tuple[str, weakref.ref, str, weakref.ref, int]] = None
        self._tried_at = -1
        self._run, self._since, self._source = 0, 0, None
        self._ratios: List[float] = []
        self._done = False
        self._second: Optional[weakref.ref] = None  # the layer called after the first one
        self._skip: set = set()  # first layers whose exact-zero gradient is their own (their input is zero)
        self._none = False  # the first layer's gradient was None at the last sample (the graph left before it)
        self._none_version = 0  # its weights' version counter at the first such sample of the run
        self._had_grad = False  # it had a gradient at some sample

    def _layers(self, optimizer) -> Optional[Tuple[str, weakref.ref, str, weakref.ref, int]]:
        """The first and last weight layers of one model, all of whose weights `optimizer` updates.

        One model at a time: a GAN's or an AMP recipe's two networks are no stack of layers (and under
        one GradScaler one optimizer's gradients may be unscaled while the other's are not yet).
        """
        held = {id(p) for grp in optimizer.param_groups for p in grp["params"]}
        best: List[Tuple[str, torch.Tensor]] = []
        for root in self.g.roots:
            by_module = {}
            for p in root.parameters():
                if p.dim() >= 2 and p.requires_grad and id(p) in held:
                    mod, _, _ = self.g.param_name(p).rpartition(".")
                    by_module.setdefault(mod, p)
            # Types from this root's own modules: under a global guard the module table also lists models
            # trained before, whose paths this one may reuse (an Embedding where a Linear was).
            types = {self.g.path_of(m): type(m).__name__ for m in root.modules()}
            order = []
            for path, info in self.g.modules.items():  # in the order of first calls
                kind = types.get(path, info.get("type"))
                key = path if path in by_module else "" if path == kind else None  # the root: its class name
                if key not in by_module or kind in ("Embedding", "EmbeddingBag") or path in self._skip \
                        or _QUERY_KEY.match(path.rpartition(".")[2]):
                    continue
                order.append((path, by_module[key]))
            if len(order) > len(best):
                best = order
        if len(best) < 2:
            return None  # (under MIN_LAYERS only an exact cut is told: `_seen`)
        (fp, fw), (lp, lw) = best[0], best[-1]
        self._second = weakref.ref(best[1][1])
        return fp, weakref.ref(fw), lp, weakref.ref(lw), len(best)

    def _learning_siblings(self, first: str) -> List[str]:
        """Names of the parameters of the layer at path `first`, beside its weight, that have a gradient now."""
        for root in self.g.roots:
            try:
                layer = root.get_submodule(first) if first != type(root).__name__ else root
            except AttributeError:
                continue
            return [n for n, p in layer.named_parameters(recurse=False)
                    if p.grad is not None and p.dim() < 2 and p.requires_grad]
        return []

    def _reentrant_site(self, first: str) -> Optional[str]:
        """``file:line`` of a ``checkpoint(...)`` call that is not ``use_reentrant=False`` in the forward of a module
        that holds the layer at path `first` (asked only when a first layer's gradient stayed None)."""
        for root in self.g.roots:
            mods, m, parts = [root], root, first.split(".")
            for part in parts[:-1]:
                m = getattr(m, "_modules", {}).get(part)
                if m is None:
                    break
                mods.append(m)
            if m is None:
                continue
            for mod in mods:
                fwd = getattr(type(mod), "forward", None)
                if fwd is None or (getattr(fwd, "__module__", "") or "").startswith("torch."):
                    continue
                hit = source_match(fwd, lambda line: _CHECKPOINT_CALL.search(line) is not None
                                   and "use_reentrant=False" not in line.replace(" ", ""))
                if hit is not None:
                    return hit
        return None

    def on_step_pre(self, optimizer):
        if self._done or not self.g.sampling or not self.g.is_primary(optimizer) or self.g.step % EVERY:
            return
        if self._pair is not None and self._pair[4] < MIN_LAYERS and self.g.step % SHALLOW_EVERY:
            return  # a shallow net is looked at for a lasting cut only: rarer samples (a tiny model's step is short)
        if self._pair is None:
            if self._tried_at >= 0 and self.g.step < self._tried_at + 10 * EVERY:
                return
            self._tried_at = self.g.step
            self._pair = self._layers(optimizer)
            if self._pair is None:
                return
        fp, fref, lp, lref, n = self._pair
        first, last = fref(), lref()
        if first is None or last is None or not (first.requires_grad and last.requires_grad):
            # (frozen since the pairing: the zero gradients zero_grad(set_to_none=False) leaves are no cut; paired
            # again among the layers that train)
            self._pair, self._run, self._ratios, self._tried_at = None, 0, [], -1
            return
        gf, gl = first.grad, last.grad
        if n < MIN_LAYERS and gf is None:
            return  # a shallow net's first layer without a gradient: left out of the graph on purpose as often as not
        if gf is None and gl is not None and not gl.is_meta and gl.layout == torch.strided:
            # no gradient at all while the last layer has one: the backward never reached it (a comparison's
            # `(x > 0).float()` leaves the graph), counted as a cut; a layer that had one at any sample, or whose
            # weights moved between the samples (updated at other steps: a stem used on some batches only), is not
            if self._had_grad or (self._run and self._none and first._version != self._none_version) or any(
                    f.kind == "zero-grad-before-step" for f in self.g.findings):
                # (gradients wiped by a zero_grad() between backward and step: that finding is the cause)
                self._run, self._ratios, self._had_grad = 0, [], True
                return
            if not (self._run and self._none):
                self._none_version = first._version
            self._none = True
            self._seen(0.0, self.g.step, self.g.source())
            return
        if gf is not None:
            self._had_grad = True
        if gf is None or gl is None or gf.is_meta or gl.is_meta or gf.layout != torch.strided \
                or gl.layout != torch.strided:
            return
        self._none = False
        if n < MIN_LAYERS and self._shallow(optimizer, first, last):
            return
        with torch.no_grad():
            rf = torch.linalg.vector_norm(as_float(gf)) / math.sqrt(gf.numel())
            rl = torch.linalg.vector_norm(as_float(gl)).to(rf.device) / math.sqrt(gl.numel())
            ratio = rf / rl
        step, source = self.g.step, self.g.source()
        self.g.stage(ratio, lambda v: self._seen(v, step, source))

    def _shallow(self, optimizer, first: torch.Tensor, last: torch.Tensor) -> bool:
        """A shallow net is looked at for an exact cut only: the two layers' norms are read from the shared
        per-parameter norms of the step (no reduction of its own). False when they are not there."""
        gn = self.g.grad_norms(optimizer)
        if len(gn.stacked) != 1:
            return False
        (stack, ids), = gn.stacked.values()
        try:
            i = ids.index(next(k for k, p in enumerate(gn.params) if p is first))
            j = ids.index(next(k for k, p in enumerate(gn.params) if p is last))
        except (StopIteration, ValueError):
            return False
        step, source = self.g.step, self.g.source()

        def seen(values: List[float]) -> None:
            self._seen(0.0 if values[i] == 0.0 and values[j] > 0.0 else 1.0, step, source)
        self.g.stage_batch(lambda: [(stack, seen)])
        return True

    def _seen(self, v: float, step: int, source: Optional[str]) -> None:
        if not (v < RATIO) or self._pair is None or (v != 0.0 and self._pair[4] < MIN_LAYERS):
            # NaN (last layer's gradient 0) counts as fine; so does a small ratio in a net too shallow for it to
            # mean anything, where an exact 0 is still a cut (a round() between two layers without an STE)
            self._run, self._ratios = 0, []
            return
        if self._run == 0:
            self._since, self._source = step, source
        self._run += 1
        self._ratios.append(v)
        if self._run >= RUN:
            self._done = True
            fp, _, lp, _, n = self._pair
            worst = max(self._ratios)
            second = self._second() if self._second is not None else None
            if worst == 0.0 and not self._none and second is not None and second.grad is not None \
                    and bool(second.grad.any()):
                # Only the first layer's gradient is 0 while the next one's is not: no cut between the layers but
                # a zero input (unrolled ISTA's S applied to x0 = 0). Pair again without it.
                self._done, self._pair = False, None
                self._skip.add(fp)
                self._run, self._ratios, self._tried_at = 0, [], -1
                return
            site = self._reentrant_site(fp) if worst == 0.0 and self._none else None
            if site is not None:
                message = (f"the gradients of the first layer {fp} are None (backward never reaches it) at {self._run} "
                           f"sampled steps since step {self._since}, while those of the last layer {lp} are not ({n} "
                           f"layers): it runs inside torch.utils.checkpoint(..., use_reentrant=True) "
                           f"({site}), and a reentrant checkpoint whose input does not require grad (a frozen embedding "
                           f"or input before it) gives the parameters inside it no gradient, so they do not learn")
                hint = ("Pass use_reentrant=False to checkpoint: it gives the parameters inside their gradients whatever "
                        "the input; or make the checkpoint's input require grad (x.requires_grad_() after a frozen "
                        "embedding; Hugging Face's model.enable_input_require_grads()).")
            elif worst == 0.0 and self._none and (siblings := self._learning_siblings(fp)):
                # the weight alone without a gradient while its own layer's bias gets one: no cut between the layers,
                # the weight leaves the graph inside the layer (a custom autograd.Function returning None for it)
                message = (f"the weight of the first layer {fp} gets no gradient (None) at {self._run} sampled steps "
                           f"since step {self._since}, while the same layer's {', '.join(siblings)} does: the path "
                           f"to the layer is not cut, its weight leaves the graph inside it, so it never learns")
                hint = ("Look at how the layer uses its weight: a custom torch.autograd.Function whose backward "
                        "returns None for the weight (return grad_input, grad_weight, grad_bias: compute "
                        "grad_output.t() @ input), or a weight used through .detach()/.data in its forward.")
            elif worst == 0.0:
                # Not shrinking but cut: nothing reaches the first layer at all (a round/argmax between them)
                what = "None (backward never reaches it)" if self._none else "exactly 0"
                message = (f"the gradients of the first layer {fp} are {what} at {self._run} sampled steps since "
                           f"step {self._since}, while those of the last layer {lp} are not ({n} layers): no "
                           f"gradient reaches the first layers, so they do not learn at all; an operation without a "
                           f"gradient cuts the path between them (torch.round, sign, argmax, a comparison or an "
                           f"integer cast), or every unit before it is dead (ReLUs whose inputs are all negative)")
                hint = ("Give the cut a gradient: a straight-through estimator `z + (torch.round(z) - z).detach()` "
                        "(the same for sign), a relaxed choice (softmax or F.gumbel_softmax(logits, hard=True) "
                        "instead of argmax); for dead ReLUs, a smaller learning rate, LeakyReLU or a better init.")
            else:
                fw = self._pair[1]()
                hooks = len(getattr(fw, "_backward_hooks", None) or ()) if fw is not None else 0
                message = (f"the gradients of the first layer {fp} are {worst:.1e}x those of the last layer {lp} "
                           f"(per-element RMS, under {RATIO:g} at {self._run} sampled steps since step {self._since}, "
                           f"{n} layers): the first layers barely learn")
                hint = ("Gradients shrink through each saturating layer: use ReLU/GELU instead of sigmoid/tanh in "
                        "deep stacks, add normalization (nn.LayerNorm/nn.BatchNorm1d) or residual connections "
                        "(x = x + f(x)), and a suitable init (nn.init.kaiming_normal_ / xavier_uniform_).")
                if worst < ATTENTION_CUT and ("attn" in fp.lower() or "attention" in fp.lower()):
                    # an attention layer sits on a residual path: no depth shrinks its gradients 1e-12x. What it
                    # attends to carries nothing: every real token masked, only the padding left (PyTorch's
                    # key_padding_mask is True where a position is ignored)
                    message += ("; the first layer is an attention layer, whose residual path keeps gradients from "
                                "shrinking like this: what it attends to carries no signal, as when the key padding "
                                "mask is inverted (True at the real tokens) and only padding is attended")
                    hint = ("Check the attention mask first: PyTorch's key_padding_mask / src_key_padding_mask is True "
                            "where a position is ignored, so build it as `tok == PAD` (or `~attention_mask` when 1 "
                            "marks a real token), not `tok != PAD`. " + hint)
                if hooks >= 2:
                    # tensor hooks piling up on the weight (registered again every epoch, the handles dropped): each
                    # scales the gradient once more
                    message += (f"; its weight carries {hooks} gradient hooks (p.register_hook), each applied to the "
                                f"gradient in turn")
                    hint = ("Register gradient hooks once, before the loop, and keep their handles (h = "
                            "p.register_hook(fn); h.remove() when done): registered again every epoch, they pile up and "
                            "a scaling hook shrinks the gradient geometrically. " + hint)
            self.emit("vanishing-gradients", fp, message, hint,
                      step=self._since, seen=self.g.step, source=self._source,
                      details={"first": fp, "last": lp, "ratio": worst, "ratios": self._ratios,
                               "layers": n, "sampled_every": EVERY, "threshold": RATIO, "cut": worst == 0.0,
                               **({"no_gradient": True} if self._none else {}),
                               **({"reentrant_checkpoint": site} if site else {}),
                               **({"gradient_hooks": hooks} if worst != 0.0 and hooks >= 2 else {})})
