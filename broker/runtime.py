"""Process-wide settings that the long-lived services share."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import socket

_MAX_HOLDER_LEN = 64
# Set by a launcher (``ddiloco local``) for its children: its process id.
LAUNCHER_ENV = "DDILOCO_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_launcher() -> None:
    """In a process a launcher started (:data:`LAUNCHER_ENV`): have the kernel
    send it SIGTERM when the launcher dies, so that a launcher killed outright
    leaves no service running on (Linux; elsewhere nothing), and stop at once
    if it died already. The variable is taken out of the environment: a
    process this one starts has another parent."""
    launcher = os.environ.pop(LAUNCHER_ENV, None)
    if launcher is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):  # not Linux: no such call
        return
    if os.getppid() != int(launcher):
        raise SystemExit(f"the launcher (pid {launcher}) is gone: not starting")


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
