"""Arguments and ``TORCH_GUARD_*`` environment parsing and validation.

Every bad value raises `ConfigError` with one line naming where the value came
from, the value, and what is allowed (pytest-timeout style).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple, Union

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
    budget: Optional[float] = None
    #: a process-wide guard (what TORCH_GUARD starts): one report per process, steps aside for guards in the code
    background: bool = False
    extras: Dict[str, Any] = field(default_factory=dict)
    #: the enabled checks' names (a check is built when selected; `kinds` filters what it may report)
    checks: FrozenSet[str] = frozenset()

    def to_dict(self) -> Dict[str, Any]:
        return {
            "checks": list(self.checks_spec),
            "kinds": sorted(self.kinds),
            "mode": self.mode,
            "report": self.report,
            "live": self.live,
            "every": self.every,
            "snoop": self.snoop,
            "budget": self.budget,
        }


def as_list(obj: Any, what: str, typ: type, allowed: str) -> List[Any]:
    """`obj` as a list of `typ` (None: empty); anything else is a one-line `ConfigError` naming `what`."""
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for it in items:
        if not isinstance(it, typ):
            raise ConfigError(f"guard: {what}={type(it).__name__} object is not {allowed}; allowed: {allowed}, a list of them, or None")
    return items


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
    except (TypeError, ValueError, OverflowError):  # OverflowError: float("inf")
        ok = False
    if not ok or n < 1:
        raise ConfigError(f"guard: {origin}={value!r} is not a step interval; allowed: an integer >= 1")
    return n


def parse_budget(value: Any, origin: str = "budget") -> Optional[float]:
    """None (no budget) or a fraction of step time in (0, 1], e.g. 0.05."""
    if value is None:
        return None
    try:
        f = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        f = float("nan")
    if not (0 < f <= 1):
        raise ConfigError(f"guard: {origin}={value!r} is not an overhead budget; allowed: None or a fraction "
                          f"in (0, 1], e.g. 0.05")
    return f


def _environment_guard_running() -> bool:
    from ._procs import environment_guard_running  # (guard's process bookkeeping imports the config)

    return environment_guard_running()


def parse_live(value: Any, origin: str = "live", default: Optional[bool] = None) -> Union[bool, str]:
    """``live``: None means ``TORCH_GUARD_LIVE`` if set, else `default`, else whether stderr is a terminal.

    The environment's guard (``TORCH_GUARD``, ``guard run``) passes ``default=True``: off a terminal its
    console prints plain lines, so CI logs and ``| tee`` show the findings and the summary."""
    if value is None:
        env = os.environ.get(f"{ENV_PREFIX}_LIVE")
        if env is not None:
            return parse_live(env, f"{ENV_PREFIX}_LIVE")
        return default if default is not None else _stderr_is_tty()
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in LIVE_VALUES + ("true", "false"):
        v = value.strip().lower()
        return "all" if v == "all" else v in ("1", "true")
    raise ConfigError(f"guard: {origin}={value!r} is not a live setting; allowed: True, False, 'all' (env: 0, 1, all)")


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except Exception:
        return False


def _ours(path: str) -> bool:
    """Whether `path` may be replaced by a report: absent, empty, or a report guard wrote (JSON or HTML).

    A typo or ``report=__file__`` must not replace a script, a config or a system file with a report."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            return not os.path.lexists(path) or os.path.isfile(path)
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return True  # unreadable: the write itself will say what is wrong
    return b'"schema": "guard-report/' in head or (
        head.lstrip().lower().startswith(b"<!doctype html>") and b"<title>guard report</title>" in head)


