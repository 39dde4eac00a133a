"""Redis ACL users of a run (docs/security.md): who may read and write which keys.

With the run's keys Redis runs with ``default`` off (see
:data:`DEFAULT_USER_RULES`) and these users::

    ddiloco-syncer          every key and command (password: ``redis.syncer``,
                            syncers only)
    ddiloco-join            XADD to a run's requests stream, nothing else
                            (password derived from ``join.secret``)
    ddiloco-sentinel        replication and what Sentinel does to a server
                            (password: ``redis.sentinel``; Redis servers and
                            Sentinels only, docs/transports.md)
    ddiloco:{run}:k:{key}   one per enrolled key, made by the admitting syncer:
                            reads the globals, the snapshot keys and its grant;
                            a learner also writes the delta streams, trimmed
                            counters and heartbeat of the learner ids bound to
                            its key, and reads their notices

``ddiloco keys`` writes the first four into ``redis.acl``, the file Redis
loads (``--aclfile``). A learner's password is derived from its own identity
(:class:`broker.identity.keys.Identity`), and its key is the password's SHA-256: the
digest Redis keeps (``#digest``) is all the syncer learns, so nobody but the
learner can authenticate as it. Commands are listed one by one: a member can
run only the scripts a syncer loaded (EVALSHA, never EVAL or SCRIPT LOAD), so
it cannot stall the server with a script of its own.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import redis

from broker.files import write_private
from broker.identity.keys import REDIS_ACL, REDIS_SENTINEL, RunKeys, read_secret_hex
from broker.redis.link import connect
from broker.redis.names import (
    changes_key,
    delta_stream_key,
    globals_stream_key,
    grant_key,
    heartbeat_key,
    model_key,
    notices_key,
    requests_key,
    trimmed_key,
    weightless_key,
)
from broker.redis.users import (
    JOIN_USER,
    SENTINEL_USER,
    SYNCER_USER,
    join_password,
    password_digest,
)

log = logging.getLogger(__name__)

# Commands of every member (redis-py's connection set-up, reads of the globals
# and snapshot keys, the read-only scripts) and, for learners, of its writes
# (the bounded XADD script and what it calls, its heartbeat).
_READER_COMMANDS = (
    "+ping", "+auth", "+hello", "+client|setname",
    "+get", "+mget", "+xread", "+evalsha_ro", "+xrange", "+xrevrange", "+hmget", "+lrange",
)  # fmt: skip
_LEARNER_COMMANDS = (
    "+evalsha", "+xadd", "+xlen", "+xtrim", "+xinfo|groups", "+xpending", "+incrby", "+set",
    "+wait",
)  # fmt: skip
# What the servers' own user may do: a replica's sync from the primary, and
# what Sentinel sends a server it monitors (the list Redis's Sentinel docs give).
SENTINEL_USER_RULES = (
    "resetchannels &__sentinel__:hello -@all +ping +auth +hello +info +role +multi +exec "
    "+publish +subscribe +slaveof +replicaof +config|rewrite +client|setname +client|kill "
    "+script|kill +psync +replconf +sync"
)

# The default user: off and without a password, so no connection is ever it,
# yet allowed every command. Redis 7.0 replays an append-only file's
# transactions (MULTI/EXEC, and every script's writes, which it logs as one)
# as the default user and drops those its rules deny (redis/redis#14541):
# with the default user denied everything, a restart lost every delta a
# learner's script added and every global a syncer published.
DEFAULT_USER_RULES = "off resetpass ~* &* +@all"


def acl_file(syncer_password: str, join_secret: bytes, sentinel_password: str | None) -> list[str]:
    """The lines of ``redis.acl``: the users Redis starts with (members are added
    by syncers); the servers' own user where ``sentinel_password`` is given."""
    join_rules = "resetchannels -@all +ping +auth +hello +xadd"
    servers = [f"user {SENTINEL_USER} on #{password_digest(sentinel_password)} "
               f"{SENTINEL_USER_RULES}"] if sentinel_password else []  # fmt: skip
    return [
        f"user default {DEFAULT_USER_RULES}",
        f"user {SYNCER_USER} on #{password_digest(syncer_password)} ~* &* +@all",
        f"user {JOIN_USER} on #{password_digest(join_password(join_secret))} "
        f"{join_rules} %W~{requests_key('*')}",
        *servers,
    ]


