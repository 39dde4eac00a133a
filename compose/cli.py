"""``ddiloco``: one command for every service.

ddiloco local    the main job: a syncer and M learners on this machine
ddiloco learner  one learner (what a container or a remote host runs)
ddiloco syncer   one syncer
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from compose.cli_config import add_dataclass_args, dataclass_from_args
from learner.config import LearnerConfig
from syncer.config import SyncerConfig


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    from compose.local import add_local_args

    add_local_args(sub.add_parser("local", help="run a syncer and M learners on this machine"))
    try:
        add_dataclass_args(sub.add_parser("learner", help="run one learner"), LearnerConfig)
        add_dataclass_args(sub.add_parser("syncer", help="run one syncer"), SyncerConfig)
    except ValueError as e:  # a DDILOCO_* variable that does not parse
        print(f"ddiloco: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if args.command == "learner":
            from learner.worker import Learner

            result = Learner(dataclass_from_args(LearnerConfig, args)).run()
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
        if args.command == "syncer":
            from syncer.service import run_syncer

            run_syncer(dataclass_from_args(SyncerConfig, args))
            return 0
        from compose.local import run_local

        return run_local(args)
    except (ValueError, FileNotFoundError, TimeoutError, RuntimeError) as e:
        print(f"ddiloco {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
