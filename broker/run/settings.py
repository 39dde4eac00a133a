"""The run's shared settings: what learners, syncers and the launcher agree on.

Each setting is defined here once, with its one default. Every service's config
dataclass nests :class:`RunSettings`, and the command line maps each field onto
the same flag (``--fragments``) and environment variable (``DDILOCO_FRAGMENTS``)
for ``ddiloco local``, ``ddiloco learner``, ``ddiloco syncer`` and the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.checks import check_id, check_positive, require
from broker.identity.keys import DEFAULT_KEYS_DIR, RunKeys
from broker.url import parse_url
from broker.wire.codecs import Codec

log = logging.getLogger(__name__)

NO_BROKER = "none"  # the url of learners that have no syncer (data parallel under torchrun)


# A learner not heard from for this many heartbeat timeouts is gone for good:
# its lease slot goes to a newcomer (learner/lease.py), and a round stops
# waiting for learners that never joined (syncer/quorum.py).
GONE_AFTER_HEARTBEATS = 3


def default_quorum(learners: int) -> int:
    """K when none is given: all but one of M learners, so one straggler or one dead
    learner never holds a round up; but at least 2 where there are 2. A round
    of one delta averages nothing: at M = 2 with K = 1 the learners' sends
    fell out of step, each one's global made the other flush, and rounds of
    one delta each doubled the bytes and cost 2-10% of loss on 3 seeds of 5.
    Rounds never wait for learners that are gone (syncer/quorum.py)."""
    return min(learners, max(2, learners - 1))


@dataclass(frozen=True)
class RunSettings:
    run_id: str = "default"  # names the run's keys and messages; runs on one broker differ
    # Where the broker is. ZeroMQ: the syncers, one endpoint per shard
    # (zmq://host:port[,host:port...], in shard order), or one endpoint for all:
    # shard s at port + 2s on each address of the host (broker.zmq.addressing).
    # Redis: redis://, rediss:// or unix://. Backend options travel as query
    # parameters (zmq://h:5555?ack_timeout_s=2).
    url: str = "zmq://127.0.0.1:5555"  # the broker: zmq://HOST:PORT or redis://HOST:PORT/DB
    # Fragment p is served by syncer shard p mod syncer_shards (broker.fragments).
    syncer_shards: int = 1  # syncers sharing the run, each serving its shard of the fragments
    learners: int = 4  # M, the learners of the run
    quorum: int = 0  # K deltas that close a round; 0: M-1, at least 2 (M if fewer)
    fragments: int = 4  # P, the fragments the model is cut into
    sync_every: int = 12  # H, a multiple of P (chosen by measurement: benchmarks/README.md)
    overlap: int = 2  # tau: steps between sending a fragment and expecting its global
    steps: int = 300  # inner steps per learner
    heartbeat_timeout_s: float = 5.0  # a learner is live while heard from within this
    # learner -> syncer: fp32, bf16, int8, int4, int2 [+topDENSITY: sparse] [+zstd|+lz4] [@block]
    delta_codec: Codec = Codec("int2", "zstd")  # chosen by measurement: benchmarks/README.md
    # syncer -> learners, the same choices; lossy ones send each version as the
    # change from the one before (README: compressed downlink)
    global_codec: Codec = Codec("int2", "zstd")
    initial_model: str = "initial-model.safetensors"  # written by `ddiloco init`
    keys: str = DEFAULT_KEYS_DIR  # the run's key folder (`ddiloco keys`): join, CURVE, signing keys
    metrics_host: str = "127.0.0.1"  # where --metrics-port endpoints listen
    insecure: bool = False  # no keys: anyone who reaches the broker can read and steer the run

    @property
    def gone_after_s(self) -> float:
        """How long a learner may be silent before it is gone for good: its lease
        slot and its learner id's key binding go to others, and rounds stop
        waiting for it (GONE_AFTER_HEARTBEATS heartbeat timeouts)."""
        return GONE_AFTER_HEARTBEATS * self.heartbeat_timeout_s

    def run_keys(self, role: str) -> RunKeys | None:
        """The keys ``role`` holds (``syncer``, ``learner``, ``reader``), or None
        with ``insecure``, said loudly; :class:`ConfigError` names a missing key."""
        if self.insecure:
            log.warning(
                "INSECURE: run %r without keys (--insecure): anyone who reaches %s can "
                "read the model, join, and steer or stall the run",
                self.run_id,
                self.url,
            )
            return None
        return RunKeys.load(self.keys, role)

    def __post_init__(self) -> None:
        check_id("run_id", self.run_id)
        require(isinstance(self.url, str), f"url={self.url!r}: must be text")
        require(isinstance(self.keys, str) and self.keys != "", f"keys={self.keys!r}: a folder")
        if self.url != NO_BROKER:
            parse_url(self.url)  # its ValueError names the url and what to change
        for name in ("learners", "fragments", "sync_every", "steps", "syncer_shards"):
            require(type(getattr(self, name)) is int, f"{name} must be an integer")
            check_positive(name, getattr(self, name))
        for name in ("quorum", "overlap"):
            require(type(getattr(self, name)) is int, f"{name} must be an integer")
            check_positive(name, getattr(self, name), allow_zero=True)
        require(
            self.quorum <= self.learners,
            f"quorum={self.quorum}: at most learners={self.learners} (0: all but one)",
        )
        require(
            self.syncer_shards <= self.fragments,
            f"syncer_shards={self.syncer_shards}: at most fragments={self.fragments} "
            "(a shard serves at least one fragment)",
        )
        require(
            self.sync_every % self.fragments == 0,
            f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments}",
        )
        require(
            self.overlap < self.sync_every,
            f"overlap={self.overlap} must be smaller than sync_every={self.sync_every}",
        )
        check_positive("heartbeat_timeout_s", self.heartbeat_timeout_s)
        for name in ("delta_codec", "global_codec"):
            require(
                isinstance(getattr(self, name), Codec),
                f"{name}={getattr(self, name)!r}: give a codec such as int8 or int4+zstd",
            )
        require(bool(self.initial_model), "initial_model: give a file path")
