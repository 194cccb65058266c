"""Errors of the model layer that more than one of its modules raises."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded (missing, corrupt, or for another model)."""
