"""docs/cli.md, the reference of every ``ddiloco`` command, generated from its parsers.

    python -m compose.cli_reference            # print the reference
    python -m compose.cli_reference --write    # rewrite docs/cli.md
    python -m compose.cli_reference --check    # exit 1 if docs/cli.md is out of date

The parsers are the ones ``ddiloco`` builds itself (:func:`compose.cli.main`), whose
options come from the config dataclasses (:mod:`broker.cli_config`): nothing
is declared twice. The text depends on the code only: ``DDILOCO_*`` variables
set in the environment are ignored while the parsers are built (they would
change the defaults), and neither the terminal's width nor paths nor times
enter it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from broker.cli_config import ENV_PREFIX, leaves
from broker.redis.options import RedisOptions
from broker.zmq.options import ZmqOptions
from compose.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOC = Path("docs") / "cli.md"
REGENERATE = "python -m compose.cli_reference --write"

# The help that broker.cli_config.add_dataclass_args writes for a field:
# "<comment>; default <value> (env DDILOCO_<NAME>)", the comment and the
# default each optional.
_ENV = re.compile(r"^(?P<body>.*?) ?\(env (?P<env>\w+)\)$", re.S)
_DEFAULT = "default "


@dataclass(frozen=True)
class Row:
    option: str
    env: str
    default: str | None  # None: no default (the option is required or has none)
    help: str
    boolean: bool


@dataclass(frozen=True)
class Command:
    name: str  # "local", "throttle set"
    help: str
    rows: tuple[Row, ...]


def ddiloco_parser() -> argparse.ArgumentParser:
    """The ``ddiloco`` parser with every command's options, DDILOCO_* variables of
    this shell left out (their values would show as defaults)."""
    saved_env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for key in saved_env:
        del os.environ[key]
    try:
        return build_parser()
    finally:
        os.environ.update(saved_env)


def _row(action: argparse.Action) -> Row:
    text = (action.help or "").replace("%%", "%")
    boolean = action.nargs == "?" and action.const is True
    # A positional argument by its name, with its choices where it has them.
    option = ", ".join(action.option_strings) or action.dest.upper()
    if not action.option_strings and action.choices:
        text = "one of " + ", ".join(map(str, action.choices)) + (f": {text}" if text else "")
    m = _ENV.match(text)
    if m is None:  # not a config field (--log-level): argparse's own default
        shown = None
        if action.default is not None and action.default is not argparse.SUPPRESS:
            shown = str(action.default)
        return Row(option, "", shown, text, boolean)
    body: str = m["body"]
    default: str | None = None
    if body.startswith(_DEFAULT):
        body, default = "", body[len(_DEFAULT) :]
    elif "; " + _DEFAULT in body:
        body, _, default = body.rpartition("; " + _DEFAULT)
    return Row(option, m["env"], default, body.strip(), boolean)


def _rows(parser: argparse.ArgumentParser) -> tuple[Row, ...]:
    return tuple(
        _row(a)
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    )


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order ``ddiloco`` adds them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[Command]:
    """Every command that takes options, depth first; actions of one command
    that take the same options (``throttle set|show|clear``) are one entry."""
    out: list[Command] = []
    for name, text, sub in _subparsers(parser):
        nested = _subparsers(sub)
        if not nested:
            out.append(Command(prefix + name, text, _rows(sub)))
            continue
        children = commands(sub, prefix + name + " ")
        if len({c.rows for c in children}) == 1 and not _rows(sub):
            names = "|".join(c.name.rsplit(" ", 1)[1] for c in children)
            lines = [text + ":", ""]
            lines += [f"- `ddiloco {c.name}`: {c.help}" for c in children]
            out.append(Command(f"{prefix}{name} {names}", "\n".join(lines), children[0].rows))
        else:
            out += children
    return out


def _escape(text: str) -> str:
    """Markdown table cell text; code spans (between backticks) are left as written."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        part = parts[i].replace("\\", "\\\\")
        for ch in "|*<":
            part = part.replace(ch, "\\" + ch)
        parts[i] = part
    return "`".join(parts).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _table(rows: tuple[Row, ...]) -> list[str]:
    lines = ["| option | environment variable | default | help |", "|---|---|---|---|"]
    for r in rows:
        option = _code(r.option) + (" [true\\|false]" if r.boolean else "")
        env = _code(r.env) if r.env else "-"
        if r.default is None:
            default = "-"
        elif r.default == "":
            default = "(empty)"
        else:
            default = _code(r.default)
        lines.append(f"| {option} | {env} | {default} | {_escape(r.help) or '-'} |")
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The text of docs/cli.md."""
    parser = parser if parser is not None else ddiloco_parser()
    cmds = commands(parser)
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Generated from the code by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every `ddiloco` command and its options, as the command's parser has them: the",
        "options of a service are the fields of its config dataclass",
        "(`learner/config.py`, `syncer/config.py`, `compose/local.py`, the shared run",
        "settings in `broker/run/settings.py`), mapped to flags by `broker/cli_config.py`.",
        "`tests/test_docs.py` checks that this file is current.",
        "",
        "- Every option of a config field is also an environment variable, read when the",
        "  option is not given on the command line (the command line wins).",
        "- A boolean option given bare means true (`--warm-spares`); `--warm-spares false`",
        "  says false (also `0`, `no`, `off`; true: `1`, `yes`, `on`).",
        "- An option whose default is `none` takes `none` (or an empty value) for none.",
        "  A list option takes its values separated by commas (`--slowdown 1,1,1.5,2`).",
        "- A value that does not parse, or that the config refuses, stops the command at",
        "  start with a message naming the option.",
        "",
        "## Commands",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for c in cmds:
        summary = c.help.split("\n", 1)[0].rstrip(":")
        link = f"[{_code('ddiloco ' + c.name)}](#{_anchor(c.name)})"
        lines.append(f"| {link} | {_escape(summary)} |")
    top = _rows(parser)
    if top:
        lines += [
            "",
            "## Options before the command",
            "",
            "These come before the command's name (`ddiloco --log-level debug local`).",
            "",
            *_table(top),
        ]
    for c in cmds:
        lines += ["", f"## ddiloco {c.name}", "", c.help, "", *_table(c.rows)]
    lines += _url_options()
    return "\n".join(lines) + "\n"


def _url_options() -> list[str]:
    """The broker URL's options (``zmq://h:5555?ack_timeout_s=2``): the fields of
    each backend's options dataclass."""
    lines = [
        "",
        "## Broker URL options",
        "",
        "Options of the transport travel in the query of `--url`",
        "(`zmq://syncer:5555?ack_timeout_s=2`, `redis://redis:6379/0?claim_idle_s=10`); one",
        "URL serves learners and syncers, and each side reads the options it uses. A Redis",
        "URL's other query parameters go to redis-py.",
    ]
    for title, cls in (("ZeroMQ", ZmqOptions), ("Redis", RedisOptions)):
        lines += ["", f"### {title} (`{cls.__module__}.{cls.__name__}`)", ""]
        lines += ["| option | type | help |", "|---|---|---|"]
        for name, tp, text in leaves(cls):
            type_name = getattr(tp, "__name__", str(tp))
            lines.append(f"| {_code(name)} | {type_name} | {_escape(text) or '-'} |")
    return lines


def _anchor(name: str) -> str:
    """The anchor a Markdown renderer gives the heading ``ddiloco <name>``."""
    return re.sub(r"[^a-z0-9 _-]", "", f"ddiloco {name}".lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compose.cli_reference",
        description="Write or check docs/cli.md, the reference of the ddiloco commands.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite docs/cli.md")
    what.add_argument(
        "--check", action="store_true", help="exit 1 if docs/cli.md differs from the code's"
    )
    args = parser.parse_args(argv)
    text = render()
    path = ROOT / DOC
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {DOC.as_posix()}")
        return 0
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            return 0
        why = "does not exist" if current is None else "is out of date with the ddiloco options"
        print(f"{DOC.as_posix()} {why}; regenerate it with: {REGENERATE}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
