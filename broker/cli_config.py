"""Map config dataclasses onto command-line flags and environment variables.

Every field ``foo_bar`` becomes ``--foo-bar`` with the environment variable
``DDILOCO_FOO_BAR`` as its default (that is how docker compose configures the
services). A field whose type is itself a dataclass (the shared
:class:`~broker.run.settings.RunSettings`, the workload, the model) is flattened
into its parent, its flags prefixed with the field's ``flag_prefix`` metadata
(``--model-d-model``), so a setting has the same flag in every command that
has it. Values are validated by the dataclasses themselves, so a bad flag
fails at start with the dataclass's message. :func:`dataclass_to_args` turns
a config back into flags, which is how ``ddiloco local`` starts its services.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, TypeVar, Union

from broker.errors import ConfigError
from broker.wire.codecs import Codec, CodecError

T = TypeVar("T")
ENV_PREFIX = "DDILOCO_"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_codec(text: str) -> Codec:
    try:
        return Codec.parse(text)
    except CodecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _converter(tp: Any) -> tuple[Any, bool]:
    """(function turning one string into a value, whether it is a comma list)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        # Optional: the words "none" and "" mean None (only here).
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        conv, is_list = _converter(inner[0])
        if is_list:
            return conv, is_list  # the list parser below handles "none"
        return (lambda s: None if s.lower() in ("", "none") else conv(s)), is_list
    if origin is tuple:
        conv, _ = _converter(typing.get_args(tp)[0])
        return conv, True
    if tp is bool:
        return _parse_bool, False
    if tp is Codec:
        return _parse_codec, False
    return tp, False


def _is_group(tp: Any) -> bool:
    """A nested config dataclass to flatten (a codec is a dataclass too, but one value)."""
    return dataclasses.is_dataclass(tp) and tp is not Codec and not isinstance(tp, Codec)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


_FIELD_COMMENT = re.compile(r"^\s+(\w+):[^#]*=[^#]*#\s*(.+)$")


def _field_comments(cls: type) -> dict[str, str]:
    """The comment after each field of a dataclass: its one description, reused as help."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m[1]: m[2] for line in source.splitlines() if (m := _FIELD_COMMENT.match(line))}


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(flattened name, type, help) of every non-group field, depth first."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_group(tp):
            yield from leaves(tp, prefix + f.metadata.get("flag_prefix", ""))
        else:
            default = f.default_factory() if callable(f.default_factory) else f.default
            shown = "" if default is dataclasses.MISSING else f"default {flag_text(default)}"
            yield prefix + f.name, tp, "; ".join(x for x in (comments.get(f.name), shown) if x)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add a flag for every (flattened) field of ``cls``; ``ValueError`` for a
    ``DDILOCO_*`` variable that does not parse."""
    seen: set[str] = set()
    for name, tp, description in leaves(cls):
        if name in seen:
            raise ConfigError(f"{cls.__name__}: two settings flatten to --{name}")
        seen.add(name)
        conv, is_list = _converter(tp)
        optional = _is_optional(tp)
        env = ENV_PREFIX + name.upper()

        def parse(
            text: str, conv: Any = conv, is_list: bool = is_list, optional: bool = optional
        ) -> Any:
            if is_list:
                if optional and text.lower() in ("", "none"):
                    return None
                return tuple(conv(part) for part in text.split(",") if part)
            return conv(text)

        parse.__name__ = getattr(conv, "__name__", "value")  # argparse names it in errors
        default: Any = argparse.SUPPRESS
        if env in os.environ:
            try:
                default = parse(os.environ[env])
            except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                raise ConfigError(f"{env}={os.environ[env]!r}: {e}") from None
        # A bare boolean flag (--no-progress) means true; --flag false says it outright.
        flag_value = {"nargs": "?", "const": True} if tp is bool else {}
        parser.add_argument(
            _flag(name),
            dest=name,
            type=parse,
            default=default,
            help=f"{description} (env {env})".strip().replace("%", "%%"),
            **flag_value,  # type: ignore[arg-type]
        )


def dataclass_from_args(
    cls: type[T], ns: argparse.Namespace | dict[str, Any], prefix: str = ""
) -> T:
    """Build ``cls`` from parsed flags; fields without a flag keep their defaults."""
    values = vars(ns) if isinstance(ns, argparse.Namespace) else ns
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        if _is_group(tp):
            kwargs[f.name] = dataclass_from_args(
                tp,
                values,
                prefix + f.metadata.get("flag_prefix", ""),
            )
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def flag_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(flag_text(v) for v in value)
    return str(value)


def dataclass_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flattened name -> value of every field of a config (the inverse of the above)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_group(value):
            out |= dataclass_values(value, prefix + f.metadata.get("flag_prefix", ""))
        else:
            out[prefix + f.name] = value
    return out


def dataclass_to_args(obj: Any) -> list[str]:
    """Flags that make :func:`dataclass_from_args` rebuild ``obj`` exactly."""
    args: list[str] = []
    for name, value in dataclass_values(obj).items():
        args += [_flag(name), flag_text(value)]
    return args
