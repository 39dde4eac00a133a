"""Redis that fails over: a primary, its replica and three Sentinels
(docs/transports.md, "Redis that fails over").

    redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB][?option=value&...]
    rediss+sentinel://...      TLS to the Sentinels and to the servers

A client asks the Sentinels which server is SERVICE's primary, and asks again
whenever its connection breaks or the server it reached answers as a replica
(redis-py's Sentinel client). With the run's keys, Sentinels answer only a
user: every member asks as ``ddiloco-join`` (all hold the join secret), which
may ask where the primary is and nothing else (:func:`sentinel_conf`); the
servers and Sentinels among themselves are ``ddiloco-sentinel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from broker.errors import ConfigError
from broker.identity.keys import REDIS_SENTINEL, RunKeys, read_secret_hex
from broker.identity.tls import REDIS_CERT, REDIS_KEY, TLS_CA
from broker.redis.users import JOIN_USER, SENTINEL_USER, join_password, password_digest

SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_CONF = "sentinel.conf"
DEFAULT_SERVICE = "ddiloco"
DEFAULT_SENTINEL_PORT = 26379
# Sentinels that must agree the primary is down before one fails it over (of 3).
QUORUM = 2
# How long the primary may not answer before a Sentinel counts it down: a
# failover takes about this plus one second.
DOWN_AFTER_MS = 2000
# A failover that did not end within this is tried again (by another Sentinel
# after twice this): also one that found no replica fit to promote, since a
# Sentinel asks replicas for their state only every 10 s (6 s later, not 10).
FAILOVER_TIMEOUT_MS = 3_000
# What members may ask a Sentinel: where the primary and the others are. Not
# SENTINEL SET, FAILOVER, RESET, REMOVE or MONITOR, which would let any member
# move the run's data where it likes.
_ASKING_RULES = (
    "-@all +ping +auth +hello +client|setname +sentinel|masters +sentinel|master "
    "+sentinel|get-master-addr-by-name +sentinel|sentinels +sentinel|replicas"
)


@dataclass(frozen=True)
class SentinelAddress:
    """Where a run's Redis is, by way of its Sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    tls: bool
    username: str | None = None  # of the servers (the URL's user), not of the Sentinels
    password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The Sentinels, service and database of a ``redis+sentinel://`` URL
    (options already taken off: :func:`broker.url.parse_url`)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"url={url!r}: not a redis+sentinel:// or rediss+sentinel:// url")
    if parts.query:
        raise ConfigError(f"url={url!r}: a sentinel url passes nothing through to redis-py")
    netloc = parts.netloc.rpartition("@")[2]
    sentinels = []
    for hostport in netloc.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"url={url!r}: each sentinel must be HOST:PORT")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigError(f"url={url!r}: name the service and, if not 0, the db: /SERVICE[/DB]")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return SentinelAddress(
        tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0,
        parts.scheme == "rediss+sentinel", user, password,
    )  # fmt: skip


def connect_sentinel(
    address: SentinelAddress,
    socket_timeout_s: float,
    keys: RunKeys | None,
    user: tuple[str, str] | None,
    **connection: Any,
) -> redis.Redis:
    """A client of the service's primary, found by way of the Sentinels (asked
    as ``ddiloco-join`` with the run's keys), as ``user`` when given."""
    tls: dict[str, Any] = {}
    if address.tls:
        tls = {"ssl": True, "ssl_cert_reqs": "required"}
        if keys is not None:
            tls |= {"ssl_ca_certs": str(keys.tls_ca()), "ssl_check_hostname": True}
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
    }
    asking: dict[str, Any] = {**timeouts, **tls}
    if keys is not None:
        asking |= {"username": JOIN_USER, "password": join_password(keys.join_secret)}
    if user is None and address.username is not None:
        user = (address.username, address.password or "")
    if user is not None:
        connection |= {"username": user[0], "password": user[1]}
    elif address.password is not None:
        connection["password"] = address.password
    sentinel = Sentinel(list(address.sentinels), sentinel_kwargs=asking)
    return sentinel.master_for(
        address.service, db=address.db, decode_responses=False, **timeouts, **tls, **connection
    )


def sentinel_conf(
    keys_folder: str | Path,
    primary: tuple[str, int],
    port: int = DEFAULT_SENTINEL_PORT,
    files: str | Path | None = None,
    service: str = DEFAULT_SERVICE,
) -> str:
    """A Sentinel's configuration for a run whose primary starts at ``primary``
    (``redis-server sentinel.conf --sentinel``): TLS on ``port`` with the
    run's certificate (read from ``files``, the key folder where None), the
    servers' user to reach the servers and the other Sentinels, the default
    user off, and ``ddiloco-join`` allowed to ask where the primary is.
    Holds the servers' password: keep it 0600."""
    folder = Path(keys_folder)
    where = Path(files) if files is not None else folder
    servers_password = read_secret_hex(folder, REDIS_SENTINEL)
    join = password_digest(join_password(RunKeys.load(folder, "learner").join_secret))
    lines = [
        "port 0",
        f"tls-port {port}",
        f"tls-cert-file {where / REDIS_CERT}",
        f"tls-key-file {where / REDIS_KEY}",
        f"tls-ca-cert-file {where / TLS_CA}",
        "tls-auth-clients no",  # clients prove who they are by their user
        "tls-replication yes",  # and the servers and Sentinels are reached over TLS
        # Servers known by the names their certificates hold, not by addresses.
        "sentinel resolve-hostnames yes",
        "sentinel announce-hostnames yes",
        f"sentinel monitor {service} {primary[0]} {primary[1]} {QUORUM}",
        f"sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {service} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {service} 1",
        f"sentinel auth-user {service} {SENTINEL_USER}",
        f"sentinel auth-pass {service} {servers_password}",
        f"sentinel sentinel-user {SENTINEL_USER}",
        f"sentinel sentinel-pass {servers_password}",
        "user default off resetpass -@all",
        f"user {SENTINEL_USER} on #{password_digest(servers_password)} +@all",
        f"user {JOIN_USER} on #{join} {_ASKING_RULES}",
    ]
    return "".join(f"{line}\n" for line in lines)
