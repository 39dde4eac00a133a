"""``ddiloco``: one command for every service.

ddiloco local      the main job: init, a syncer, M learners and an evaluator on this machine
ddiloco keys       make a run's keys (join secret, CURVE and signing keys); revoke, rotate
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
import json
import logging
import sys
from pathlib import Path
from typing import Any

from broker.errors import ConfigError, DdilocoError
from broker.identity.keys import DEFAULT_KEYS_DIR
from broker.runtime import stop_with_launcher

# Each command, and what it does. A command's options are added only when it
# is the one run (or for the reference, docs/cli.md): `ddiloco keys` loads
# neither torch nor the services' configs.
COMMANDS = {
    "local": "init, a syncer, M learners and an evaluator here",
    "init": "write the initial global model and its fragment plan",
    "syncer": "run one syncer",
    "learner": "run one learner",
    "evaluator": "report the held-out loss of the global model",
    "report": "write summary.json, metrics.jsonl and plots of a run folder",
    "chaos": "crash containers or local processes on a Poisson schedule",
    "keys": "make a run's keys; revoke a learner; rotate keys",
    "throttle": "rate limits on learners' links (tc tbf)",
}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


THROTTLE_ACTIONS = {
    "set": "limit each target's link to --rate in both directions",
    "show": "show each target's limits",
    "clear": "remove each target's limits",
}


KEY_ACTIONS = ("make", "revoke", "rotate", "rotate-curve", "rotate-tls", "acl", "sentinel")


def run_keys(args: argparse.Namespace) -> int:
    """``ddiloco keys``: make a run's key folder, revoke a learner (syncers shut
    it out within a second, no restart), rotate the signing key or the syncers'
    CURVE key, issue the Redis server a new TLS certificate, write its
    ``redis.acl`` again, or write a Sentinel's configuration."""
    from broker.identity import keys, tls
    from broker.redis.access import write_acl_file
    from broker.run.key_folder import make_keys

    action, folder, learner_id, force = args.action, args.keys, args.learner_id, args.force

    if action == "make":
        out = make_keys(folder, overwrite=force)
        print(
            f"run keys in {out} (0600): learners get join.secret, syncer.curve.pub, "
            "signing.pub and tls.ca.crt; tls.ca.key stays with you (docs/security.md)"
        )
    elif action == "revoke":
        if not learner_id:
            raise ConfigError("ddiloco keys revoke LEARNER_ID: name the learner")
        keys.RunKeys.load(folder, "learner")  # a folder that is a run's keys
        keys.revoke(folder, learner_id)
        print(f"{learner_id} revoked: syncers reading {folder} refuse it from now on")
    elif action == "rotate":
        public = keys.rotate_signing_key(folder)
        print(f"new signing key {public[:16]}...: listed for learners, syncers sign with it")
    elif action == "rotate-curve":
        public = keys.rotate_curve_key(folder)
        print(f"new CURVE key {public[:10]}...: learners dial it, syncers bind again with it")
    elif action == "acl":
        path = write_acl_file(folder)
        print(f"{path} written again; restart Redis with --aclfile {path} to load it")
    elif action == "sentinel":
        from broker.files import write_private
        from broker.redis.sentinel import SENTINEL_CONF, sentinel_conf

        host, _, port = args.primary.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--primary {args.primary!r}: give HOST:PORT")
        write_acl_file(folder)  # with the servers' user, which the Sentinels use
        path = Path(folder) / SENTINEL_CONF
        text = sentinel_conf(folder, (host, int(port)), args.sentinel_port, args.files)
        write_private(path, text)
        print(f"{path} (0600: it holds the servers' password) for Sentinels watching {host}:{port}")
    else:
        hosts = tls.issue_redis_cert(Path(folder))
        print(
            f"new {tls.REDIS_CERT} for {', '.join(hosts)}; Redis takes it up with "
            f"CONFIG SET tls-cert-file PATH tls-key-file PATH (new connections use it)"
        )
    return 0


