"""The optional guard used by every healthy script."""
from contextlib import contextmanager

from guard import guard


@contextmanager
def maybe_guard(use, model=None, optimizer=None, **options):
    """``guard(model, optimizer, **options)`` when `use`, else nothing (yields None)."""
    if not use:
        yield None
        return
    with guard(model, optimizer, **options) as g:
        yield g
