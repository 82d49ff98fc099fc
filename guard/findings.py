"""The finding data model: `Finding`, severities and the stable kind vocabulary."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)
SEVERITY_RANK = {ERROR: 0, WARNING: 1, INFO: 2}

#: kind -> (severity, what is wrong). The contract's vocabulary; kinds are stable.
KINDS: Dict[str, tuple] = {
    "nonfinite-input": (ERROR, "NaN/Inf in a tensor fed to the guarded model"),
    "nonfinite-output": (ERROR, "a module produced NaN/Inf from finite inputs"),
    "nonfinite-loss": (ERROR, "the tensor backward() was called on is NaN/Inf"),
    "nonfinite-grad": (ERROR, "a parameter's gradient has NaN/Inf"),
    "nonfinite-param": (ERROR, "a parameter became NaN/Inf after optimizer.step()"),
    "grad-explosion": (WARNING, "total gradient norm jumps far above its running level"),
    "loss-graph-retained": (ERROR, "autograd graphs of earlier steps stay alive"),
    "eval-without-no-grad": (WARNING, "forward passes build graphs that are never back-propagated"),
    "eval-in-train-mode": (WARNING, "no_grad forward while dropout/BatchNorm are in training mode"),
    "device-mismatch": (ERROR, "inputs and a module's parameters on different devices"),
    "batchnorm-single-sample": (ERROR, "a BatchNorm in training mode gets one value per channel"),
    "batchnorm-last-batch": (WARNING, "a DataLoader will yield a final batch of 1 to a model with BatchNorm"),
    "weight-decay-without-grad": (WARNING, "weight decay or momentum moves parameters that got no gradient"),
    "frozen-param-in-optimizer": (INFO, "parameters with requires_grad=False were handed to the optimizer"),
    "param-not-in-optimizer": (WARNING, "trainable parameters that get gradients are in no optimizer"),
    "missing-zero-grad": (WARNING, "gradients of earlier steps accumulate into a step without zero_grad()"),
    "softmax-before-cross-entropy": (WARNING, "CrossEntropyLoss/NLLLoss fed probabilities or double log-softmax"),
    "sigmoid-before-bce": (INFO, "BCELoss after sigmoid; BCEWithLogitsLoss is the stable form"),
    "target-out-of-range": (ERROR, "class targets outside [0, C)"),
    "input-not-normalized": (INFO, "image-like input far from normalized"),
    "state-dict-mismatch": (ERROR, "load_state_dict keys differ"),
    "explained-error": (ERROR, "a cryptic PyTorch error escaped the guarded block"),
    # checksB (issue 16 / 19.5)
    "dropout-in-eval": (WARNING, "F.dropout without training=self.training: dropout stays on in model.eval()"),
    "unshuffled-labels": (WARNING, "training batches each hold one class (dataset sorted by label, shuffle=False)"),
    "clip-before-unscale": (ERROR, "gradient clipping on still-scaled gradients (no scaler.unscale_ before it)"),
    "params-not-updating": (WARNING, "parameters with non-zero gradients do not change for many steps"),
    "vanishing-gradients": (WARNING, "the first layers' gradient norms are tiny next to the last ones' for many steps"),
    "grads-all-zero": (WARNING, "every gradient the optimizer applies has been exactly zero for several steps"),
    "loss-constant": (ERROR, "the loss cannot change, e.g. cross_entropy over a single class (C = 1)"),
}


def severity_of(kind: str) -> str:
    """The severity the vocabulary gives `kind`."""
    return KINDS[kind][0]


@dataclass(frozen=True)
class Finding:
    """One detected pitfall: what, where, since which step, how often, and the fix."""

    kind: str
    severity: str
    message: str
    hint: str
    where: str
    step: int
    count: int = 1
    source: Optional[str] = None
    details: Dict[str, Any] = field(default_factory=dict)
    last_step: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-safe dict (the report's finding record)."""
        d = dataclasses.asdict(self)
        d["details"] = json_safe(self.details)
        if d["last_step"] is None:
            d["last_step"] = self.step
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Finding":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def __str__(self) -> str:
        src = f" ({self.source})" if self.source else ""
        return f"[{self.severity}] {self.kind} at {self.where}, step {self.step}{src}: {self.message}"


class GuardError(RuntimeError):
    """Raised in ``mode="raise"`` at the first finding of severity ``error``; ``.finding`` holds it."""

    def __init__(self, finding: Finding):
        super().__init__(f"{finding}\n  fix: {finding.hint}")
        self.finding = finding


def json_safe(value: Any, _depth: int = 0) -> Any:
    """Turn `value` into something `json.dumps` accepts (tensors, shapes, devices, sets...)."""
    if _depth > 8:
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return repr(value)  # JSON has no NaN/Inf; keep it readable
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, _depth + 1) for v in value]
    try:
        import torch

        if isinstance(value, torch.Size):
            return list(value)
        if isinstance(value, torch.Tensor):
            if value.numel() == 1 and value.device.type != "meta":
                return json_safe(value.item(), _depth + 1)
            return f"tensor(shape={list(value.shape)}, dtype={value.dtype}, device={value.device})"
        if isinstance(value, (torch.device, torch.dtype)):
            return str(value)
    except Exception:  # pragma: no cover - torch missing or odd tensor
        pass
    return repr(value)