def write_acl_file(folder: str | Path) -> Path:
    """Write ``redis.acl`` from the folder's syncer password, join secret and
    servers' password (again, for a folder made by an earlier release: its
    default user's rules lost transactions at a Redis restart,
    :data:`DEFAULT_USER_RULES`; it gets a servers' password if it has none)."""
    out = Path(folder)
    keys = RunKeys.load(out, "syncer")
    assert keys.redis_password is not None, "a syncer's keys"
    lines = acl_file(keys.redis_password, keys.join_secret, sentinel_password(out))
    # Digests only, and read by the Redis server's own user: not 0600.
    write_private(out / REDIS_ACL, "".join(f"{line}\n" for line in lines), mode=0o644)
    return out / REDIS_ACL


def sentinel_password(folder: Path) -> str:
    """The servers' password (``redis.sentinel``), made first where the folder
    has none (one made by an earlier release)."""
    if not (folder / REDIS_SENTINEL).exists():
        write_private(folder / REDIS_SENTINEL, secrets.token_hex(32) + "\n")
    return read_secret_hex(folder, REDIS_SENTINEL)


def member_rules(
    run_id: str, key: str, role: str, learner_ids: set[str], num_fragments: int
) -> list[str]:
    """ACL SETUSER rules of the member ``key`` (its password's digest) in ``role``,
    holding ``learner_ids``: every key named, none by a pattern that another
    learner's keys could match."""
    rules = ["reset", "on", f"#{key}", "resetchannels", "-@all", *_READER_COMMANDS]
    rules += [f"%R~{globals_stream_key(run_id)}", f"%R~{grant_key(run_id, key)}"]
    rules += [f"%R~{model_key(run_id, p)}" for p in range(num_fragments)]
    rules += [f"%R~{weightless_key(run_id, p)}" for p in range(num_fragments)]
    rules += [f"%R~{changes_key(run_id, p)}" for p in range(num_fragments)]
    if role != "learner":
        return rules
    rules += _LEARNER_COMMANDS
    for learner in sorted(learner_ids):
        rules += [f"%R~{notices_key(run_id, learner)}", f"~{heartbeat_key(run_id, learner)}"]
        rules += [f"~{delta_stream_key(run_id, p, learner)}" for p in range(num_fragments)]
        rules += [f"~{trimmed_key(run_id, p, learner)}" for p in range(num_fragments)]
    return rules


def lock_down_if_open(url: str, socket_timeout_s: float, keys: RunKeys) -> bool:
    """If the server at ``url`` takes anyone (its default user on, without a
    password: a plain ``redis-server``), give it the run's users and turn the
    default user off; whether it did. A server started with ``--aclfile
    KEYS/redis.acl`` is never open, and keeps its users across restarts."""
    assert keys.redis_password is not None, "a syncer's keys"
    client = connect(url, socket_timeout_s, keys)  # rediss: checked against the run's CA
    try:
        client.ping()
        # A lone server: no replicas, no Sentinels, so not their user.
        lines = acl_file(keys.redis_password, keys.join_secret, None)
        users = [line.split()[1:] for line in lines]
        default = [u for u in users if u[0] == "default"]
        for name, *rules in [u for u in users if u[0] != "default"] + default:
            client.execute_command("ACL", "SETUSER", name, "reset", *rules)
    except redis.AuthenticationError:
        return False  # not open: it asks for a password
    except (redis.ResponseError, redis.ConnectionError) as e:
        # Not up (the syncer's own connection retries), or it refused a SETUSER.
        log.warning(
            "redis at %s: not checked whether it takes anyone, so not given the run's "
            "users (%s); a server started with --aclfile %s needs neither",
            url.split("@")[-1], e, keys.folder / "redis.acl",
        )  # fmt: skip
        return False
    finally:
        client.close()
    log.warning(
        "redis at %s took anyone: it has the run's users now, and its default user is "
        "off; start it with --aclfile %s to keep them across its restarts",
        url.split("@")[-1], keys.folder / "redis.acl",
    )  # fmt: skip
    return True
