"""``ddiloco``: one command for every service.

ddiloco local      the main job: init, a syncer, M learners and an evaluator on this machine
ddiloco init       write the initial global model and its fragment plan (the syncer's start)
ddiloco syncer     one syncer
ddiloco learner    one learner (what a container or a remote host runs)
ddiloco evaluator  follow the global model and report its held-out loss

Every setting is a flag and a DDILOCO_* environment variable; settings that
several commands share (``--fragments``, ``--url``, ...) have the same flag,
variable and default in all of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

import zmq

from compose.cli_config import add_dataclass_args, dataclass_from_args
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


def _run_learner(cfg: LearnerConfig) -> int:
    from learner.worker import Learner

    learner = Learner(cfg)
    # SIGTERM (docker stop, a scheduler): finish the step, send what is unsent, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: learner.stop_requested.set())
    result = learner.run()
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
        for name, (cls, text) in SERVICES.items():
            add_dataclass_args(sub.add_parser(name, help=text), cls)
    except ValueError as e:  # a DDILOCO_* variable that does not parse
        print(f"ddiloco: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if args.command == "local":
            return run_local(dataclass_from_args(LocalConfig, args))
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
    except (ValueError, OSError, TimeoutError, RuntimeError, zmq.ZMQError) as e:
        # What a user can fix (a bad value, a port in use, a path that is a file):
        # one line that says which, not a traceback.
        print(f"ddiloco {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
