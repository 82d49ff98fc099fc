"""Arguments and ``TORCH_GUARD_*`` environment parsing and validation.

Every bad value raises `ConfigError` with one line naming where the value came
from, the value, and what is allowed (pytest-timeout style).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Union

MODES = ("warn", "raise", "record")
LIVE_VALUES = ("0", "1", "all")
ENV_PREFIX = "TORCH_GUARD"


class ConfigError(ValueError):
    """A bad guard argument or environment value (one clear line)."""


@dataclass(frozen=True)
class Config:
    """The validated settings of one guard."""

    kinds: FrozenSet[str]
    checks_spec: tuple
    mode: str = "warn"
    report: Optional[str] = None
    live: Union[bool, str] = False
    every: int = 1
    snoop: bool = False
    extras: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "checks": list(self.checks_spec),
            "kinds": sorted(self.kinds),
            "mode": self.mode,
            "report": self.report,
            "live": self.live,
            "every": self.every,
            "snoop": self.snoop,
        }


def parse_mode(value: Any, origin: str = "mode") -> str:
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise ConfigError(f"guard: {origin}={value!r} is not a mode; allowed: {', '.join(MODES)}")


def parse_every(value: Any, origin: str = "every") -> int:
    if isinstance(value, bool):
        raise ConfigError(f"guard: {origin}={value!r} is not a step interval; allowed: an integer >= 1")
    try:
        n = int(value)
        ok = str(value).strip() == str(n) if isinstance(value, str) else n == value
    except (TypeError, ValueError):
        ok = False
    if not ok or n < 1:
        raise ConfigError(f"guard: {origin}={value!r} is not a step interval; allowed: an integer >= 1")
    return n


def parse_live(value: Any, origin: str = "live", default: bool = True) -> Union[bool, str]:
    """``live``: None means ``TORCH_GUARD_LIVE`` if set, else `default` (on, TTY or not: off a terminal
    the console prints plain lines, so CI logs and ``| tee`` show findings too)."""
    if value is None:
        env = os.environ.get(f"{ENV_PREFIX}_LIVE")
        if env is not None:
            return parse_live(env, f"{ENV_PREFIX}_LIVE")
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in LIVE_VALUES + ("true", "false"):
        v = value.strip().lower()
        return "all" if v == "all" else v in ("1", "true")
    raise ConfigError(f"guard: {origin}={value!r} is not a live setting; allowed: True, False, 'all' (env: 0, 1, all)")


def parse_report(value: Any, origin: str = "report") -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(f"guard: {origin}={value!r} is not a report path; allowed: a file path (.json or .html) or None")


def resolve_checks(spec: Any, registry: Mapping[str, Any], origin: str = "checks") -> FrozenSet[str]:
    """Turn a checks spec into the set of enabled finding kinds.

    Tokens are ``"default"``, ``"all"``, a check name or a finding kind; a
    leading ``-`` removes. The first token decides the base set: if it is a
    removal, the base is ``"default"``.
    """
    if isinstance(spec, str):
        tokens = [t.strip() for t in spec.split(",") if t.strip()]
    elif isinstance(spec, Iterable):
        tokens = list(spec)
    else:
        raise ConfigError(f"guard: {origin}={spec!r} is not a checks selection; allowed: 'default', 'all', or a list of check names")
    by_kind = {}
    for check in registry.values():
        for kind in check.kinds:
            by_kind[kind] = check
    default = frozenset(k for c in registry.values() if c.default for k in c.kinds)
    everything = frozenset(by_kind)
    allowed = "default, all, a check or a kind (list: python -m guard checks)"
    enabled: set = set()
    if not tokens or (isinstance(tokens[0], str) and tokens[0].startswith("-")):
        enabled |= default
    for tok in tokens:
        if not isinstance(tok, str):
            raise ConfigError(f"guard: {origin} entry {tok!r} is not a check name; allowed: {allowed}")
        neg = tok.startswith("-")
        name = tok[1:] if neg else tok
        if name == "default":
            kinds = default
        elif name == "all":
            kinds = everything
        elif name in registry:
            kinds = frozenset(registry[name].kinds)
        elif name in by_kind:
            kinds = frozenset([name])
        else:
            import difflib

            near = difflib.get_close_matches(name, ["default", "all", *registry, *by_kind], n=1, cutoff=0.75)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"guard: {origin} has unknown check {name!r}; {hint}allowed: {allowed}")
        if neg:
            enabled -= kinds
        else:
            enabled |= kinds
    return frozenset(enabled)


def make_config(registry: Mapping[str, Any], *, checks: Any = "default", mode: Any = "warn", report: Any = None,
                live: Any = None, every: Any = 1, snoop: Any = False, origin: Optional[Mapping[str, str]] = None,
                **extras: Any) -> Config:
    """Validate guard() arguments into a `Config`; `origin` maps an argument to where it came from."""
    o = dict(origin or {})
    if extras:  # a typo such as chekcs="all" must not silently run the defaults
        import difflib

        name = sorted(extras)[0]
        known = ("checks", "mode", "report", "live", "every", "snoop")
        near = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(f"guard: unknown option {name}={extras[name]!r}" + (f" (did you mean {near[0]}?)" if near else "")
                          + f"; allowed: model, optimizer, {', '.join(known)}")
    spec = tuple(checks.split(",")) if isinstance(checks, str) else tuple(checks) if isinstance(checks, Iterable) else checks
    kinds = resolve_checks(checks, registry, o.get("checks", "checks"))
    if not isinstance(snoop, bool):
        snoop = parse_bool(snoop, o.get("snoop", "snoop"))
    mode = parse_mode(mode, o.get("mode", "mode"))
    return Config(
        kinds=kinds,
        checks_spec=tuple(str(s).strip() for s in spec) if isinstance(spec, tuple) else (str(spec),),
        mode=mode,
        report=parse_report(report, o.get("report", "report")),
        live=parse_live(live, o.get("live", "live"), default=mode != "record"),  # record: collect silently
        every=parse_every(every, o.get("every", "every")),
        snoop=snoop,
        extras=dict(extras),
    )


def parse_bool(value: Any, origin: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"guard: {origin}={value!r} is not a switch; allowed: 0, 1")


ENV_ON = ("1", "warn", "raise", "record")


def env_options(environ: Optional[Mapping[str, str]] = None) -> Optional[Dict[str, Any]]:
    """guard() keyword arguments from ``TORCH_GUARD*``, or None when ``TORCH_GUARD`` is unset/off.

    Raises `ConfigError` naming the variable for any bad value.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PREFIX)
    if raw is None or raw.strip().lower() in ("", "0", "off", "false"):
        return None
    value = raw.strip().lower()
    if value not in ENV_ON:
        raise ConfigError(f"guard: {ENV_PREFIX}={raw!r} is not valid; allowed: 0, 1, warn, raise, record")
    opts: Dict[str, Any] = {"mode": "warn" if value == "1" else value}
    origin = {"mode": ENV_PREFIX}
    if f"{ENV_PREFIX}_REPORT" in env:
        opts["report"] = env[f"{ENV_PREFIX}_REPORT"]
        origin["report"] = f"{ENV_PREFIX}_REPORT"
    else:
        opts["report"] = "guard-report.json"
    if f"{ENV_PREFIX}_CHECKS" in env:
        opts["checks"] = env[f"{ENV_PREFIX}_CHECKS"]
        origin["checks"] = f"{ENV_PREFIX}_CHECKS"
    if f"{ENV_PREFIX}_LIVE" in env:
        opts["live"] = parse_live(env[f"{ENV_PREFIX}_LIVE"], f"{ENV_PREFIX}_LIVE")
    if f"{ENV_PREFIX}_EVERY" in env:
        opts["every"] = parse_every(env[f"{ENV_PREFIX}_EVERY"], f"{ENV_PREFIX}_EVERY")
    if f"{ENV_PREFIX}_SNOOP" in env:
        opts["snoop"] = parse_bool(env[f"{ENV_PREFIX}_SNOOP"], f"{ENV_PREFIX}_SNOOP")
    opts["origin"] = origin
    return opts
