"""Process-wide settings that the long-lived services share."""

from __future__ import annotations

import gc
import re
import socket

_MAX_HOLDER_LEN = 64


def freeze_startup_heap() -> None:
    """Keep what the process built at startup out of every later garbage collection.

    With torch imported a process holds about 170,000 tracked objects that live
    as long as it does (modules, functions, the model). Each full collection
    walks all of them: 0.16 s measured in a syncer receiving 1 MB deltas, a
    pause in the middle of a round, or of a learner's step. ``gc.freeze`` moves
    them to a generation collections never visit; call it once, when startup
    is done (garbage made until then is collected first, not kept)."""
    gc.collect()
    gc.freeze()


def default_holder() -> str:
    """This host's name, as a lease holder (a learner's slot, a syncer's shard):
    a container's id under docker, which survives a restart of the container."""
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", socket.gethostname())[:_MAX_HOLDER_LEN]
    return name or "unnamed-host"
