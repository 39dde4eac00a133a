"""The options of a ZeroMQ run, from the broker URL: ``zmq://host:5555?ack_timeout_s=2``."""

from __future__ import annotations

from dataclasses import dataclass

from broker.checks import check_int, check_positive
from broker.transport import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class ZmqOptions:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest frame; unset: what the plan needs
    max_unacked: int = 64  # learner: deltas sent and not yet acknowledged, at most
    ack_timeout_s: float = 5.0  # learner: a delta not acknowledged this long is sent again
    send_hwm: int = 1000  # messages a socket queues for one peer before it drops them
    max_batch: int = 1000  # syncer: messages taken from the socket per receive, at most
    # A snapshot is a whole fragment: on a 10 Mbit/s link a 4-fragment join takes
    # seconds, and learners retry from 0.5 s, so a short interval sent every
    # fragment again while the first answer was still on its way.
    snapshot_interval_s: float = 2.0  # syncer: one learner's snapshots, at most this often

    def __post_init__(self) -> None:
        check_int("max_message_bytes", self.max_message_bytes, minimum=1024)
        for name in ("max_unacked", "send_hwm", "max_batch"):
            check_int(name, getattr(self, name))
        check_positive("ack_timeout_s", self.ack_timeout_s)
        check_positive("snapshot_interval_s", self.snapshot_interval_s, allow_zero=True)
