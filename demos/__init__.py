"""Runnable demos, one per pitfall: ``python demos/<name>.py`` (buggy) or ``--fixed`` (the clean twin)."""
