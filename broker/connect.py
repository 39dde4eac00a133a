"""Build a transport from a URL, so no service ever asks which backend it has.

    zmq://host:port[,host:port...][?option=value&...]
    redis://[user:password@]host:port/db[?option=value&...]    (also rediss://, unix://)

Backend options are the keyword options of the backend's classes (for
example ``ack_timeout_s`` and ``max_unacked`` for ZeroMQ, ``claim_idle_s`` and
``delta_stream_maxlen`` for Redis) and travel as query parameters. One URL
serves both sides of a run: an option that only one side has is ignored by
the other. Redis's own query parameters pass through to redis-py.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.exceptions
import zmq

from broker.errors import ConfigError, TransportError
from broker.identity.keys import Identity, RunKeys
from broker.transport import MAX_LEARNER_SLOTS, LearnerTransport, SyncerTransport

if TYPE_CHECKING:
    from broker.redis.shards import Fence, ShardLease

SCHEMES = ("zmq", "redis", "rediss", "unix")
_REDIS_PY_OPTIONS_WE_SET = ("socket_timeout", "socket_connect_timeout")
_T = TypeVar("_T")


@dataclass(frozen=True)
class BrokerUrl:
    backend: str  # "zmq" or "redis"
    endpoints: tuple[str, ...]  # zmq: tcp://host:port each; redis: the URL for redis-py
    options: dict[str, str]  # ours, still as text


def _backend_classes(backend: str) -> tuple[type, type]:
    if backend == "zmq":
        from broker.zmq.transport import ZmqLearnerTransport, ZmqSyncerTransport

        return ZmqLearnerTransport, ZmqSyncerTransport
    from broker.redis.learner import RedisLearnerTransport
    from broker.redis.syncer import RedisSyncerTransport

    return RedisLearnerTransport, RedisSyncerTransport


# Keyword options that are objects, given by the caller, never by a URL.
_CALLER_OPTIONS = (
    "keys", "identity", "role", "num_fragments", "roster_cap", "syncer_shards", "resolve_host",
    "fence",
)  # fmt: skip


def _keyword_options(cls: type) -> dict[str, Any]:
    """name -> type of a backend class's keyword-only constructor options that
    a URL may set."""
    hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {
        p.name: hints[p.name]
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _CALLER_OPTIONS
    }


def _options_of(backend: str) -> dict[str, Any]:
    learner, syncer = _backend_classes(backend)
    return _keyword_options(learner) | _keyword_options(syncer)


def _convert(name: str, text: str, tp: Any) -> Any:
    try:
        if tp is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)  # caught just below, as int("x") would be
            return text.lower() in ("1", "true", "yes")
        return tp(text)
    except ValueError:
        raise ConfigError(f"url option {name}={text!r}: expected {tp.__name__}") from None


def parse_url(url: str) -> BrokerUrl:
    """Split and check a broker URL; :class:`ConfigError` says what to change."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"url={url!r}: use zmq://HOST:PORT[,HOST:PORT], redis://HOST:PORT/DB, "
            "rediss://... or unix://..."
        )
    backend = "zmq" if parts.scheme == "zmq" else "redis"
    known = _options_of(backend)
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in known:
            _convert(key, value, known[key])  # fail at start, not at connect
            ours[key] = value
        elif backend == "zmq":
            raise ConfigError(f"url={url!r}: unknown option {key!r}; known: {sorted(known)}")
        elif key in _REDIS_PY_OPTIONS_WE_SET:
            # redis-py would let these override the backend's own timeouts, which
            # its blocking reads are sized against.
            raise ConfigError(f"url={url!r}: use socket_timeout_s instead of {key}")
        else:
            theirs.append((key, value))
    if backend == "redis":
        # Rebuilt from the text, not urlunsplit: that would turn unix:///path
        # into unix:/path, which redis-py refuses.
        base = url.split("#", 1)[0].split("?", 1)[0]
        redis_url = base + ("?" + urlencode(theirs) if theirs else "")
        return BrokerUrl(backend, (redis_url,), ours)
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ConfigError(f"url={url!r}: each zmq endpoint must be HOST:PORT (PORT < 65535)")
        endpoints.append(f"tcp://{host}:{port}")
    if parts.path not in ("", "/"):
        raise ConfigError(f"url={url!r}: a zmq url has no path")
    return BrokerUrl(backend, tuple(endpoints), ours)


