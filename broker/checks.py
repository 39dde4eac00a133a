"""Small validators shared by the services' config dataclasses.

Each raises :class:`~broker.errors.ConfigError` (a ``ValueError``) with a
message that names the setting and says what to change, so a bad value fails
at start, not an hour into a run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from broker.errors import ConfigError

MAX_ID_LEN = 64
_ID_RE = re.compile(rf"^[A-Za-z0-9._:-]{{1,{MAX_ID_LEN}}}$")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_id(name: str, value: str) -> None:
    require(
        isinstance(value, str) and bool(_ID_RE.match(value)),
        f"{name}={value!r}: use 1-{MAX_ID_LEN} characters from A-Z a-z 0-9 . _ : -",
    )


def check_choice(name: str, value: str, choices: Collection[str]) -> None:
    require(value in choices, f"{name}={value!r}: choose one of {sorted(choices)}")


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: must be a number")
    # inf passes "> 0" but is no rate, period or timeout (and NaN compares false).
    require(math.isfinite(value), f"{name}={value!r}: must be a finite number")
    ok = value >= 0 if allow_zero else value > 0
    require(ok, f"{name}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def check_int(name: str, value: int, minimum: int = 1) -> None:
    require(
        type(value) is int and value >= minimum,
        f"{name}={value!r}: must be an integer >= {minimum}",
    )
