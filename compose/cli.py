"""``ddiloco``: one command for every service.

ddiloco local      the main job: init, a syncer, M learners and an evaluator on this machine
ddiloco init       write the initial global model and its fragment plan (the syncer's start)
ddiloco syncer     one syncer
ddiloco learner    one learner (what a container or a remote host runs)
ddiloco evaluator  follow the global model and report its held-out loss
ddiloco report     a run folder's events into summary.json, metrics.jsonl and plots
ddiloco chaos      crash learner, syncer or Redis containers (or local processes) on a schedule
ddiloco throttle   set, show or clear a rate limit on learners' links (tc tbf, both ways)

Every setting is a flag and a DDILOCO_* environment variable; settings that
several commands share (``--fragments``, ``--url``, ...) have the same flag,
variable and default in all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from broker.errors import ConfigError, DdilocoError
from compose.chaos_run import ChaosConfig, run_chaos
from compose.cli_config import add_dataclass_args, dataclass_from_args
from compose.lease import AUTO_ID, SlotLease, default_holder, learner_id_of, shard_of
from compose.processes import STANDBY_ENV
from compose.reporter import ReportConfig, run_report
from compose.throttle import ThrottleConfig
from learner.config import EvaluatorConfig, InitConfig, LearnerConfig
from syncer.config import SyncerConfig

SERVICES = {
    "init": (InitConfig, "write the initial global model and its fragment plan"),
    "syncer": (SyncerConfig, "run one syncer"),
    "learner": (LearnerConfig, "run one learner"),
    "evaluator": (EvaluatorConfig, "report the held-out loss of the global model"),
}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


TOOLS = {
    "report": (ReportConfig, "write summary.json, metrics.jsonl and plots of a run folder"),
    "chaos": (ChaosConfig, "crash containers or local processes on a Poisson schedule"),
}
THROTTLE_ACTIONS = {
    "set": "limit each target's link to --rate in both directions",
    "show": "show each target's limits",
    "clear": "remove each target's limits",
}


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # Stopped while it waits for a slot, before it trained anything: leave at once.
    raise SystemExit(128 + signum)


def _run_learner(cfg: LearnerConfig) -> int:
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
    if cfg.learner_id == AUTO_ID:
        # A learner of a scaled service: its id and shard come from a slot lease.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--learner-id auto: give each torchrun group its own id instead")
        holder = default_holder()
        lease = SlotLease(cfg.run, holder, on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
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
    learner = Learner(cfg)
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


def _run_evaluator(cfg: EvaluatorConfig) -> int:
    from learner.evaluator import Evaluator

    evaluator = Evaluator(cfg)
    # SIGTERM: take a last snapshot, evaluate it, exit.
    signal.signal(signal.SIGTERM, lambda *_: evaluator.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: evaluator.stop_requested.set())
    print("ready", flush=True)
    evaluator.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    from compose.local import LocalConfig, run_local

    try:
        add_dataclass_args(
            sub.add_parser("local", help="init, a syncer, M learners and an evaluator here"),
            LocalConfig,
        )
        for name, (cls, text) in (SERVICES | TOOLS).items():
            add_dataclass_args(sub.add_parser(name, help=text), cls)
        throttle = sub.add_parser("throttle", help="rate limits on learners' links (tc tbf)")
        actions = throttle.add_subparsers(dest="action", required=True)
        for action, text in THROTTLE_ACTIONS.items():
            add_dataclass_args(actions.add_parser(action, help=text), ThrottleConfig)
    except ConfigError as e:  # a DDILOCO_* variable that does not parse
        print(f"ddiloco: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if args.command == "local":
            return run_local(dataclass_from_args(LocalConfig, args))
        if args.command == "report":
            return run_report(dataclass_from_args(ReportConfig, args))
        if args.command == "chaos":
            return run_chaos(dataclass_from_args(ChaosConfig, args))
        if args.command == "throttle":
            from compose.throttle import apply

            for record in apply(args.action, dataclass_from_args(ThrottleConfig, args)):
                print(json.dumps(record), flush=True)
            return 0
        cls = SERVICES[args.command][0]
        cfg: Any = dataclass_from_args(cls, args)
        if isinstance(cfg, InitConfig):
            from learner.workload import write_initial

            write_initial(cfg.run, cfg.workload)
            return 0
        if isinstance(cfg, LearnerConfig):
            return _run_learner(cfg)
        if isinstance(cfg, EvaluatorConfig):
            return _run_evaluator(cfg)
        from syncer.service import run_syncer

        assert isinstance(cfg, SyncerConfig)
        run_syncer(cfg)
        return 0
    except (DdilocoError, OSError) as e:
        # What a user can fix (a bad value, a port in use, a path that is a file):
        # one line that says which, not a traceback. Anything else is a bug: its
        # traceback is what to report.
        print(f"ddiloco {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
