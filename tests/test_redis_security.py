"""Redis with the run's keys: TLS with the run's own CA (``rediss://``), ACL users
per role and per learner, enrollment, revocation and the bounded request
stream, against a real Redis 7 server (these tests fail, never skip, without
one). Each attack is written as what an outsider, a holder of the join secret,
or an enrolled learner tries, and what Redis answers."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509

from broker.identity.keys import Identity, RunKeys, revoke
from broker.identity.tls import (
    DEFAULT_REDIS_HOSTS,
    REDIS_CERT,
    REDIS_KEY,
    TLS_CA,
    issue_redis_cert,
    redis_cert_hosts,
)
from broker.redis.access import lock_down_if_open
from broker.redis.frames import check_entry
from broker.redis.learner import RedisLearnerTransport
from broker.redis.names import (
    delta_stream_key,
    globals_stream_key,
    grant_key,
    heartbeat_key,
    model_key,
    notices_key,
    requests_key,
    roster_key,
)
from broker.redis.server import RedisServer
from broker.redis.syncer import RedisSyncerTransport
from broker.redis.users import (
    JOIN_USER,
    join_password,
    member_password,
    member_user,
    password_digest,
)
from broker.run.key_folder import make_keys
from broker.transport import TransportError, TransportStats
from broker.wire.messages import Delta, Heartbeat, decode
from tests.servers import take_globals, wait_until
from tests.test_redis_transport import RUN, make_delta, make_global

pytestmark = pytest.mark.integration


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def tls_server(tmp_path: Path, keys_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", keys=keys_dir, tls=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.integration
def test_an_open_tls_redis_is_locked_down_over_the_runs_ca(
    tls_server: RedisServer, keys_dir: Path
) -> None:
    """A TLS Redis that takes anyone (its default user on, no password) gets the
    run's users and its default user off: the check dials it trusting the
    run's CA, as every other connection of the run does."""
    admin = tls_server.client()
    admin.execute_command("ACL", "SETUSER", "default", "on", "nopass", "~*", "&*", "+@all")
    assert redis.Redis.from_url(tls_server.url, ssl_ca_certs=str(keys_dir / TLS_CA)).ping()
    assert lock_down_if_open(tls_server.url, 5.0, RunKeys.load(keys_dir, "syncer"))
    anyone = redis.Redis.from_url(tls_server.url, ssl_ca_certs=str(keys_dir / TLS_CA))
    with pytest.raises(redis.AuthenticationError):
        anyone.ping()
    assert not lock_down_if_open(tls_server.url, 5.0, RunKeys.load(keys_dir, "syncer"))
    admin.close()


def served_serial(server: RedisServer, keys_dir: Path) -> int:
    """The serial number of the certificate the server shows a new connection."""
    context = ssl.create_default_context(cafile=str(keys_dir / TLS_CA))
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def reload_tls(server: RedisServer, keys_dir: Path) -> None:
    """What the operator does after `ddiloco keys rotate-tls`: Redis reads the
    certificate and key files again (new connections get them)."""
    admin = server.client(socket_timeout=5)
    admin.execute_command(
        "CONFIG", "SET", "tls-cert-file", str(keys_dir / REDIS_CERT),
        "tls-key-file", str(keys_dir / REDIS_KEY),
    )  # fmt: skip
    admin.close()


def exchange(
    syncer: RedisSyncerTransport, learners: list[RedisLearnerTransport], deltas: list[Delta]
) -> list[Delta]:
    """Send ``deltas`` (each by the learner it names) with the syncer running, as
    it does in a run: it admits the learners before their writes are taken.
    Returns the deltas the syncer received (and acked) meanwhile."""
    by_id = {t.learner_id: t for t in learners}
    for d in deltas:
        by_id[d.learner_id].send_delta(d)
    got: list[Delta] = []

    def delivered() -> bool:
        for t in learners:
            t.poll(0.01)
        items = syncer.receive(0.05)
        syncer.ack(items)
        got.extend(i.message for i in items if isinstance(i.message, Delta))
        return len(got) >= len(deltas)

    wait_until(delivered, 20, interval_s=0, what=f"{len(deltas)} deltas")
    return got


