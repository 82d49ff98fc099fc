"""The hook the ``torch_guard_autostart.pth`` line imports at interpreter start (standard library only).

It does nothing unless ``TORCH_GUARD`` is on. Then it finds guard's installed package while
``sys.path`` holds only the interpreter's and the environment's folders (a ``guard.py`` in the
script's folder or the working directory is not on it yet) and replaces itself by that package's
``_autostart.py``, which waits for ``import torch``.

PYTEST_DONT_REWRITE: pytest marks this distribution's modules for assertion rewriting (guard's pytest
plugin), and this one is imported at interpreter start, before pytest: without the marker pytest
warns that it cannot rewrite it, an error under ``-W error`` or ``filterwarnings = error``.
"""
import os
import sys


def _load() -> None:
    import importlib.util

    spec = importlib.util.find_spec("guard")
    if spec is None or not spec.submodule_search_locations:
        return
    path = os.path.join(list(spec.submodule_search_locations)[0], "_autostart.py")
    impl = importlib.util.spec_from_file_location(__name__, path)
    if impl is None:
        return
    mod = importlib.util.module_from_spec(impl)
    sys.modules[__name__] = mod  # `import _torch_guard_autostart` now gives guard's own module
    impl.loader.exec_module(mod)
    mod.install()


if os.environ.get("TORCH_GUARD", "").strip().lower() not in ("", "0", "off", "false") \
        and getattr(sys.modules.get(__name__), "install", None) is None:
    _load()
