"""Notes on the user's exception: a check that explains an error adds one line to it (PEP 678 notes)."""
from __future__ import annotations

#: how every note guard adds starts (so a second check or a nested guard adds none)
NOTE_PREFIX = "guard: "


def add_guard_note(exc: BaseException, text: str) -> bool:
    """Add `text` as a note unless guard already annotated `exc` (nested guards, two checks)."""
    if any(isinstance(n, str) and n.startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ()) or ()):
        return False
    try:
        exc.add_note(text)
    except Exception:  # an exception type that refuses notes: the finding still carries it
        return False
    return True
