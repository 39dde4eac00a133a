"""The project's one exception tree.

Every error the project raises on purpose is a :class:`DdilocoError`; a caller
that wants "anything ddiloco refused" catches that. Transports turn their
library's errors (ZeroMQ, Redis) into :class:`TransportError` at the seam, so
no module outside ``broker/`` ever sees one. Configuration and wire errors are
also ``ValueError`` (a bad value), as Python's own parsers do.
"""

from __future__ import annotations

from typing import Any


class DdilocoError(Exception):
    """The root: something ddiloco cannot do, and says why."""


class ConfigError(DdilocoError, ValueError):
    """A setting, URL, file or argument that cannot work; the message says what to change."""


class TransportError(DdilocoError):
    """The transport could not do what was asked within its timeout."""


class Fenced(TransportError):
    """Another syncer holds this one's shard under a later term: it must write
    nothing more (it was frozen or cut off past its lease)."""


class Backpressure(TransportError):
    """Too many deltas are waiting for acknowledgement; try again later."""


class WireError(DdilocoError, ValueError):
    """A frame that cannot be accepted; ``reason`` names why (for metrics)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class CodecError(DdilocoError, ValueError):
    """Bytes that do not decode under the named codec, or a bad codec name."""


class MeasurementError(DdilocoError):
    """A benchmark or tool could not measure what it was asked: a process it
    started did not come up, or finished without the figures."""


class TrustError(DdilocoError):
    """A delta the syncer will not merge; ``reason`` names why (for metrics)."""

    def __init__(self, reason: str, detail: str = "", refs: list[Any] | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.refs = refs or []  # what to answer (a round's refused deltas)