def parse_report(value: Any, origin: str = "report") -> Optional[str]:
    """The report path made absolute now (a later ``os.chdir`` does not move it), in a folder that exists and
    can be written; else one `ConfigError` line naming `origin`, the path and why."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not (isinstance(value, str) and value.strip()):
        raise ConfigError(f"guard: {origin}={value!r} is not a report path; allowed: a file path (.json or .html) or None")
    path = os.path.abspath(os.path.expanduser(value))
    folder = os.path.dirname(path)
    why = None
    allowed = "a file path in an existing, writable directory"
    if os.path.isdir(path):
        why = "it is a directory"
    elif value.endswith(("/", os.sep)):
        why = "it ends with a separator, as a directory does"
    elif not _ours(path):
        why = "a file that is not a guard report is there"
        allowed = "a new file, or a report guard wrote before (guard replaces only its own reports)"
    elif not os.path.exists(folder):
        why = f"the directory {folder} does not exist"
    elif not os.path.isdir(folder):
        why = f"{folder} is not a directory"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"the directory {folder} is not writable"
    if why is not None:
        raise ConfigError(f"guard: {origin}={value!r} cannot be written: {why}; allowed: {allowed}")
    return path


def select_checks(spec: Any, registry: Mapping[str, Any], origin: str = "checks") -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """Turn a checks spec into ``(enabled check names, enabled finding kinds)``.

    Tokens are ``"default"``, ``"all"``, a check name or a finding kind; a leading ``-``
    removes. A check name turns that check on or off (a kind that another enabled check also
    reports stays on); a kind turns only that kind's findings on or off (``"-nonfinite-grad"``).
    If the first token is a removal, the base is ``"default"``.
    """
    allowed_shape = "'default', 'all', or a list of check names"
    if isinstance(spec, str):
        tokens = [t.strip() for t in spec.split(",") if t.strip()]
    elif isinstance(spec, Iterable) and not isinstance(spec, (Mapping, bytes)):
        tokens = list(spec)
    else:
        raise ConfigError(f"guard: {origin}={spec!r} is not a checks selection; allowed: {allowed_shape}")
    if not tokens:  # an empty selection is a mistake (an unset variable in a launcher), not "the defaults"
        raise ConfigError(f"guard: {origin}={spec!r} selects nothing; allowed: {allowed_shape}")
    by_kind: Dict[str, list] = {}
    for name, check in registry.items():
        for kind in check.kinds:
            by_kind.setdefault(kind, []).append(name)
    allowed = "default, all, a check or a kind (list: python -m guard checks)"
    checks: set = set()
    kinds: set = set()
    removed: set = set()

    def add(names: Iterable[str]) -> None:
        for n in names:
            checks.add(n)
            removed.discard(n)
            kinds.update(registry[n].kinds)

    if not tokens or (isinstance(tokens[0], str) and tokens[0].startswith("-")):
        add(n for n, c in registry.items() if c.default)
    for tok in tokens:
        if not isinstance(tok, str):
            raise ConfigError(f"guard: {origin} entry {tok!r} is not a check name; allowed: {allowed}")
        neg = tok.startswith("-")
        name = tok[1:] if neg else tok
        if name.lower() in ("default", "all"):
            name = name.lower()  # as mode='Raise' is taken: 'DEFAULT', 'All'
        if name in ("default", "all") or name in registry:
            names = ([n for n, c in registry.items() if c.default] if name == "default"
                     else list(registry) if name == "all" else [name])
            if not neg:
                add(names)
                continue
            checks.difference_update(names)
            removed.update(names)
            still = {k for n in checks for k in registry[n].kinds}
            kinds.difference_update({k for n in names for k in registry[n].kinds} - still)
        elif name in by_kind:
            if neg:
                kinds.discard(name)
            else:
                kinds.add(name)
                checks.update(n for n in by_kind[name] if n not in removed)
        else:
            import difflib

            near = difflib.get_close_matches(name, ["default", "all", *registry, *by_kind], n=1, cutoff=0.75)
            hint = f"did you mean {near[0]!r}? " if near else ""
            # no near name: the check names themselves, to pick from at once (the many kinds stay behind the command)
            what = allowed if near else f"default, all, a check ({', '.join(sorted(registry))}) or a kind (list: python -m guard checks)"
            raise ConfigError(f"guard: {origin} has unknown check {name!r}; {hint}allowed: {what}")
    # A check that only adds to other checks' findings (``always``) is on whenever one of its kinds is.
    checks.update(n for n, c in registry.items() if getattr(c, "always", False) and n not in removed
                  and kinds & set(c.kinds))
    checks = {n for n in checks if kinds & set(registry[n].kinds)}
    if not checks:  # '-all', 'all,-all', '-default': a run that would print "0 finding(s)" having checked nothing
        raise ConfigError(f"guard: {origin}={spec!r} leaves no check on; allowed: {allowed_shape}, minus some "
                          f"(e.g. 'default,-input-stats')")
    return frozenset(checks), frozenset(kinds)


def make_config(registry: Mapping[str, Any], *, checks: Any = "default", mode: Any = "warn", report: Any = None,
                live: Any = None, every: Any = 1, snoop: Any = False, budget: Any = None, background: Any = False,
                origin: Optional[Mapping[str, str]] = None, **extras: Any) -> Config:
    """Validate guard() arguments into a `Config`; `origin` maps an argument to where it came from."""
    o = dict(origin or {})
    if extras:  # a typo such as chekcs="all" must not silently run the defaults
        import difflib

        name = sorted(extras)[0]
        known = ("checks", "mode", "report", "live", "every", "snoop", "budget", "background")
        near = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(f"guard: unknown option {name}={extras[name]!r}" + (f" (did you mean {near[0]}?)" if near else "")
                          + f"; allowed: model, optimizer, {', '.join(known)}")
    if isinstance(checks, Iterable) and not isinstance(checks, (str, bytes, Mapping)):
        checks = list(checks)  # a generator is read once (for the selection and for the spec kept)
    spec = tuple(checks.split(",")) if isinstance(checks, str) else tuple(checks) if isinstance(checks, Iterable) else checks
    names, kinds = select_checks(checks, registry, o.get("checks", "checks"))
    if not isinstance(snoop, bool):
        snoop = parse_bool(snoop, o.get("snoop", "snoop"))
    mode = parse_mode(mode, o.get("mode", "mode"))
    bg = background if isinstance(background, bool) else parse_bool(background, o.get("background", "background"))
    return Config(
        kinds=kinds,
        checks=names,
        checks_spec=tuple(str(s).strip() for s in spec) if isinstance(spec, tuple) else (str(spec),),
        mode=mode,
        report=parse_report(report, o.get("report", "report")),
        # record mode collects silently; the environment's guard prints off a terminal too (plain lines)
        # (a guard from the code under TORCH_GUARD prints as the environment's would: it steps aside for it)
        live=parse_live(live, o.get("live", "live"), default=False if mode == "record" else True if bg or (
            live is None and _environment_guard_running()) else None),
        every=parse_every(every, o.get("every", "every")),
        snoop=snoop,
        budget=parse_budget(budget, o.get("budget", "budget")),
        background=bg,
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


ENV_ON = ("1", "true", "on", "yes", "warn", "raise", "record")
#: every ``TORCH_GUARD*`` variable guard reads
ENV_KNOWN = (ENV_PREFIX, f"{ENV_PREFIX}_REPORT", f"{ENV_PREFIX}_CHECKS", f"{ENV_PREFIX}_LIVE", f"{ENV_PREFIX}_EVERY",
             f"{ENV_PREFIX}_SNOOP", f"{ENV_PREFIX}_BUDGET")
#: misspellings that are not near in letters but near in meaning
_ENV_MEANT = {f"{ENV_PREFIX}_MODE": f"{ENV_PREFIX}=<mode>", f"{ENV_PREFIX}_ENABLE": ENV_PREFIX,
              f"{ENV_PREFIX}_ON": ENV_PREFIX, f"{ENV_PREFIX}_PATH": f"{ENV_PREFIX}_REPORT",
              f"{ENV_PREFIX}_OUT": f"{ENV_PREFIX}_REPORT", f"{ENV_PREFIX}_OUTPUT": f"{ENV_PREFIX}_REPORT"}


def unknown_env(environ: Optional[Mapping[str, str]] = None) -> list:
    """One warning line per ``TORCH_GUARD_*`` variable guard does not read, with the closest known one."""
    import difflib

    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(env):
        if not name.startswith(f"{ENV_PREFIX}_") or name in ENV_KNOWN:
            continue
        near = (_ENV_MEANT.get(name) or (name.upper() if name.upper() in ENV_KNOWN else None)
                or next(iter(difflib.get_close_matches(name, ENV_KNOWN, n=1, cutoff=0.6)), None))
        lines.append(f"guard: warning: {name}={env[name]!r} is not a guard variable and is ignored"
                     + (f" (did you mean {near}?)" if near else "") + f"; known: {', '.join(ENV_KNOWN)}")
    return lines


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
        raise ConfigError(f"guard: {ENV_PREFIX}={raw!r} is not valid; allowed: 1 (also true, on, yes), warn, raise, "
                          f"record, or 0 (also false, off, empty) to leave guard off")
    opts: Dict[str, Any] = {"mode": "warn" if value in ("1", "true", "on", "yes") else value}
    origin = {"mode": ENV_PREFIX}
    if f"{ENV_PREFIX}_REPORT" in env:
        opts["report"] = parse_report(env[f"{ENV_PREFIX}_REPORT"], f"{ENV_PREFIX}_REPORT")
    else:
        opts["report"] = parse_report("guard-report.json", f"{ENV_PREFIX}_REPORT (default)")
    origin["report"] = f"{ENV_PREFIX}_REPORT"
    if f"{ENV_PREFIX}_CHECKS" in env:
        opts["checks"] = env[f"{ENV_PREFIX}_CHECKS"]
        if not [t for t in opts["checks"].split(",") if t.strip()]:  # said at start, before torch is imported
            raise ConfigError(f"guard: {ENV_PREFIX}_CHECKS={opts['checks']!r} selects nothing; "
                              f"allowed: 'default', 'all', or a list of check names")
        origin["checks"] = f"{ENV_PREFIX}_CHECKS"
    if f"{ENV_PREFIX}_LIVE" in env:
        opts["live"] = parse_live(env[f"{ENV_PREFIX}_LIVE"], f"{ENV_PREFIX}_LIVE")
    if f"{ENV_PREFIX}_EVERY" in env:
        opts["every"] = parse_every(env[f"{ENV_PREFIX}_EVERY"], f"{ENV_PREFIX}_EVERY")
    if f"{ENV_PREFIX}_BUDGET" in env:
        opts["budget"] = parse_budget(env[f"{ENV_PREFIX}_BUDGET"], f"{ENV_PREFIX}_BUDGET")
    if f"{ENV_PREFIX}_SNOOP" in env:
        opts["snoop"] = parse_bool(env[f"{ENV_PREFIX}_SNOOP"], f"{ENV_PREFIX}_SNOOP")
    opts["origin"] = origin
    return opts
