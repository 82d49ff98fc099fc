"""The data of a guard session: findings, timeline, module table, notices.

A live guard owns one `Record` and fills it; a dump read from disk is one
(`Record.from_json`); several ranks' or processes' dumps merge into one
(`Record.merge`). Renderers take a `Record` and read its typed fields, so a
dump written yesterday renders the same as a live session.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .findings import Finding, json_safe

SCHEMA = "guard-report/1"


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
        """A Record from a ``guard-report/1`` dict (assumed valid; see ``guard.report.model.validate``)."""
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

        order = sorted(range(len(records)), key=rank_of)
        first = records[order[0]]
        findings: List[Finding] = []
        modules: Dict[Any, Dict[str, Any]] = {}
        for i in order:
            for f in records[i].findings:
                details = {**f.details}
                details.setdefault("rank", rank_of(i))
                findings.append(_replace(f, details=details))
            for m in records[i].modules:
                modules.setdefault(m.get("path"), m)
        env = dict(first.environment)
        env["ranks"] = [rank_of(i) for i in order]
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


def _replace(f: Finding, **changes: Any) -> Finding:
    import dataclasses

    return dataclasses.replace(f, **changes)


__all__: Tuple[str, ...] = ("SCHEMA", "Record")
