"""The check contract: what a check declares (`Check`) and what it may use (`CheckContext`).

A check never installs hooks itself. It declares:

* ``name`` - the check's selection name (``checks=["-name"]`` turns only this check off),
* ``kinds`` - ``{"kind": ("severity", "what is wrong, one line")}``: the findings it reports
  (``findings.KINDS`` and the README's checks table are generated from these),
* ``default`` - whether ``checks="default"`` turns it on,
* ``patches`` - ``{event: "dotted.target"}`` shared functions it wants observed,
* ``watches(module)`` / ``steady(module, output)`` - which layers' calls it wants, first and
  after their first call (a layer nobody keeps loses its hooks),

and implements ``on_<event>`` methods (a misspelt one is an error when the class is made).
The guard installs only what the active checks handle and routes each event to them. Events:

``start()``, ``forward_pre(module, path, args, kwargs, is_root)``,
``forward(module, path, args, kwargs, output, is_root)``,
``backward(tensors, kwargs)``, ``backward_done(tensors, kwargs)``,
``step_pre(optimizer)``, ``step_post(optimizer)``, ``step_end(step)``,
``resolved()`` (after staged device values were read: once per step, and when the user reads
findings mid-step, then with ``guard.mid_step`` True: end-of-step work waits for the step's end),
``exception(exc)`` (escaping the guarded block), ``exit()``, ``wake()`` (to a costly check
about to be sent events again after steps a budget sampled it out of), and for each
declared patch ``<event>(args, kwargs)``, ``<event>_done(args, kwargs, result)``,
``<event>_error(args, kwargs, exc)``.

A check reaches the running guard only through ``self.g``, a `CheckContext`.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

from ..findings import KINDS, Finding

try:
    from typing import Protocol
except ImportError:  # pragma: no cover - Python < 3.8
    Protocol = object  # type: ignore[assignment,misc]

CORE_EVENTS = (
    "start", "forward_pre", "forward", "backward", "backward_done", "step_pre", "step_post",
    "step_end", "resolved", "exception", "exit", "wake",
)


class CheckContext(Protocol):
    """Everything a check may use of the running guard (``self.g``); nothing else is part of the contract."""

    #: the validated settings (``config.mode``, ``config.kinds``, ``config.every``, ``config.snoop``, ...)
    config: Any
    #: the current step (optimizer steps so far; backward() calls without an optimizer)
    step: int
    #: whether per-step device checks run this step (``every=N``)
    sampling: bool
    #: whether costly checks run this step (False on the steps a ``budget`` samples out)
    costly_step: bool
    #: True while staged values are resolved because the user reads findings mid-step
    mid_step: bool
    #: backward() calls passed over because no watched model ran since the last (a model guard; another model's)
    backwards_elsewhere: int
    #: the host value of the loss of the step whose staged values are being read (None before it is read)
    step_loss: Optional[float]
    #: autograd's sequence number of the newest node behind the last backward() that completed (-1: none yet):
    #: nodes numbered up to it were made before that backward, which freed what they saved
    graph_seq: int
    first_graph_seq: int

    # -- findings
    def emit(self, kind: str, where: str, message: str, hint: str, *, check: Any = None, step: Optional[int] = None,
             source: Optional[str] = None, details: Optional[Dict[str, Any]] = None,
             severity: Optional[str] = None, seen: Optional[int] = None) -> Optional[Finding]:
        """Report a finding (the first of each (kind, where); repeats are counted). `step` is where the condition
        began, `seen` (default `step`) the step it is seen at, the finding's `last_step`."""

    def seen_again(self, kind: str, where: str) -> None:
        """A reported condition that lasts is seen at this step too (the finding's count and last_step)."""

    def update_details(self, kind: str, where: str, **details: Any) -> Optional[Finding]:
        """Add details to a recorded finding."""

    @property
    def findings(self) -> List[Finding]:
        """The findings so far."""

    def timeline_note(self, **values: Any) -> None:
        """Add values to this step's timeline entry."""

    def notice(self, message: str) -> None:
        """Say once what guard cannot check (not a finding)."""

    # -- device values, read once per step
    def stage(self, value: Any, callback: Callable[[float], None]) -> None:
        """Keep a 0-dim device tensor; ``callback(host_value)`` when the step resolves."""

    def stage_flag(self, ok: Any, on_fail: Callable[[], None]) -> None:
        """Keep a 0-dim bool tensor; ``on_fail()`` when it is False at resolution."""

    def stage_batch(self, collect: Callable[[], List[Tuple[Any, Callable[[List[float]], None]]]]) -> None:
        """At resolution ``collect()`` returns ``[(tensor, callback(values))]`` to read in the same transfer."""

    def flush(self) -> None:
        """Resolve staged values now."""

    def grad_norms(self, optimizer: Any = None) -> Any:
        """This step's per-parameter gradient norms (`guard.staging.GradNorms`), computed once."""

    def forget_grad_norms(self, optimizer: Any = None) -> None:
        """Drop this step's cached norms (gradients changed in place)."""

    # -- the watched code
    @property
    def models(self) -> List[Any]:
        """The watched models (unwrapped from DataParallel/DDP)."""

    @property
    def roots(self) -> List[Any]:
        """The watched models, or under a global guard the outermost modules seen called."""

    @property
    def optimizers(self) -> List[Any]:
        """Optimizers given or seen stepping."""

    @property
    def given_optimizers(self) -> bool:
        """Whether optimizers were handed to ``guard()``."""

    @property
    def has_optimizer(self) -> bool:
        """Whether an optimizer drives the steps."""

    def is_primary(self, optimizer: Any) -> bool:
        """Whether `optimizer`'s step ends the guard's step."""

    def follow(self, check: Any, on: bool) -> None:
        """Route every step's events to `check` while `on` (see `Check.follow`)."""

    def mute(self, check: Any, event: str) -> None:
        """Send `event` to `check` no more (see `Check.mute`)."""

    def skipped_step(self, optimizer: Any) -> None:
        """An AMP scaler skipped `optimizer`'s step: end the step without step hooks."""

    def named_parameters(self) -> List[Tuple[str, Any]]:
        """Parameters of the watched models (or of the roots seen)."""

    def path_of(self, module: Any) -> str:
        """A module's path in its model."""

    def known_path(self, module: Any) -> Optional[str]:
        """A watched module's path, else None."""

    def param_name(self, param: Any) -> str:
        """A parameter's qualified name."""

    def source(self) -> Optional[str]:
        """``file:line`` of the user's code running now."""

    @property
    def root_source(self) -> Optional[str]:
        """Source line of the current outermost model call."""

    # -- hooks, through the guard's one installer (removed at close)
    def grad_hook(self, param: Any, fn: Callable[[Any], None]) -> Any:
        """Call ``fn(param)`` when backward accumulates into its gradient."""

    def graph_prehook(self, node: Any, fn: Callable) -> None:
        """A pre-hook on an autograd node."""

    def replace_attr(self, obj: Any, name: str, value: Any) -> Any:
        """Set an attribute until close (then restored)."""

    def contain(self, check: Any, exc: BaseException) -> None:
        """Switch `check` off after its own failure (said once; training continues)."""