@pytest.mark.timeout(60)
def test_deltas_and_signed_globals_over_tls_with_the_runs_ca(
    tls_server: RedisServer, keys_dir: Path
) -> None:
    url = tls_server.url
    assert url.startswith("rediss://")
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=15.0
    )
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
    )
    try:
        assert [d.seq for d in exchange(syncer, [learner], [make_delta("learner-0", 1, 0)])] == [1]
        syncer.publish(make_global(0, 1))
        got = wait_until(lambda: take_globals(learner, 0.1), 10, what="the global over TLS")
        assert [(g.version, bool(g.signature)) for g in got] == [(1, True)]
    finally:
        learner.close()
        syncer.close()


@pytest.mark.timeout(60)
def test_a_redis_restart_keeps_every_delta_and_global_it_acknowledged(
    tls_server: RedisServer, keys_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis as compose and the docs start it (the run's redis.acl, TLS, AOF
    with appendfsync always), SIGKILLed and restarted: the learner's deltas (a
    script's XADD) and the syncer's globals (a transaction) are all still
    there. Redis 7.0 replays both as the default user and drops what that user
    may not run: with the default user denied everything, both were gone."""
    url = tls_server.url
    syncer_keys = RunKeys.load(keys_dir, "syncer")
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0], keys=syncer_keys, identity_hold_s=15.0)
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
    )
    deltas = [make_delta("learner-0", seq, 0) for seq in range(1, 4)]
    try:
        exchange(syncer, [learner], deltas[:1])  # admitted
        for d in deltas[1:]:
            learner.send_delta(d)
        assert learner.flush(10)  # acknowledged: in Redis's file
        syncer.publish(make_global(0, 1))
        syncer.receive(0.05)
    finally:
        learner.close()
        syncer.close()
    tls_server.kill()
    tls_server.start()
    log = (tls_server.workdir / "redis.log").read_text()
    assert "NOPERM" not in log
    admin = tls_server.client()
    # The syncer took the first in and acked it (then trimmed it): the others wait.
    entries = admin.xrange(delta_stream_key(RUN, 0, "learner-0"))
    unread = [check_entry(fields, 2**20, TransportStats()) for _, fields in entries]
    assert unread == deltas[1:]
    assert decode(admin.get(model_key(RUN, 0))).version == 1
    assert len(admin.xrange(globals_stream_key(RUN))) == 1
    admin.close()
    # A Redis still holding the users of an earlier release's redis.acl: said at start.
    tls_server.client().execute_command("ACL", "SETUSER", "default", "resetchannels", "-@all")
    with caplog.at_level(logging.ERROR, logger="broker.redis.syncer"):
        RedisSyncerTransport(
            url, RUN, "syncer-0", [0], keys=syncer_keys, identity_hold_s=15.0
        ).close()
    assert any("ddiloco keys acl" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_server_of_another_ca_or_the_clear_is_refused(
    tls_server: RedisServer, keys_dir: Path, tmp_path: Path
) -> None:
    # A learner of another run (another CA) dialling this server: the server's
    # certificate is not one its CA signed, so nothing is read or written.
    other = RunKeys.load(make_keys(tmp_path / "other"), "learner")
    learner = RedisLearnerTransport(tls_server.url, RUN, "learner-0", 1, 1, keys=other)
    try:
        with pytest.raises(TransportError, match="snapshot"):
            learner.snapshot([0], timeout_s=1.0)
    finally:
        learner.close()
    # A client in the clear gets no answer from the TLS port.
    plain = redis.Redis(port=tls_server.port, socket_timeout=1, socket_connect_timeout=1)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    # A certificate for a host the client did not dial is refused too.
    hosts = redis_cert_hosts(keys_dir)
    assert set(hosts) == set(DEFAULT_REDIS_HOSTS)
    issue_redis_cert(keys_dir, ("elsewhere.example",))
    reload_tls(tls_server, keys_dir)
    with pytest.raises(redis.ConnectionError):
        tls_server.client(socket_timeout=2).ping()


@pytest.mark.timeout(60)
def test_the_servers_certificate_rotates_while_a_learner_runs(
    tls_server: RedisServer, keys_dir: Path
) -> None:
    url = tls_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=15.0
    )
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
    )
    try:
        exchange(syncer, [learner], [make_delta("learner-0", 1, 0)])
        before = served_serial(tls_server, keys_dir)
        # `ddiloco keys rotate-tls`, then Redis told to read the files again.
        issue_redis_cert(keys_dir)
        reload_tls(tls_server, keys_dir)
        after = served_serial(tls_server, keys_dir)
        assert after != before
        # The open connections go on; a new learner connects with the new certificate.
        newcomer = RedisLearnerTransport(
            url, RUN, "learner-1", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
        )
        try:
            late = [make_delta("learner-0", 2, 0), make_delta("learner-1", 1, 0)]
            got = exchange(syncer, [learner, newcomer], late)
            assert {(d.learner_id, d.seq) for d in got} == {("learner-0", 2), ("learner-1", 1)}
        finally:
            newcomer.close()
    finally:
        learner.close()
        syncer.close()


# -- ACL users: who may read and write what ----------------------------------------
@pytest.fixture
def acl_server(tmp_path: Path, keys_dir: Path) -> Iterator[RedisServer]:
    """A Redis started with the run's users (``--aclfile keys/redis.acl``)."""
    server = RedisServer(tmp_path / "redis", keys=keys_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def as_member(server: RedisServer, identity: Identity) -> redis.Redis:
    """A raw client logged in as the member ``identity`` is (what a learner
    holding its own key file could do with redis-cli)."""
    password = member_password(identity.secret)
    return redis.Redis(
        port=server.port, username=member_user(RUN, password_digest(password)),
        password=password, socket_timeout=5,
    )  # fmt: skip


def refused(action: Callable[[], object]) -> str:
    """The class of the error ``action`` fails with ("" if it succeeds)."""
    try:
        action()
    except redis.RedisError as e:
        return type(e).__name__
    return ""


@pytest.mark.timeout(60)
def test_an_outsider_gets_nothing_and_a_join_holder_may_only_ask(
    acl_server: RedisServer, keys_dir: Path
) -> None:
    """Attacks of the issue: reading the weights (GET), writing deltas, globals,
    the roster or a lease, with no credentials or with the join secret only."""
    outsider = redis.Redis(port=acl_server.port, socket_timeout=5)
    for action in (
        lambda: outsider.get(model_key(RUN, 0)),
        lambda: outsider.xadd(delta_stream_key(RUN, 0, "learner-0"), {"m": b"x"}),
        lambda: outsider.xadd(requests_key(RUN), {"m": b"x"}),
        lambda: outsider.hset(roster_key(RUN), "squatter", "0" * 64),
    ):
        assert refused(action) == "AuthenticationError"
    keys = RunKeys.load(keys_dir, "learner")
    joiner = redis.Redis(
        port=acl_server.port, username=JOIN_USER, password=join_password(keys.join_secret)
    )
    assert refused(lambda: joiner.xadd(requests_key(RUN), {"m": b"x"})) == ""
    for action in (
        lambda: joiner.get(model_key(RUN, 0)),
        lambda: joiner.xrange(requests_key(RUN)),  # others' enrollments
        lambda: joiner.xadd(delta_stream_key(RUN, 0, "learner-0"), {"m": b"x"}),
        lambda: joiner.xadd(globals_stream_key(RUN), {"m": b"x"}),
        lambda: joiner.hset(roster_key(RUN), "squatter", "0" * 64),
        lambda: joiner.eval("return 1", 0),
    ):
        assert refused(action) == "NoPermissionError"


@pytest.mark.timeout(60)
def test_an_enrolled_learner_writes_only_its_own_keys(
    acl_server: RedisServer, keys_dir: Path
) -> None:
    url = acl_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=15.0
    )
    ids = {name: Identity.new() for name in ("learner-0", "learner-1")}
    learners = [
        RedisLearnerTransport(
            url, RUN, name, 1, 1, keys=RunKeys.load(keys_dir, "learner"), identity=identity
        )  # fmt: skip
        for name, identity in ids.items()
    ]
    try:
        exchange(syncer, learners, [make_delta(t.learner_id, 1, 0) for t in learners])
        one = as_member(acl_server, ids["learner-1"])
        # Its own stream and heartbeat: yes.
        assert refused(lambda: one.xadd(delta_stream_key(RUN, 0, "learner-1"), {"m": b"x"})) == ""
        assert refused(lambda: one.get(model_key(RUN, 0))) == ""
        # Anything of another learner's, the syncers', or the run's: no.
        for action in (
            lambda: one.xadd(delta_stream_key(RUN, 0, "learner-0"), {"m": b"x"}),
            lambda: one.set(heartbeat_key(RUN, "learner-0"), b"x"),
            lambda: one.xadd(notices_key(RUN, "learner-1"), {"m": b"forged refusal"}),
            lambda: one.xread({notices_key(RUN, "learner-0"): "0"}),
            lambda: one.set(model_key(RUN, 0), b"x"),
            lambda: one.xadd(globals_stream_key(RUN), {"m": b"x"}),
            lambda: one.hset(roster_key(RUN), "learner-9", "0" * 64),
            lambda: one.set(grant_key(RUN, "0" * 64), b"1 0"),
            lambda: one.eval("while true do end", 0),  # a script that would stall Redis
            lambda: one.script_load("return 1"),
            lambda: one.acl_setuser("me", enabled=True),
            lambda: one.config_set("appendonly", "no"),
            lambda: one.flushall(),
        ):
            assert refused(action) == "NoPermissionError", action
    finally:
        for t in learners:
            t.close()
        syncer.close()


@pytest.mark.timeout(60)
def test_a_join_holder_cannot_take_an_enrolled_learners_id_and_revocation_shuts_it_out(
    acl_server: RedisServer, keys_dir: Path
) -> None:
    url = acl_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=15.0
    )
    identity = Identity.new()
    real = RedisLearnerTransport(url, RUN, "learner-0", 1, 1, identity=identity,
                                 keys=RunKeys.load(keys_dir, "learner"))  # fmt: skip
    impostor = RedisLearnerTransport(url, RUN, "learner-0", 2, 1, identity=Identity.new(),
                                     keys=RunKeys.load(keys_dir, "learner"))  # fmt: skip
    try:
        real.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", step=1))
        exchange(syncer, [real], [make_delta("learner-0", 1, 0)])
        # The impostor, holding the join secret, enrolls under learner-0: refused
        # (identity_taken), so Redis refuses its writes; the real one goes on.
        impostor.send_delta(make_delta("learner-0", 7, 0))
        got: list[Delta] = []

        def refused_and_going_on() -> bool:
            impostor.poll(0.01)
            real.poll(0.01)
            items = syncer.receive(0.05)
            syncer.ack(items)
            got.extend(i.message for i in items if isinstance(i.message, Delta))
            return syncer.stats.rejected["identity_taken"] >= 1

        wait_until(refused_and_going_on, 20, interval_s=0, what="the impostor refused")
        got += exchange(syncer, [real], [make_delta("learner-0", 2, 0)])
        assert {d.seq for d in got} == {2} and impostor.unacked == 1
        # Revoked: its user is gone within a second or two, its connection cut.
        revoke(keys_dir, "learner-0")
        mine = as_member(acl_server, identity)

        def shut_out() -> bool:
            syncer.receive(0.05)
            return refused(mine.ping) == "AuthenticationError"

        wait_until(shut_out, 10, interval_s=0, what="the revoked learner's user to go")
        wait_until(
            lambda: (syncer.receive(0.05), "learner-0" not in syncer.learners)[1], 5,
            what="learner-0 off the roster",
        )  # fmt: skip
    finally:
        impostor.close()
        real.close()
        syncer.close()


@pytest.mark.timeout(60)
def test_requests_larger_than_the_bound_never_leave_redis(
    acl_server: RedisServer, keys_dir: Path
) -> None:
    """Attack: a join holder writes huge entries into the requests stream. The
    syncer drops them inside Redis (TAKE_BOUNDED) and counts them."""
    keys = RunKeys.load(keys_dir, "learner")
    joiner = redis.Redis(
        port=acl_server.port, username=JOIN_USER, password=join_password(keys.join_secret)
    )
    for _ in range(3):
        joiner.xadd(requests_key(RUN), {"m": b"x" * (8 * 2**20)})
    syncer = RedisSyncerTransport(
        acl_server.url,
        RUN,
        "syncer-0",
        [0],
        keys=RunKeys.load(keys_dir, "syncer"),
        identity_hold_s=15.0,
    )
    try:
        wait_until(
            lambda: (syncer.receive(0.05), syncer.stats.rejected["too_large"])[1] == 3, 10,
            what="the oversized requests dropped",
        )  # fmt: skip
        assert syncer.stats.bytes_received < 2**20  # none of them was read
        assert acl_server.client().xlen(requests_key(RUN)) == 0
    finally:
        syncer.close()
