"""Load a repository script (benchmarks/, scripts/) as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(path: str | Path):
    """The module at `path` (relative to the repository root, or absolute), executed once
    more on each call. Registered in sys.modules under its file name first: a dataclass
    defined in it looks its module up there."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
