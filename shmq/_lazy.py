"""What shmq loads on first use: modules only some processes need, and the logger.

``import shmq`` stays close to ``import multiprocessing`` (stress/import_time.py
measures both): every spawned worker pays for it.  A module that only a rare
path needs (the resource tracker, ``secrets``, ``logging``) is named here and
imported when that path first touches it.
"""

from __future__ import annotations

import sys

#: ``typing.TYPE_CHECKING`` without importing ``typing`` (a fifth of ``import shmq``):
#: type checkers treat any ``TYPE_CHECKING`` as true.  shmq's modules import
#: their typing names under ``if TYPE_CHECKING:`` (annotations are strings).
TYPE_CHECKING = False

if TYPE_CHECKING:
    import logging
    from types import ModuleType
    from typing import Any
    from typing import overload as overload
else:
    def overload(func):
        """``typing.overload`` at run time, where it only has to step aside: each stub
        is replaced by the implementation defined after it under the same name."""
        return func


class LazyModule:
    """Stands for module ``name`` and imports it on the first attribute access."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        mod = sys.modules.get(self._name)
        if mod is None:
            __import__(self._name)
            mod = sys.modules[self._name]
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<shmq lazy module {self._name!r}>"


def logger() -> logging.Logger:
    """``logging.getLogger("shmq")``, importing ``logging`` on the first call (shmq logs
    only rare events: a recovered lock, a refused inotify instance, a failed fork hook)."""
    import logging

    return logging.getLogger("shmq")


_columnar: ModuleType | None = None


def columnar() -> ModuleType:
    """``shmq.columnar`` (numpy and Arrow frames; it imports numpy), imported on the first
    call.  Per-frame paths call this rather than importing in the function: a relative
    import of a loaded module costs 0.5-0.9 us, a third of a small put_array."""
    global _columnar
    if _columnar is None:
        from . import columnar as mod

        _columnar = mod
    return _columnar
