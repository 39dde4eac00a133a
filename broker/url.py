"""Broker URLs: which backend, where, and its typed options.

    zmq://host:port[,host:port...][?option=value&...]
    redis://[user:password@]host:port/db[?option=value&...]    (also rediss://, unix://)
    redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?option=value&...]
                                                  (also rediss+sentinel://: a Redis that fails over)

The options are the fields of the backend's options dataclass
(:class:`~broker.zmq.options.ZmqOptions`, :class:`~broker.redis.options.RedisOptions`;
listed in docs/cli.md) and travel as query parameters. One URL serves both
sides of a run: each side reads the options it uses. Redis's own query
parameters pass through to redis-py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit

from broker.errors import ConfigError
from broker.options import option_names, options_from_query
from broker.redis.options import REDIS_PY_TIMEOUTS, RedisOptions
from broker.redis.sentinel import SCHEMES as SENTINEL_SCHEMES
from broker.redis.sentinel import parse_sentinel_url
from broker.zmq.options import ZmqOptions

SCHEMES = ("zmq", "redis", "rediss", "unix", *SENTINEL_SCHEMES)


@dataclass(frozen=True)
class BrokerUrl:
    backend: str  # "zmq" or "redis"
    endpoints: tuple[str, ...]  # zmq: tcp://host:port each; redis: the URL for redis-py
    options: ZmqOptions | RedisOptions
    given: frozenset[str] = field(default=frozenset())  # the options the URL names


def parse_url(url: str) -> BrokerUrl:
    """Split and check a broker URL; :class:`ConfigError` says what to change."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"url={url!r}: use zmq://HOST:PORT[,HOST:PORT], redis://HOST:PORT/DB, "
            "rediss://..., unix://... or redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE"
        )
    backend = "zmq" if parts.scheme == "zmq" else "redis"
    cls: type[ZmqOptions] | type[RedisOptions] = ZmqOptions if backend == "zmq" else RedisOptions
    known = option_names(cls)
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in known:
            ours[key] = value
        elif backend == "zmq":
            raise ConfigError(f"url={url!r}: unknown option {key!r}; known: {sorted(known)}")
        elif key in REDIS_PY_TIMEOUTS:
            # redis-py would let these override the backend's own timeouts, which
            # its blocking reads are sized against.
            raise ConfigError(f"url={url!r}: use socket_timeout_s instead of {key}")
        else:
            theirs.append((key, value))
    sentinel = parts.scheme in SENTINEL_SCHEMES
    if sentinel and theirs:
        raise ConfigError(f"url={url!r}: unknown option(s) {[k for k, _ in theirs]} of a "
                          f"sentinel url; known: {sorted(known)}")  # fmt: skip
    given = frozenset(ours)
    if sentinel:
        # A write counts as done once a replica holds it: a failover loses none.
        ours.setdefault("wait_replicas", "1")
    try:
        options = options_from_query(cls, ours)
    except ConfigError as e:
        raise ConfigError(f"url={url!r}: {e}") from None
    if backend == "redis":
        # Rebuilt from the text, not urlunsplit: that would turn unix:///path
        # into unix:/path, which redis-py refuses.
        base = url.split("#", 1)[0].split("?", 1)[0]
        if sentinel:
            parse_sentinel_url(base)  # checked here, where a bad URL is said
        redis_url = base + ("?" + urlencode(theirs) if theirs else "")
        return BrokerUrl(backend, (redis_url,), options, given)
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ConfigError(f"url={url!r}: each zmq endpoint must be HOST:PORT (PORT < 65535)")
        endpoints.append(f"tcp://{host}:{port}")
    if parts.path not in ("", "/"):
        raise ConfigError(f"url={url!r}: a zmq url has no path")
    return BrokerUrl(backend, tuple(endpoints), options, given)


def shown(url: str) -> str:
    """The URL for an error message, its password (if any) left out."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"
    return parts._replace(netloc=netloc).geturl()
