"""Build a transport from a URL (:mod:`broker.url`), so no service ever asks
which backend it has."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import redis.exceptions
import zmq

from broker.errors import ConfigError, TransportError
from broker.identity.keys import Identity, RunKeys
from broker.redis.access import lock_down_if_open
from broker.redis.learner import RedisLearnerTransport
from broker.redis.link import connect
from broker.redis.options import RedisOptions
from broker.redis.shards import Fence, ShardLease
from broker.redis.syncer import RedisSyncerTransport
from broker.redis.users import SYNCER_USER
from broker.transport import MAX_LEARNER_SLOTS, LearnerTransport, SyncerTransport
from broker.url import BrokerUrl, parse_url, shown
from broker.zmq.addressing import shard_endpoint
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.options import ZmqOptions
from broker.zmq.syncer import ZmqSyncerTransport

_T = TypeVar("_T")


def _built(url: str, side: str, build: Callable[[], _T]) -> _T:
    """``build()``, with the transport library's errors (an address in use, a
    server that does not answer) turned into :class:`TransportError` here, at
    the seam, so that no caller ever handles a ZeroMQ or Redis exception."""
    try:
        return build()
    except (zmq.ZMQError, redis.exceptions.RedisError) as e:
        raise TransportError(f"{side} transport on {shown(url)}: {e}") from e


def _options(parsed: BrokerUrl, max_message_bytes: int | None) -> ZmqOptions | RedisOptions:
    """The URL's options, with the plan's frame bound where the URL sets none."""
    if max_message_bytes is None or "max_message_bytes" in parsed.given:
        return parsed.options
    return replace(parsed.options, max_message_bytes=max_message_bytes)


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
    options = _options(parsed, max_message_bytes)
    transport: LearnerTransport
    if isinstance(options, ZmqOptions):  # ZeroMQ talks to every syncer endpoint
        endpoints = list(parsed.endpoints)
        transport = _built(
            url,
            "learner",
            lambda: ZmqLearnerTransport(
                endpoints,
                run_id,
                learner_id,
                incarnation,
                num_fragments,
                options=options,
                keys=keys,
                identity=identity,
                role=role,
                syncer_shards=syncer_shards,
            ),  # fmt: skip
        )
    else:
        transport = _built(
            url,
            "learner",
            lambda: RedisLearnerTransport(
                parsed.endpoints[0],
                run_id,
                learner_id,
                incarnation,
                num_fragments,
                options=options,
                keys=keys,
                identity=identity,
                role=role,
            ),  # fmt: skip
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
    term: int = 0,
    identity_hold_s: float,
) -> SyncerTransport:
    """``max_message_bytes`` as for :func:`connect_learner`; ``num_fragments``
    the run's (Redis: the keys a learner's ACL user may write name each);
    ``keys`` the run's keys as a syncer holds them; ``roster_cap`` the learner
    slots the syncer grants, at most (its roster cap). A ZeroMQ syncer binds
    its ``shard``'s endpoint of the URL (:func:`~broker.zmq.addressing.shard_endpoint`).
    ``identity_hold_s``: how long a learner id stays bound to its key once the
    key is silent (the run's :attr:`~broker.run.settings.RunSettings.gone_after_s`).
    ``fence`` (Redis) or ``term`` (ZeroMQ, where it goes on every ack): the
    shard's lease, from :func:`lease_shard`."""
    parsed = parse_url(url)
    options = _options(parsed, max_message_bytes)
    transport: SyncerTransport
    if isinstance(options, ZmqOptions):
        bind = shard_endpoint(parsed.endpoints, shard, syncer_shards)
        transport = _built(
            url,
            "syncer",
            lambda: ZmqSyncerTransport(
                bind,
                run_id,
                fragments,
                options=options,
                identity_hold_s=identity_hold_s,
                keys=keys,
                roster_cap=roster_cap,
                term=term,
            ),  # fmt: skip
        )
    else:
        transport = _built(
            url,
            "syncer",
            lambda: RedisSyncerTransport(
                parsed.endpoints[0],
                run_id,
                syncer_id,
                fragments,
                options=options,
                identity_hold_s=identity_hold_s,
                num_fragments=num_fragments,
                keys=keys,
                roster_cap=roster_cap,
                fence=fence,
            ),  # fmt: skip
        )
    return transport


def lease_shard(
    url: str,
    *,
    lease_store: str = "",
    run_id: str,
    syncer_shards: int,
    holder: str,
    ttl_s: float,
    keys: RunKeys | None,
) -> ShardLease | None:
    """A syncer shard's lease, to take from Redis (:meth:`ShardLease.take`: a
    free index or a given one, waiting as a standby while it is held; its
    term fences the syncer's writes): see :mod:`broker.redis.shards`. A
    Redis run's own Redis holds it; a ZeroMQ run's, the Redis of
    ``lease_store``. None for a ZeroMQ run without one: there the syncer takes
    the first shard whose checkpoint folder no live syncer holds."""
    run_is_redis = isinstance(parse_url(url).options, RedisOptions)
    if lease_store and run_is_redis:
        raise ConfigError(
            "lease_store is for ZeroMQ runs: a Redis run's syncers lease their shards "
            "from the run's Redis"
        )
    if not lease_store and not run_is_redis:
        return None
    url = lease_store or url
    parsed = parse_url(url)
    if not isinstance(parsed.options, RedisOptions):
        raise ConfigError(f"lease_store={shown(url)}: give a redis:// or rediss:// URL")
    timeout_s = parsed.options.socket_timeout_s
    user = None
    if keys is not None and keys.redis_password is not None:
        user = (SYNCER_USER, keys.redis_password)
        # A Redis that takes anyone gets the run's users first (as the transport
        # does): the lease is the syncer's first request.
        _built(url, "syncer", lambda: lock_down_if_open(parsed.endpoints[0], timeout_s, keys))
    client = _built(url, "syncer", lambda: connect(parsed.endpoints[0], timeout_s, keys, user))
    return ShardLease(client, run_id, syncer_shards, holder, ttl_s)
