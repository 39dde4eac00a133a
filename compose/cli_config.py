"""Map a service's config dataclass onto command-line flags and environment variables.

Every field ``foo_bar`` becomes ``--foo-bar`` with the environment variable
``DDILOCO_FOO_BAR`` as its default (that is how docker compose configures the
services); fields of the nested model config become ``--model-...``. Values are
validated by the dataclass itself, so a bad flag fails at start with the
dataclass's message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar, Union

from learner.model import ModelConfig

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


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
    return tp, False


def _flag(prefix: str, name: str) -> str:
    return "--" + (prefix + name).replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp is ModelConfig:
            add_dataclass_args(parser, ModelConfig, prefix="model_")
            continue
        conv, is_list = _converter(tp)
        optional = typing.get_origin(tp) in (Union, types.UnionType)
        env = "DDILOCO_" + (prefix + f.name).upper()

        def parse(
            text: str, conv: Any = conv, is_list: bool = is_list, optional: bool = optional
        ) -> Any:
            if is_list:
                if optional and text.lower() in ("", "none"):
                    return None
                return tuple(conv(part) for part in text.split(",") if part)
            return conv(text)

        parse.__name__ = getattr(conv, "__name__", "value")  # argparse names it in errors
        default: Any = dataclasses.MISSING
        if env in os.environ:
            try:
                default = parse(os.environ[env])
            except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{env}={os.environ[env]!r}: {e}") from None
        parser.add_argument(
            _flag(prefix, f.name),
            dest=prefix + f.name,
            type=parse,
            default=default if default is not dataclasses.MISSING else argparse.SUPPRESS,
            help=f"(env {env})",
        )


def dataclass_from_args(cls: type[T], ns: argparse.Namespace) -> T:
    values = vars(ns)
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if hints[f.name] is ModelConfig:
            model_kwargs = {
                m.name: values[f"model_{m.name}"]
                for m in dataclasses.fields(ModelConfig)
                if f"model_{m.name}" in values
            }
            kwargs[f.name] = ModelConfig(**model_kwargs)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
