"""Backend options: typed dataclasses read from a broker URL's query.

Each backend has one options dataclass (:class:`broker.zmq.options.ZmqOptions`,
:class:`broker.redis.options.RedisOptions`): every field is an option a URL may
set (``zmq://host:5555?ack_timeout_s=2``), with its one default and its help
in the comment beside it, and the dataclass checks its values once, when it is
made. One URL serves both sides of a run, so an options class holds the
options of both sides; each side reads those it uses.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from broker.errors import ConfigError

_T = TypeVar("_T")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _value(name: str, text: str, tp: Any) -> Any:
    if tp is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"url option {name}={text!r}: expected true or false")
        return text.lower() in _TRUE
    try:
        return tp(text)
    except ValueError:
        raise ConfigError(f"url option {name}={text!r}: expected {tp.__name__}") from None


def option_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def options_from_query(cls: type[_T], pairs: dict[str, str]) -> _T:
    """An options dataclass from ``name -> text`` pairs of a URL's query, each
    converted to its field's type; :class:`ConfigError` names a bad one."""
    hints = typing.get_type_hints(cls)
    values = {name: _value(name, text, hints[name]) for name, text in pairs.items()}
    return cls(**values)
