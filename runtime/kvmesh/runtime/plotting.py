"""matplotlib, an optional dependency (`pip install 'kvmesh[plot]'`), for the commands that write
PNG plots (`kvmesh replay --plot`, `kvmesh profile --plot`)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from kvmesh.runtime.errors import Unimplemented

__all__ = ["pyplot", "require_matplotlib"]

_MISSING = "plots need matplotlib: pip install 'kvmesh[plot]' (or matplotlib)"


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend; Unimplemented when missing."""
    try:  # imported by name: an optional dependency, absent from the type-checked environment
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise Unimplemented(_MISSING) from None


def require_matplotlib() -> None:
    """Unimplemented unless matplotlib can be imported (checked before long work whose end is
    a plot)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise Unimplemented(_MISSING)