def _shown(url: str) -> str:
    """The URL for an error message, its password (if any) left out."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"
    return parts._replace(netloc=netloc).geturl()


def _built(url: str, side: str, build: Callable[[], _T]) -> _T:
    """``build()``, with the transport library's errors (an address in use, a
    server that does not answer) turned into :class:`TransportError` here, at
    the seam, so that no caller ever handles a ZeroMQ or Redis exception."""
    try:
        return build()
    except (zmq.ZMQError, redis.exceptions.RedisError) as e:
        raise TransportError(f"{side} transport on {_shown(url)}: {e}") from e


def _options_for(cls: type, parsed: BrokerUrl) -> dict[str, Any]:
    accepted = _keyword_options(cls)
    return {k: _convert(k, v, accepted[k]) for k, v in parsed.options.items() if k in accepted}


def connect_learner(
    url: str,
    *,
    run_id: str,
    learner_id: str,
    incarnation: int,
    num_fragments: int,
    max_message_bytes: int | None = None,
    keys: RunKeys | None = None,
    identity: Identity | None = None,
    role: str = "learner",
    syncer_shards: int = 1,
) -> LearnerTransport:
    """``max_message_bytes``: the frame bound the plan needs (``plan.max_message_bytes``);
    a ``max_message_bytes`` in the URL wins. ``keys``: the run's keys as a
    learner (or ``role="reader"``) holds them, ``identity`` its own key pair
    (a new one when None); without keys the transport is in the clear
    (``--insecure``). ``syncer_shards``: the run's (ZeroMQ talks to each shard;
    over Redis the fragments' keys say where they go)."""
    parsed = parse_url(url)
    cls, _ = _backend_classes(parsed.backend)
    options = _options_for(cls, parsed) | {"keys": keys, "identity": identity, "role": role}
    if max_message_bytes is not None:
        options.setdefault("max_message_bytes", max_message_bytes)
    if parsed.backend == "zmq":
        options["syncer_shards"] = syncer_shards
    # ZeroMQ talks to every syncer endpoint; Redis to one server.
    where = list(parsed.endpoints) if parsed.backend == "zmq" else parsed.endpoints[0]
    transport: LearnerTransport = _built(
        url,
        "learner",
        lambda: cls(where, run_id, learner_id, incarnation, num_fragments, **options),
    )
    return transport


def connect_syncer(
    url: str,
    *,
    run_id: str,
    syncer_id: str,
    fragments: list[int],
    max_message_bytes: int | None = None,
    num_fragments: int | None = None,
    keys: RunKeys | None = None,
    roster_cap: int = MAX_LEARNER_SLOTS,
    shard: int = 0,
    syncer_shards: int = 1,
    fence: Fence | None = None,
) -> SyncerTransport:
    """``max_message_bytes`` as for :func:`connect_learner`; ``num_fragments``
    the run's (Redis: the keys a learner's ACL user may write name each);
    ``keys`` the run's keys as a syncer holds them; ``roster_cap`` the learner
    slots the syncer grants, at most (its roster cap). A ZeroMQ syncer binds
    its ``shard``'s endpoint of the URL (:func:`~broker.zmq.transport.shard_endpoint`)."""
    parsed = parse_url(url)
    _, cls = _backend_classes(parsed.backend)
    options = _options_for(cls, parsed) | {"keys": keys, "roster_cap": roster_cap}
    if max_message_bytes is not None:
        options.setdefault("max_message_bytes", max_message_bytes)
    if parsed.backend == "zmq":
        from broker.zmq.transport import shard_endpoint

        bind = shard_endpoint(parsed.endpoints, shard, syncer_shards)
        transport: SyncerTransport = _built(
            url, "syncer", lambda: cls(bind, run_id, fragments, **options)
        )
    else:
        if num_fragments is not None:
            options["num_fragments"] = num_fragments
        options["fence"] = fence
        transport = _built(
            url,
            "syncer",
            lambda: cls(parsed.endpoints[0], run_id, syncer_id, fragments, **options),
        )
    return transport


def lease_shard(
    url: str, *, run_id: str, syncer_shards: int, holder: str, ttl_s: float, keys: RunKeys | None
) -> ShardLease | None:
    """A syncer shard's lease, to take from Redis (:meth:`ShardLease.take`: a
    free index or a given one, waiting as a standby while it is held; its
    term fences the syncer's writes): see :mod:`broker.redis.shards`. None
    over ZeroMQ, which has no server to hold one: there the syncer takes the
    first shard whose checkpoint folder no live syncer holds."""
    parsed = parse_url(url)
    if parsed.backend == "zmq":
        return None
    from broker.redis.access import SYNCER_USER, lock_down_if_open
    from broker.redis.common import connect
    from broker.redis.shards import ShardLease

    timeout_s = float(parsed.options.get("socket_timeout_s", 5.0))
    user = None
    if keys is not None and keys.redis_password is not None:
        user = (SYNCER_USER, keys.redis_password)
        # A Redis that takes anyone gets the run's users first (as the transport
        # does): the lease is the syncer's first request.
        _built(url, "syncer", lambda: lock_down_if_open(parsed.endpoints[0], timeout_s, keys))
    client = _built(url, "syncer", lambda: connect(parsed.endpoints[0], timeout_s, keys, user))
    return ShardLease(client, run_id, syncer_shards, holder, ttl_s)
