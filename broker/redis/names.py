"""The Redis keys of a run, and the consumer group that reads the delta streams.

Keys of one run (``{run}`` is the run id, ``{l}`` a learner id, ``{p}`` a fragment)::

    ddiloco:{run}:deltas:{p}:{l}  stream   learner l XADDs its deltas of fragment p;
                                           the syncer consumer group ``syncers``
                                           reads them
    ddiloco:{run}:trimmed:{p}:{l} integer  entries of that stream trimmed unread
    ddiloco:{run}:heartbeat:{l}   string   learner l's latest heartbeat frame
    ddiloco:{run}:notices:{l}     stream   refusals of learner l's deltas (short
                                           MAXLEN, expires when unused)
    ddiloco:{run}:requests        stream   enrollments and lease requests, read
                                           (and deleted) by the admitting syncer
    ddiloco:{run}:grant:{k}       string   the admitting syncer's answer to key k's
                                           last lease request
    ddiloco:{run}:roster          hash     admitted learner id -> its key: the
                                           learners whose streams syncers read
    ddiloco:{run}:globals         stream   syncers XADD every new global (exact MAXLEN)
    ddiloco:{run}:model:{p}       string   a recent global of fragment p with its
                                           weights, for joiners (written every
                                           snapshot_every versions)
    ddiloco:{run}:changes:{p}     list     the changes published since, in order:
                                           with the model key, the latest version
    ddiloco:{run}:weightless:{p}  hash     the latest version's weights checksum and
                                           its frame without weights
    ddiloco:{run}:shard:{s}       string   the holder of syncer shard s's lease
                                           (:mod:`broker.redis.shards`)

A learner writes only keys named after itself; with the run's keys each
enrolled key is a Redis ACL user that may write only those
(:mod:`broker.redis.access`).
"""

from __future__ import annotations

GROUP = "syncers"
NOTICES_MAXLEN = 100  # refusals kept per learner: a learner reads them within a poll
NOTICES_TTL_S = 3600  # a notices stream nobody writes to for an hour goes away


def delta_stream_key(run_id: str, fragment: int, learner_id: str) -> str:
    return f"ddiloco:{run_id}:deltas:{fragment}:{learner_id}"


def trimmed_key(run_id: str, fragment: int, learner_id: str) -> str:
    return f"ddiloco:{run_id}:trimmed:{fragment}:{learner_id}"


def heartbeat_key(run_id: str, learner_id: str) -> str:
    return f"ddiloco:{run_id}:heartbeat:{learner_id}"


def notices_key(run_id: str, learner_id: str) -> str:
    return f"ddiloco:{run_id}:notices:{learner_id}"


def requests_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:requests"


def grant_key(run_id: str, key: str) -> str:
    return f"ddiloco:{run_id}:grant:{key[:32]}"


def roster_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:roster"


def globals_stream_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:globals"


def model_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:model:{fragment}"


def shard_key(run_id: str, shard: int) -> str:
    return f"ddiloco:{run_id}:shard:{shard}"


def term_key(run_id: str, shard: int) -> str:
    """The shard's term: one more at every new tenure of its lease, never less."""
    return f"ddiloco:{run_id}:term:{shard}"


def changes_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:changes:{fragment}"


def resume_key(run_id: str, fragment: int) -> str:
    """The syncer's state that goes with the fragment's latest snapshot (no
    member may read it): what a syncer that lost its checkpoint resumes from."""
    return f"ddiloco:{run_id}:resume:{fragment}"


def weightless_key(run_id: str, fragment: int) -> str:
    """Hash: ``crc``, the latest version's weights checksum, and ``frame``, its
    global without the weights, for joiners that hold them."""
    return f"ddiloco:{run_id}:weightless:{fragment}"
