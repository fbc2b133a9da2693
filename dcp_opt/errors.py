"""Exceptions raised for user errors. Each message names the field or sequence at fault."""

from __future__ import annotations


class DcpOptError(ValueError):
    """Base class: bad input that the user can fix. The CLI prints it on one line."""


class InfeasibleError(DcpOptError):
    """A sequence (or batch) cannot fit in memory under any allowed choice."""

    def __init__(
        self,
        message: str,
        *,
        sequence_id: int | None = None,
        need_bytes: float | None = None,
        capacity_bytes: float | None = None,
    ):
        super().__init__(message)
        self.sequence_id = sequence_id
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes


class PlanFormatError(DcpOptError):
    """A plan JSON that does not parse into a Plan (wrong version, type or shape)."""


def require(cond: bool, field: str, message: str) -> None:
    """Raise DcpOptError('<field>: <message>') unless cond holds."""
    if not cond:
        raise DcpOptError(f"{field}: {message}")
