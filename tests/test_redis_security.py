"""Redis with the run's keys: TLS with the run's own CA (``rediss://``), against a
real Redis 7 server (these tests fail, never skip, without one)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509

from broker.keys import RunKeys, make_keys
from broker.redis_learner import RedisLearnerTransport
from broker.redis_syncer import RedisSyncerTransport
from broker.tls import REDIS_CERT, REDIS_KEY, TLS_CA, issue_redis_cert, redis_cert_hosts
from broker.transport import TransportError
from broker.wire import Delta
from tests.servers import RedisServer, take_globals, wait_until
from tests.test_redis_transport import RUN, make_delta, make_global, send_all

pytestmark = pytest.mark.integration


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def tls_server(tmp_path: Path, keys_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", tls_keys=keys_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


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


@pytest.mark.timeout(60)
def test_deltas_and_signed_globals_over_tls_with_the_runs_ca(
    tls_server: RedisServer, keys_dir: Path
) -> None:
    url = tls_server.url
    assert url.startswith("rediss://")
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"))
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
    )
    try:
        send_all(learner, [make_delta("learner-0", 1, 0)])
        items = wait_until(lambda: syncer.receive(0.1), 10, what="the delta over TLS")
        assert [i.message.seq for i in items] == [1]
        syncer.ack(items)
        syncer.publish(make_global(0, 1))
        got = wait_until(lambda: take_globals(learner, 0.1), 10, what="the global over TLS")
        assert [(g.version, bool(g.signature)) for g in got] == [(1, True)]
    finally:
        learner.close()
        syncer.close()


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
    assert set(hosts) == {"localhost", "127.0.0.1", "::1", "redis"}
    issue_redis_cert(keys_dir, ("elsewhere.example",))
    reload_tls(tls_server, keys_dir)
    with pytest.raises(redis.ConnectionError):
        tls_server.client(socket_timeout=2).ping()


@pytest.mark.timeout(60)
def test_the_servers_certificate_rotates_while_a_learner_runs(
    tls_server: RedisServer, keys_dir: Path
) -> None:
    url = tls_server.url
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0], keys=RunKeys.load(keys_dir, "syncer"))
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
    )
    try:
        send_all(learner, [make_delta("learner-0", 1, 0)])
        syncer.ack(wait_until(lambda: syncer.receive(0.1), 10, what="first delta"))
        before = served_serial(tls_server, keys_dir)
        # `ddiloco keys rotate-tls`, then Redis told to read the files again.
        issue_redis_cert(keys_dir)
        reload_tls(tls_server, keys_dir)
        after = served_serial(tls_server, keys_dir)
        assert after != before
        # The open connections go on; a new learner connects with the new certificate.
        send_all(learner, [make_delta("learner-0", 2, 0)])
        newcomer = RedisLearnerTransport(
            url, RUN, "learner-1", 1, num_fragments=1, keys=RunKeys.load(keys_dir, "learner")
        )
        try:
            send_all(newcomer, [make_delta("learner-1", 1, 0)])
        finally:
            newcomer.close()
        seen: set[tuple[str, int]] = set()

        def both() -> bool:
            items = syncer.receive(0.1)
            syncer.ack(items)
            seen.update(
                (d.learner_id, d.seq) for d in (i.message for i in items) if isinstance(d, Delta)
            )
            return {("learner-0", 2), ("learner-1", 1)} <= seen

        wait_until(both, 10, what="deltas after the rotation")
    finally:
        learner.close()
        syncer.close()
