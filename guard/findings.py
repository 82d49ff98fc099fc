"""The finding data model: `Finding`, severities and the stable kind vocabulary."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Tuple

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)
SEVERITY_RANK = {ERROR: 0, WARNING: 1, INFO: 2}

class KindTable(Mapping):
    """kind -> (severity, what is wrong), as the checks declare them (``Check.kinds``).

    Each check class declares its kinds when it is created (`declare`); the first lookup that
    misses loads the check registry, so the table is complete whenever it is read. Kinds are
    stable: they are the contract's vocabulary.
    """

    def __init__(self) -> None:
        self._kinds: Dict[str, Tuple[str, str]] = {}
        self._owners: Dict[str, str] = {}
        self._complete = False

    def declare(self, kind: str, severity: str, description: str, owner: str) -> None:
        """Add `kind` (declared by check `owner`); a kind two checks declare must agree on its severity."""
        self.check(kind, severity, owner)
        if kind not in self._kinds:
            self._kinds[kind] = (severity, description)
            self._owners[kind] = owner

    def check(self, kind: str, severity: str, owner: str) -> None:
        """Raise `TypeError` if check `owner` may not declare `kind` with `severity`."""
        if severity not in SEVERITIES:
            raise TypeError(f"guard: check {owner!r} declares kind {kind!r} with severity {severity!r}; "
                            f"allowed: {', '.join(SEVERITIES)}")
        old = self._kinds.get(kind)
        if old is not None and old[0] != severity:
            raise TypeError(f"guard: check {owner!r} declares kind {kind!r} as {severity!r}, "
                            f"check {self._owners[kind]!r} as {old[0]!r}; one kind has one severity")

    def _all(self) -> Dict[str, Tuple[str, str]]:
        if not self._complete:
            self._complete = True
            # The registry lives above this module; it is loaded by name, on first need, not imported.
            importlib.import_module("guard.checks").registry()
        return self._kinds

    def __getitem__(self, kind: str) -> Tuple[str, str]:
        hit = self._kinds.get(kind)
        return hit if hit is not None else self._all()[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self._kinds or kind in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


#: kind -> (severity, what is wrong), generated from the checks' declarations.
KINDS = KindTable()


def severity_of(kind: str) -> str:
    """The severity the vocabulary gives `kind`."""
    return KINDS[kind][0]


def is_kind(kind: str) -> bool:
    """Whether a check declares `kind`."""
    return kind in KINDS


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
        # a dump read back (`guard report`) is text from a file: printed as text, never as terminal controls
        return cls(**{k: (printable(v) if k in _TEXT else v) for k, v in d.items() if k in names})

    def __str__(self) -> str:
        src = f" ({self.source})" if self.source else ""
        return f"[{self.severity}] {self.kind} at {self.where}, step {self.step}{src}: {self.message}"


class GuardError(RuntimeError):
    """Raised in ``mode="raise"`` at the first finding of severity ``error``; ``.finding`` holds it."""

    def __init__(self, finding: Finding):
        super().__init__(f"{finding}\n  fix: {finding.hint}")
        self.finding = finding


# C0 and C1 control characters (and DEL): escaped, never printed. Names come from user objects (a ModuleDict key,
# a checkpoint's key) and an ESC there would drive the terminal (clear it, set its title) or, with a CR/LF,
# forge guard's own lines in a CI log.
_CONTROL = {c: f"\\x{c:02x}" for c in list(range(0x20)) + list(range(0x7f, 0xa0))}


_TEXT = ("kind", "severity", "where", "message", "hint", "source")


def printable(text: Any) -> Any:
    """`text` with control characters written as ``\\xNN`` and lone surrogates (a non-UTF-8 path or argument
    decoded by Python) as ``\\udcff``: safe for a terminal, an HTML page and strict JSON parsers."""
    if not isinstance(text, str):
        return text
    if text.isprintable():
        return text  # the usual case: one C-level scan
    out = text.translate(_CONTROL)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        out = out.encode("utf-8", "backslashreplace").decode("utf-8")
    return out


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
