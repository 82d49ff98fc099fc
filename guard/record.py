"""The data of a guard session: findings, timeline, module table, notices.

A live guard owns one `Record` and fills it; a dump read from disk is one
(`Record.from_json`); several ranks' or processes' dumps merge into one
(`Record.merge`). Renderers take a `Record` and read its typed fields, so a
dump written yesterday renders the same as a live session.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .findings import SEVERITIES, Finding, is_kind, json_safe

SCHEMA = "guard-report/1"
MAX_DEPTH = 64  # a guard dump nests a few levels (details are cut at 8); deeper is not ours


class SchemaError(ValueError):
    """A dump that is not a valid ``guard-report/1`` document; the message names the first bad field."""


@dataclass
class Record:
    """Findings (first-seen order, de-duplicated by kind and where), timeline, modules, notices."""

    findings: List[Finding] = field(default_factory=list)
    timeline: List[Dict[str, Any]] = field(default_factory=list)
    modules: List[Dict[str, Any]] = field(default_factory=list)
    notices: List[str] = field(default_factory=list)
    internal_errors: List[Dict[str, Any]] = field(default_factory=list)
    environment: Dict[str, Any] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    created: Optional[str] = None
    #: guard's own cost: ``overhead`` (its time over the rest of the step time), and under a budget the
    #: sampled checks and their period (see `guard.meter.Meter.to_dict`)
    cost: Dict[str, Any] = field(default_factory=dict)
    #: keys of a loaded dump that this model does not know, kept so that nothing is lost on a re-write
    extra: Dict[str, Any] = field(default_factory=dict)
    #: (kind, where) -> position in `findings`; rebuilt when `findings` was changed from outside
    _index: Dict[Tuple[str, str], int] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: a live timeline keeps every `timeline_stride`-th step (doubled when it grows past its limit)
    timeline_stride: int = field(default=1, init=False, repr=False, compare=False)

    # -- live filling ----------------------------------------------------------------------------
    def _positions(self) -> Dict[Tuple[str, str], int]:
        idx = self._index
        if len(idx) != len(self.findings):
            idx.clear()
            for i, f in enumerate(self.findings):
                idx.setdefault((f.kind, f.where), i)
        return idx

    def finding(self, kind: str, where: str) -> Optional[Finding]:
        """The finding of `kind` at `where`, if any."""
        i = self._positions().get((kind, where))
        return None if i is None else self.findings[i]

    def put(self, finding: Finding) -> None:
        """Add `finding`, or replace the one with the same kind and where (keeping its place)."""
        idx = self._positions()
        key = (finding.kind, finding.where)
        i = idx.get(key)
        if i is None:
            idx[key] = len(self.findings)
            self.findings.append(finding)
        else:
            self.findings[i] = finding

    def repeat(self, kind: str, where: str, step: int) -> bool:
        """Count one more occurrence of the (kind, where) finding, last seen at `step`; False if there is none."""
        old = self.finding(kind, where)
        if old is None:
            return False
        self.put(_replace(old, count=old.count + 1, last_step=step))
        return True

    def update_details(self, kind: str, where: str, details: Dict[str, Any]) -> Optional[Finding]:
        """Merge `details` into the (kind, where) finding; the updated finding, or None if there is none."""
        old = self.finding(kind, where)
        if old is None:
            return None
        new = _replace(old, details={**old.details, **details})
        self.put(new)
        return new

    def restart_at_step_zero(self) -> None:
        """Everything so far belongs to step 0 (the steps counted were not steps after all)."""
        self.findings[:] = [_replace(f, step=0, last_step=0) for f in self.findings]
        merged: Dict[str, Any] = {"step": 0}
        for entry in self.timeline:
            merged.update({k: v for k, v in entry.items() if k != "step"})
        self.timeline = [merged] if len(merged) > 1 else []

    def add_module(self, entry: Dict[str, Any]) -> None:
        """Add a module table entry (one per path)."""
        self.modules.append(entry)

    def add_timeline(self, entry: Dict[str, Any], limit: int) -> None:
        """Add or extend the timeline entry of ``entry["step"]``, keeping at most `limit` entries.

        Past the limit every other step is dropped (the stride doubles), never the whole history.
        """
        stride = self.timeline_stride
        if entry["step"] % stride:
            return
        tl = self.timeline
        if tl and tl[-1]["step"] == entry["step"]:
            tl[-1].update(entry)
            return
        tl.append(entry)
        if len(tl) > limit:
            self.timeline_stride = stride = stride * 2
            self.timeline = [e for e in tl if e["step"] % stride == 0]

    def sorted_findings(self) -> List[Finding]:
        """Findings by severity (errors first), then by first step."""
        from .findings import SEVERITY_RANK

        return sorted(self.findings, key=lambda f: (SEVERITY_RANK.get(f.severity, 9), f.step))

    def series(self, key: str) -> List[Tuple[int, Any]]:
        """``(step, value)`` of the timeline entries that hold `key` (values as stored: NaN/Inf are strings)."""
        return [(e["step"], e[key]) for e in self.timeline if key in e and isinstance(e.get("step"), int)]

    @property
    def ranks(self) -> List[int]:
        """The ranks a merged record came from (empty for one process's record)."""
        r = self.environment.get("ranks")
        return list(r) if isinstance(r, list) else []

    @property
    def merged_by(self) -> Optional[Tuple[str, List[Any]]]:
        """``("rank", ranks)`` or ``("process", labels)`` for a merged record; None for one process's."""
        if self.ranks:
            return "rank", self.ranks
        p = self.environment.get("merged_processes")
        return ("process", list(p)) if isinstance(p, list) else None

    def summary_line(self) -> str:
        """One line: findings by severity and steps (for logs)."""
        c = self.counts()
        return (f"guard: {len(self.findings)} finding(s) ({c['error']} error, {c['warning']} warning, "
                f"{c['info']} info) in {self.steps} step(s)")

    def counts(self) -> Dict[str, int]:
        """Findings per severity."""
        out = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            out[f.severity] = out.get(f.severity, 0) + 1
        return out

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        """The ``guard-report/1`` dict (JSON-safe)."""
        out = {
            **self.extra,
            "schema": SCHEMA,
            "created": self.created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": self.environment,
            "config": self.config,
            "steps": self.steps,
            "findings": [f.to_dict() for f in self.findings],
            "timeline": list(self.timeline),
            "modules": list(self.modules),
            "internal_errors": list(self.internal_errors),
            "notices": list(self.notices),
            "cost": dict(self.cost),
        }
        return json_safe(out)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Record":
        """A Record from a ``guard-report/1`` dict; raises `SchemaError` naming the first bad field."""
        validate(data)
        known = {"schema", "created", "environment", "config", "steps", "findings", "timeline", "modules",
                 "internal_errors", "notices", "cost"}
        return cls(
            findings=[Finding.from_dict(d) for d in data.get("findings", [])],
            timeline=list(data.get("timeline", [])),
            modules=list(data.get("modules", [])),
            notices=list(data.get("notices", [])),
            internal_errors=list(data.get("internal_errors", [])),
            environment=dict(data.get("environment", {})),
            config=dict(data.get("config", {})),
            steps=int(data.get("steps", 0) or 0),
            created=data.get("created"),
            cost=dict(data.get("cost") or {}),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str) -> "Record":
        """Read and validate a dump; `SchemaError` (one line naming the file and the first bad field) otherwise.

        Missing files and other OS errors propagate as `OSError`.
        """
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaError(f"{path} is not a text file (a guard-report/1 JSON dump expected)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}); "
                              f"a guard-report/1 dump expected") from None
        except RecursionError:
            raise SchemaError(f"{path} is not a guard report (nested too deeply)") from None
        try:
            return cls.from_json(data)
        except SchemaError as exc:  # "r.json is not a guard report (...)", "r.json: findings[0]: expected ..."
            msg = str(exc)
            raise SchemaError(f"{path} {msg}" if msg.startswith("is ") else f"{path}: {msg}") from None

    @classmethod
    def of(cls, obj: Any) -> "Record":
        """`obj` as a Record: a Record as it is, a ``guard-report/1`` dict validated and converted."""
        if isinstance(obj, Record):
            return obj
        if isinstance(obj, dict):
            return cls.from_json(obj)
        raise TypeError(f"a Record or a guard-report/1 dict expected, got {type(obj).__name__}")

    # -- several ranks / processes -----------------------------------------------------------------
    @classmethod
    def merge(cls, records: Sequence["Record"], names: Sequence[str] = ()) -> "Record":
        """One record from several (one per rank or process): every finding, tagged with its ``rank``.

        The timeline is the lowest rank's; modules are the union by path.
        """
        if len(records) == 1:
            return records[0]

        def rank_of(i: int) -> int:
            r = records[i].environment.get("rank")
            return r if isinstance(r, int) else i

        # Dumps of one run's processes (TORCH_GUARD's main and children, no torch.distributed): told apart by
        # process ("main", "pid123"), not by a rank none of them had.
        distributed = any(isinstance(r.environment.get("rank"), int) for r in records)

        def process_of(i: int) -> str:
            return str(records[i].environment.get("process") or "main")

        order = sorted(range(len(records)), key=rank_of if distributed else (lambda i: (process_of(i) != "main", i)))
        first = records[order[0]]
        findings: List[Finding] = []
        modules: Dict[Any, Dict[str, Any]] = {}
        for i in order:
            for f in records[i].findings:
                details = {**f.details}
                if distributed:
                    details.setdefault("rank", rank_of(i))
                else:
                    details.setdefault("process", process_of(i))
                findings.append(_replace(f, details=details))
            for m in records[i].modules:
                modules.setdefault(m.get("path"), m)
        env = dict(first.environment)
        if distributed:
            env["ranks"] = [rank_of(i) for i in order]
        else:
            env["merged_processes"] = [process_of(i) for i in order]
        env.pop("rank", None)
        return cls(
            findings=findings,
            timeline=list(first.timeline),
            modules=list(modules.values()),
            notices=[n for r in records for n in r.notices if n],
            internal_errors=[e for r in records for e in r.internal_errors],
            environment=env,
            config=dict(first.config),
            steps=max(r.steps for r in records),
            created=first.created,
            extra={**first.extra, "merged_from": list(names)},
        )


# -- schema validation -----------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (not isinstance(v, float) or math.isfinite(v))


_STR = ("a string", lambda v: isinstance(v, str))
_OPT_STR = ("a string or null", lambda v: v is None or isinstance(v, str))
_INT = ("an integer", _is_int)
_OPT_INT = ("an integer or null", lambda v: v is None or _is_int(v))
_OBJ = ("an object", lambda v: isinstance(v, dict))
_LIST = ("a list", lambda v: isinstance(v, list))
# dumps store NaN/Inf as strings ("nan", "inf"); None where a value was dropped
_VALUE = ("a number, a string or null", lambda v: v is None or _is_num(v) or isinstance(v, str))

Spec = Dict[str, Tuple[Tuple[str, Callable[[Any], bool]], bool]]  # field -> ((what, test), required)

def _iso(v: Any) -> bool:
    if v is None:
        return True
    if not isinstance(v, str):
        return False
    try:
        _dt.datetime.fromisoformat(v)
    except ValueError:
        return False
    return True


_NAT = ("an integer >= 0", lambda v: _is_int(v) and v >= 0)
_OPT_NAT = ("an integer >= 0 or null", lambda v: v is None or (_is_int(v) and v >= 0))
_FINDING: Spec = {
    "kind": (("a finding kind of the vocabulary (python -m guard checks)", lambda v: isinstance(v, str) and is_kind(v)),
             True),
    "severity": (("one of " + ", ".join(SEVERITIES), lambda v: v in SEVERITIES), True),
    "message": (_STR, True), "hint": (_STR, True), "where": (_STR, True), "step": (_NAT, True),
    "count": (("an integer >= 1", lambda v: _is_int(v) and v >= 1), False), "source": (_OPT_STR, False),
    "details": (_OBJ, False), "last_step": (_OPT_NAT, False),
}
_TIMELINE: Spec = {"step": (_INT, True), "loss": (_VALUE, False), "grad_norm": (_VALUE, False),
                   "skipped": (("true, false or null", lambda v: v is None or isinstance(v, (bool, int))), False)}
_MODULE: Spec = {"path": (_STR, True), "type": (_OPT_STR, False),
                 "output_shape": (("a list, a string or null", lambda v: v is None or isinstance(v, (list, str))), False),
                 "dtype": (_OPT_STR, False), "device": (_OPT_STR, False), "params": (_OPT_NAT, False)}
_INTERNAL: Spec = {"check": (_OPT_STR, False), "error": (_OPT_STR, False), "at": (_OPT_STR, False),
                   "step": (_OPT_INT, False)}
_ENVIRONMENT: Spec = {"python": (_OPT_STR, False), "torch": (_OPT_STR, False), "platform": (_OPT_STR, False),
                      "argv": (_LIST, False), "devices": (_LIST, False), "rank": (_INT, False),
                      "world_size": (_INT, False), "pid": (_INT, False),
                      "ranks": (("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))), False)}
_COST: Spec = {"overhead": (_VALUE, False), "budget": (("a number or null", lambda v: v is None or _is_num(v)), False),
               "period": (_OPT_NAT, False), "max_period": (_OPT_NAT, False), "steps_measured": (_OPT_NAT, False),
               "sampled_checks": (("a list of strings", lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v)),
                                  False),
               "guard_seconds": (_VALUE, False), "step_seconds": (_VALUE, False)}
_CONFIG: Spec = {"checks": (_LIST, False), "mode": (_OPT_STR, False), "every": (_INT, False)}
_TOP: Spec = {"created": (("an ISO 8601 time or null", _iso), False), "environment": (_OBJ, False),
              "config": (_OBJ, False), "cost": (_OBJ, False),
              "processes": (("a list of objects", lambda v: isinstance(v, list) and all(isinstance(p, dict) for p in v)),
                            False),
              "steps": (("an integer >= 0", lambda v: _is_int(v) and v >= 0), False),
              "findings": (_LIST, False), "timeline": (_LIST, False), "modules": (_LIST, False),
              "internal_errors": (_LIST, False),
              "notices": (("a list of strings", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)), False)}


def _shown(v: Any) -> str:
    text = json.dumps(v)[:40] if _depth(v) <= 2 else type(v).__name__
    return text if len(text) < 40 else text[:37] + "..."


def _depth(value: Any) -> int:
    """Nesting depth of lists/objects, without recursion (a hostile file can nest 100,000 levels)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _check(obj: Dict[str, Any], spec: Spec, path: str) -> None:
    for name, ((what, ok), required) in spec.items():
        where = f"{path}.{name}" if path else name
        if name not in obj:
            if required:
                raise SchemaError(f"{where}: missing ({what} expected)")
            continue
        if not ok(obj[name]):
            raise SchemaError(f"{where}: expected {what}, got {_shown(obj[name])}")


def _check_list(items: List[Any], spec: Spec, path: str) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise SchemaError(f"{path}[{i}]: expected an object, got {_shown(item)}")
        _check(item, spec, f"{path}[{i}]")


def validate(data: Any) -> None:
    """Check a loaded dump against the ``guard-report/1`` schema, field by field.

    Raises `SchemaError` whose message starts with the path of the first bad field
    (``findings[0]: expected an object, got 1``). Unknown keys are allowed (newer writers).
    """
    if not isinstance(data, dict):
        raise SchemaError(f"is not a guard report (a JSON object expected at the top, got {_shown(data)})")
    if data.get("schema") != SCHEMA:
        raise SchemaError(f"is not a guard report (schema {SCHEMA!r} expected, got {_shown(data.get('schema'))})")
    if _depth(data) > MAX_DEPTH:
        raise SchemaError(f"is not a guard report (nested deeper than {MAX_DEPTH} levels)")
    _check(data, _TOP, "")
    if "environment" in data:
        _check(data["environment"], _ENVIRONMENT, "environment")
    if "config" in data:
        _check(data["config"], _CONFIG, "config")
    if "cost" in data:
        _check(data["cost"], _COST, "cost")
    for name, spec in (("findings", _FINDING), ("timeline", _TIMELINE), ("modules", _MODULE),
                       ("internal_errors", _INTERNAL)):
        _check_list(data.get(name, []), spec, name)
    for i, f in enumerate(data.get("findings", [])):
        if f.get("last_step") is not None and f["last_step"] < f["step"]:
            raise SchemaError(f"findings[{i}].last_step: expected an integer >= step ({f['step']}), "
                              f"got {_shown(f['last_step'])}")


def _replace(f: Finding, **changes: Any) -> Finding:
    import dataclasses

    return dataclasses.replace(f, **changes)


__all__: Tuple[str, ...] = ("SCHEMA", "Record", "SchemaError", "validate")