def _config_class(command: str) -> type:
    """The config dataclass of a command that has one."""
    if command == "local":
        from compose.local import LocalConfig

        return LocalConfig
    if command == "report":
        from compose.reporter import ReportConfig

        return ReportConfig
    if command == "chaos":
        from compose.chaos_run import ChaosConfig

        return ChaosConfig
    if command == "throttle":
        from compose.throttle import ThrottleConfig

        return ThrottleConfig
    if command == "syncer":
        from syncer.config import SyncerConfig

        return SyncerConfig
    from learner.config import EvaluatorConfig, InitConfig, LearnerConfig

    return {"init": InitConfig, "learner": LearnerConfig, "evaluator": EvaluatorConfig}[command]


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "keys":
        from broker.redis.sentinel import DEFAULT_SENTINEL_PORT

        parser.add_argument(
            "action", nargs="?", default="make", choices=KEY_ACTIONS,
            help="make the keys; revoke LEARNER_ID; rotate the signing key; rotate-curve the "
            "syncers' CURVE key; rotate-tls the Redis server's certificate; acl: write "
            "redis.acl again (a folder made by an earlier release); sentinel: write "
            "sentinel.conf, a Sentinel's configuration (docs/transports.md)",
        )  # fmt: skip
        parser.add_argument("learner_id", nargs="?", help="revoke: the learner to shut out")
        parser.add_argument("--keys", default=DEFAULT_KEYS_DIR, help="the run's key folder")
        parser.add_argument("--force", action="store_true", help="make: replace existing keys")
        parser.add_argument(
            "--primary", default="redis:6379",
            help="sentinel: HOST:PORT of the primary a new run starts with",
        )  # fmt: skip
        parser.add_argument(
            "--sentinel-port", type=int, default=DEFAULT_SENTINEL_PORT,
            help="sentinel: the port it listens on",
        )  # fmt: skip
        parser.add_argument(
            "--files", default="/tls",
            help="sentinel: the folder the Sentinel reads the run's certificate from",
        )  # fmt: skip
        return
    from broker.cli_config import add_dataclass_args

    cls = _config_class(command)
    if command != "throttle":
        add_dataclass_args(parser, cls)
        return
    actions = parser.add_subparsers(dest="action", required=True)
    for action, text in THROTTLE_ACTIONS.items():
        add_dataclass_args(actions.add_parser(action, help=text), cls)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ddiloco`` parser, with the options of ``command`` (every command's
    when None: the reference in docs/cli.md is made from that one).
    :class:`ConfigError` for a DDILOCO_* variable that does not parse."""
    parser = argparse.ArgumentParser(
        prog="ddiloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=text)
        if command is None or command == name:
            _add_options(command_parser, name)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names (the first word that is one), if any."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(_command_in(argv) or "")
    except ConfigError as e:  # a DDILOCO_* variable that does not parse
        print(f"ddiloco: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    stop_with_launcher()
    try:
        if args.command == "keys":
            return run_keys(args)
        return _run(args)
    except (DdilocoError, OSError) as e:
        # What a user can fix (a bad value, a port in use, a path that is a file):
        # one line that says which, not a traceback. Anything else is a bug: its
        # traceback is what to report.
        print(f"ddiloco {args.command}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    """A command that has a config dataclass, run."""
    from broker.cli_config import dataclass_from_args

    cfg: Any = dataclass_from_args(_config_class(args.command), args)
    if args.command == "local":
        from compose.local import run_local

        return run_local(cfg)
    if args.command == "report":
        from compose.reporter import run_report

        return run_report(cfg)
    if args.command == "chaos":
        from compose.chaos_run import run_chaos

        return run_chaos(cfg)
    if args.command == "throttle":
        from compose.throttle import apply

        for record in apply(args.action, cfg):
            print(json.dumps(record), flush=True)
        return 0
    if args.command == "init":
        from learner.workload import write_initial

        write_initial(cfg.run, cfg.workload)
        return 0
    if args.command in ("learner", "evaluator"):
        from learner.startup import run_evaluator, run_learner

        return run_learner(cfg) if args.command == "learner" else run_evaluator(cfg)
    from syncer.service import run_syncer

    run_syncer(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
