"""The error a metric raises when the trace lacks what it needs (views turn it into ``NotApplicable``)."""

from __future__ import annotations


class MissingTraceData(LookupError):
    """The trace lacks the arrays a metric needs (the message names them and how to record them)."""