class Check:
    """Base class of all checks; subclasses live one per file in ``guard/checks/``."""

    name: ClassVar[str] = ""
    kinds: ClassVar[Dict[str, Tuple[str, str]]] = {}
    default: ClassVar[bool] = True
    #: built whenever one of its kinds is on, whatever ``checks=`` says (it adds to other checks' findings)
    always: ClassVar[bool] = False
    description: ClassVar[str] = ""
    patches: ClassVar[Dict[str, str]] = {}
    #: a costly check may be run every N-th step only, when ``guard(budget=...)`` is exceeded; the
    #: cheap, exact ones (NaN/Inf, AMP) never are. On the steps it is sampled out of, it is sent no
    #: event at all (its handlers leave the router's tables, from the end of the step before to the
    #: end of that step; ``start``, ``exit``, ``exception`` and ``*_error`` still reach it), so it sees
    #: whole steps or none. Only checks whose condition persists over steps (a property of the code)
    #: should be costly: sampling then delays a report, it does not lose it.
    costly: ClassVar[bool] = False
    #: set by `follow`: this check runs on every step although ``every=N`` or a budget samples it
    following: bool = False

    def __init__(self, guard: CheckContext):
        self.g = guard

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.name:
            return  # an abstract helper class
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(cls.kinds, dict) or not all(
                isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in cls.kinds.values()):
            raise TypeError(f"guard: {where}.kinds must be a dict {{'kind': ('severity', 'one-line description')}}")
        events = set(CORE_EVENTS)
        for ev in cls.patches:
            events |= {ev, ev + "_done", ev + "_error"}
        for attr in dir(cls):
            if attr.startswith("on_") and callable(getattr(cls, attr)) and attr[3:] not in events:
                import difflib

                near = difflib.get_close_matches(attr[3:], sorted(events), n=1)
                raise TypeError(f"guard: {where}.{attr} handles no event" + (f" (did you mean on_{near[0]}?)" if near else "")
                                + f"; allowed: {', '.join('on_' + e for e in sorted(events))}")
        for kind, (severity, _) in cls.kinds.items():
            KINDS.check(kind, severity, cls.name)  # all of them first: a bad class declares nothing
        for kind, (severity, description) in cls.kinds.items():
            KINDS.declare(kind, severity, description, cls.name)

    @classmethod
    def events(cls) -> Tuple[str, ...]:
        """The events this check handles (the ``on_*`` methods it defines)."""
        names = set(CORE_EVENTS)
        for ev in cls.patches:
            names |= {ev, ev + "_done", ev + "_error"}
        return tuple(sorted(e for e in names if callable(getattr(cls, "on_" + e, None))))

    def watches(self, module: Any) -> bool:
        """Whether this check's forward handlers want `module`'s non-root calls (asked once per module).

        Root calls always reach every check. Narrowing this (to BatchNorm layers, to modules with
        parameters, ...) takes the check off the hot path of every other layer.
        """
        return True

    def steady(self, module: Any, output: Any) -> bool:
        """After `module`'s first (non-root) call returned `output`: keep watching its later calls?

        Asked once per module, only of checks that watch it. A module no check keeps loses its hooks,
        so that layers with nothing left to check cost nothing per call (the module table, the device
        comparison and the like need one call of each layer).
        """
        return True

    @property
    def sampling(self) -> bool:
        """Whether this check does its per-step work now (``every=N``, and the budget if it is costly)."""
        g = self.g
        return self.following or (g.sampling and (g.costly_step or not self.costly))

    #: events this check has stopped listening to (`mute`): the router leaves its handlers for them out
    muted: frozenset = frozenset()

    def mute(self, event: str) -> None:
        """Stop receiving `event` for good (a look that runs on the first steps only: one rebuild of the handler
        tables, and no handler call per step after it)."""
        if event not in self.muted:
            self.muted = self.muted | {event}  # (left out of every later rebuild of the tables too)
            self.g.mute(self, event)

    def follow(self, on: bool) -> None:
        """Run on every step while `on`, although ``every=N`` or a budget samples this check.

        For a check that reports a condition only after several steps in a row: sampled steps are not
        consecutive, and a pattern with the sampling's period (a head trained every other step) would
        look like a run. Such a check follows the steps from the first one of a run to its end.
        """
        if on != self.following:
            self.following = on
            self.g.follow(self, on)

    def emit(self, kind: str, where: str, message: str, hint: str, **kw: Any) -> None:
        """Report a finding (de-duplicated by kind and where)."""
        self.g.emit(kind, where, message, hint, check=self, **kw)


def add_call_handlers(cls: type, event_prefix: str, names: Any, method: str) -> None:
    """Give `cls` one ``on_<event_prefix><name>`` handler per patched function in `names`, each calling
    ``self.<method>(name, args, kwargs)`` (checks that look at a family of loss functions the same way)."""
    def make(fn: str) -> Callable:
        def on_call(self: Any, args: tuple, kwargs: dict) -> None:
            getattr(self, method)(fn, args, kwargs)
        on_call.__name__ = f"on_{event_prefix}{fn}"
        return on_call

    for fn in names:
        setattr(cls, f"on_{event_prefix}{fn}", make(fn))
