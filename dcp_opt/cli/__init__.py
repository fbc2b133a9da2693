"""The `dcp-opt` command line (main.py; `dcp-opt profile` in profile.py)."""

from .main import main

__all__ = ["main"]
