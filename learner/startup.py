"""How a learner process starts and ends: the ``ddiloco learner`` and
``ddiloco evaluator`` services, beside the learner they run.

A learner may start as a warm spare (its imports done, waiting on stdin to be
told which learner it replaces), take a slot lease when it does not name
itself (:mod:`learner.lease`), and under torchrun leave without interpreter
teardown once everything is flushed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from types import FrameType

from broker.errors import ConfigError
from broker.identity.keys import Identity, identity_path
from broker.runtime import default_holder
from learner.config import EvaluatorConfig, LearnerConfig
from learner.lease import AUTO_ID, SlotLease, learner_id_of, shard_of

# Set in a warm spare's environment: wait for a line of environment on stdin,
# then run as the learner it names (compose/processes.py starts spares).
STANDBY_ENV = "DDILOCO_STANDBY"


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # Stopped while it waits for a slot, before it trained anything: leave at once.
    raise SystemExit(128 + signum)


def run_learner(cfg: LearnerConfig) -> int:
    """Run one learner to its end (what ``ddiloco learner`` does); returns the exit code.

    A warm spare (``STANDBY_ENV`` set) first waits, imports done, to be told
    which learner it replaces; a learner of a scaled service (``--learner-id
    auto``) first takes a slot lease; under torchrun, a rank that is done
    exits without interpreter teardown."""
    from broker.files import EventLog
    from broker.runtime import freeze_startup_heap
    from learner.worker import Learner

    if os.environ.get(STANDBY_ENV):
        # A warm spare: its imports are done; wait to be told to go on (and with
        # what environment) as the learner it replaces. No line: not needed.
        # Its imports leave the collector's reach now, while it waits, so the
        # freeze at the start of training has little left to walk.
        freeze_startup_heap()
        line = sys.stdin.readline()
        if not line:
            return 0
        os.environ.update(json.loads(line))
    signal.signal(signal.SIGTERM, _exit_on_signal)
    lease = None
    identity = None
    if cfg.learner_id == AUTO_ID:
        # A learner of a scaled service: its id and shard come from a slot lease.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--learner-id auto: give each torchrun group its own id instead")
        holder = default_holder()
        # One key for the slot and the learner it becomes: the syncer binds both to it.
        identity = Identity.kept_in(identity_path(cfg.run.run_id, holder))
        lease = SlotLease(
            cfg.run, holder, identity, on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM)
        )
        slot = lease.take(cfg.process.join_timeout_s)
        cfg = dataclasses.replace(
            cfg, learner_id=learner_id_of(slot), shard=shard_of(slot, cfg.num_shards)
        )
        print(f"learner slot {slot}: {cfg.learner_id}, shard {cfg.shard}", file=sys.stderr)
    if cfg.metrics_file:
        # One file per learner id in a folder that several learners share.
        cfg = dataclasses.replace(
            cfg, metrics_file=cfg.metrics_file.replace("{learner_id}", cfg.learner_id)
        )
        if lease is not None:
            EventLog(cfg.metrics_file, learner=cfg.learner_id).write(
                "lease", holder=lease.holder, slot=lease.slot, shard=cfg.shard
            )
    learner = Learner(cfg, identity)
    # From here SIGTERM (docker stop, a swarm scaling down, a lost slot) ends the
    # learner after its step, with what it trained sent, and exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: learner.stop_requested.set())
    try:
        result = learner.run()
    finally:
        if lease is not None:
            lease.close()
    # One write per line: the ranks of a torchrun group share stdout.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is done and flushed. Skip interpreter teardown: under
        # load, torch's gloo threads can abort it ("terminate called
        # without an active exception") and turn a finished rank's exit
        # code into SIGABRT, which makes torchrun fail the whole group.
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def run_evaluator(cfg: EvaluatorConfig) -> int:
    """Run the evaluator (what ``ddiloco evaluator`` does); returns the exit code."""
    from learner.evaluator import Evaluator

    evaluator = Evaluator(cfg)
    # SIGTERM: take a last snapshot, evaluate it, exit.
    signal.signal(signal.SIGTERM, lambda *_: evaluator.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: evaluator.stop_requested.set())
    print("ready", flush=True)
    evaluator.run()
    return 0
