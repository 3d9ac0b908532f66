"""The command line: one module per command family; the group is assembled in main.py."""

from .main import main

__all__ = ["main"]
