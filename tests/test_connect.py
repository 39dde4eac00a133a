"""Broker URLs: parse_url's checks, and transports built from URLs that really
carry a delta and its ack (ZeroMQ on loopback, a private redis-server)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
import torch
import zmq
from redis.connection import parse_url as redis_py_parse_url

from broker.connect import BrokerUrl, connect_learner, connect_syncer, parse_url
from broker.redis.learner import RedisLearnerTransport
from broker.redis.names import GROUP, delta_stream_key
from broker.redis.options import RedisOptions
from broker.redis.server import RedisServer
from broker.redis.syncer import RedisSyncerTransport
from broker.transport import Backpressure, Inbound, LearnerTransport, SyncerTransport
from broker.wire.messages import Delta
from broker.zmq.addressing import shard_endpoint
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.options import ZmqOptions
from broker.zmq.syncer import ZmqSyncerTransport
from compose.processes import free_port_pair
from tests.servers import wait_until

RUN = "test"
PLAN = "0123456789abcdef"
TIMEOUT_S = 20.0


def delta(seq: int, fragment: int = 0, learner: str = "learner-a") -> Delta:
    return Delta(
        run_id=RUN,
        learner_id=learner,
        incarnation=1,
        seq=seq,
        fragment=fragment,
        plan_hash=PLAN,
        base_version=0,
        step=seq,
        c_steps=1,
        c_tokens=16,
        sent_at=time.time(),
        codec="fp32",
        numel=4,
        payload=torch.full((4,), float(seq)).numpy().tobytes(),
    )


# -- parse_url: ZeroMQ -------------------------------------------------------------
def test_zmq_one_endpoint() -> None:
    assert parse_url("zmq://127.0.0.1:5555") == BrokerUrl(
        "zmq", ("tcp://127.0.0.1:5555",), ZmqOptions()
    )
    assert parse_url("zmq://syncer-0:5555/").endpoints == ("tcp://syncer-0:5555",)


def test_zmq_several_endpoints_keep_their_order() -> None:
    parsed = parse_url("zmq://syncer-1:6000,syncer-0:5555,10.0.0.2:7000")
    assert parsed.backend == "zmq"
    assert parsed.endpoints == ("tcp://syncer-1:6000", "tcp://syncer-0:5555", "tcp://10.0.0.2:7000")


def test_zmq_options_are_checked_and_kept() -> None:
    parsed = parse_url(
        "zmq://h:5555?max_unacked=3&ack_timeout_s=0.5&max_batch=10&send_hwm=7"
        "&max_message_bytes=4096"
    )
    assert parsed.endpoints == ("tcp://h:5555",)
    assert parsed.options == ZmqOptions(
        max_unacked=3, ack_timeout_s=0.5, max_batch=10, send_hwm=7, max_message_bytes=4096
    )
    assert parsed.given == {"max_unacked", "ack_timeout_s", "max_batch", "send_hwm",
                            "max_message_bytes"}  # fmt: skip


def test_zmq_options_reach_each_side_converted() -> None:
    """Each side takes the options it has, as its own types, and ignores the others'."""
    port = free_port_pair()
    url = f"zmq://127.0.0.1:{port}?max_unacked=3&ack_timeout_s=0.5&max_batch=10&send_hwm=7"
    learner = connect_learner(url, run_id=RUN, learner_id="l", incarnation=2, num_fragments=4)
    syncer = connect_syncer(
        url, run_id=RUN, syncer_id="s", fragments=[0, 1, 2, 3], identity_hold_s=15.0
    )
    try:
        assert isinstance(learner, ZmqLearnerTransport)
        assert isinstance(syncer, ZmqSyncerTransport)
        assert learner.options.max_unacked == 3 and type(learner.options.max_unacked) is int
        assert learner.options.ack_timeout_s == 0.5 and type(learner.options.ack_timeout_s) is float
        assert (learner.run_id, learner.learner_id, learner.incarnation) == (RUN, "l", 2)
        assert learner.num_fragments == 4
        assert syncer.options.max_batch == 10 and type(syncer.options.max_batch) is int
        assert syncer.fragments == {0, 1, 2, 3}
    finally:
        learner.close()
        syncer.close()


@pytest.mark.parametrize(
    "url",
    [
        "zmq://host",  # no port
        "zmq://host:",
        "zmq://:5555",  # no host
        "zmq://host:0",
        "zmq://host:65535",  # its PUB would need 65536
        "zmq://host:99999",
        "zmq://host:55a5",
        "zmq://host:-1",
        "zmq://host:5555,",  # an empty endpoint
        "zmq://host:5555,other",
        "zmq://",
    ],
)
def test_zmq_bad_port_or_host(url: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_url(url)


@pytest.mark.parametrize("url", ["zmq://host:5555/path", "zmq://host:5555/0"])
def test_zmq_url_has_no_path(url: str) -> None:
    with pytest.raises(ValueError, match="no path"):
        parse_url(url)


@pytest.mark.parametrize(
    ("query", "bad"),
    [
        ("bogus=1", "bogus"),
        ("max_unacked=3&Max_Unacked=3", "Max_Unacked"),
        ("claim_idle_s=5", "claim_idle_s"),  # a redis option
        ("socket_keepalive=true", "socket_keepalive"),  # a redis-py option
    ],
)
def test_unknown_zmq_option_is_an_error(query: str, bad: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown option '{bad}'.*ack_timeout_s"):
        parse_url(f"zmq://host:5555?{query}")


@pytest.mark.parametrize(
    ("option", "text", "expected"),
    [
        ("max_unacked", "many", "int"),
        ("max_unacked", "1.5", "int"),
        ("max_unacked", "", "int"),
        ("ack_timeout_s", "soon", "float"),
        ("send_hwm", "1e3", "int"),
    ],
)
def test_zmq_option_of_the_wrong_type(option: str, text: str, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"{option}='{text}': expected {expected}"):
        parse_url(f"zmq://host:5555?{option}={text}")


def test_each_zmq_shard_has_one_endpoint_from_a_list_or_from_one_port() -> None:
    listed = ("tcp://a:6000", "tcp://b:5555", "tcp://c:7000")
    assert [shard_endpoint(listed, s, 3) for s in range(3)] == list(listed)
    assert [shard_endpoint(("tcp://syncer:5555",), s, 3) for s in range(3)] == [
        "tcp://syncer:5555", "tcp://syncer:5557", "tcp://syncer:5559",
    ]  # fmt: skip
    assert shard_endpoint(("tcp://syncer:5555",), 0, 1) == "tcp://syncer:5555"
    with pytest.raises(ValueError, match="lists 3 syncer endpoints for syncer_shards=2"):
        shard_endpoint(listed, 0, 2)
    with pytest.raises(ValueError, match="2 shards need ports up to 65536"):
        shard_endpoint(("tcp://syncer:65533",), 0, 2)


def test_a_zmq_syncer_binds_its_shards_endpoint_of_the_runs_url() -> None:
    first, second = free_port_pair(), free_port_pair()
    url = f"zmq://127.0.0.1:{first},127.0.0.1:{second}"
    with pytest.raises(ValueError, match="lists 2 syncer endpoints for syncer_shards=1"):
        connect_syncer(url, run_id=RUN, syncer_id="s", fragments=[0], identity_hold_s=15.0)
    syncer = connect_syncer(
        url,
        run_id=RUN,
        syncer_id="s",
        fragments=[1],
        shard=1,
        syncer_shards=2,
        identity_hold_s=15.0,
    )
    try:
        assert isinstance(syncer, ZmqSyncerTransport)
        endpoint = syncer._router.getsockopt_string(zmq.LAST_ENDPOINT)
        assert endpoint == f"tcp://127.0.0.1:{second}"
    finally:
        syncer.close()


# -- parse_url: Redis ------------------------------------------------------------------
def test_redis_url_without_options_is_unchanged() -> None:
    url = "redis://127.0.0.1:6379/0"
    assert parse_url(url) == BrokerUrl("redis", (url,), RedisOptions())


def test_redis_options_are_ours_and_the_rest_is_redis_pys() -> None:
    parsed = parse_url(
        "redis://user:pw@host:6380/1?claim_idle_s=2&socket_keepalive=true&max_unacked=5"
        "&health_check_interval=10&group=g1"
    )
    assert parsed.backend == "redis"
    assert parsed.options == RedisOptions(claim_idle_s=2, max_unacked=5, group="g1")
    assert parsed.endpoints == (
        "redis://user:pw@host:6380/1?socket_keepalive=true&health_check_interval=10",
    )
    kwargs = redis_py_parse_url(parsed.endpoints[0])
    assert kwargs == {
        "username": "user",
        "password": "pw",
        "host": "host",
        "port": 6380,
        "db": 1,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }


def test_rediss_url() -> None:
    parsed = parse_url("rediss://h:6380/0?ssl_cert_reqs=none&block_ms=50")
    assert parsed.endpoints == ("rediss://h:6380/0?ssl_cert_reqs=none",)
    assert (parsed.backend, parsed.options) == ("redis", RedisOptions(block_ms=50))
    assert redis_py_parse_url(parsed.endpoints[0])["ssl_cert_reqs"] == "none"


def test_unix_url_options() -> None:
    parsed = parse_url("unix:///run/redis.sock?db=2&group=g1&claim_idle_s=3")
    assert parsed.backend == "redis"
    assert parsed.options == RedisOptions(group="g1", claim_idle_s=3)


def test_unix_url_is_one_redis_py_accepts() -> None:
    parsed = parse_url("unix:///run/redis.sock?db=2&group=g1")
    kwargs = redis_py_parse_url(parsed.endpoints[0])
    assert kwargs["path"] == "/run/redis.sock" and kwargs["db"] == 2


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:6379/0?claim_idle_s=soon", "claim_idle_s='soon': expected float"),
        ("redis://h:6379/0?block_ms=0.5", "block_ms='0.5': expected int"),
        ("rediss://h:6379/0?max_unacked=x", "max_unacked='x': expected int"),
        ("unix:///s.sock?globals_maxlen=", "globals_maxlen='': expected int"),
    ],
)
def test_redis_option_of_the_wrong_type(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "localhost:6379",
        "127.0.0.1:5555",
        "tcp://127.0.0.1:5555",
        "http://h:1",
        "kafka://broker:9092",
        "ZMQ-x://h:5555",
    ],
)
def test_unknown_scheme(url: str) -> None:
    with pytest.raises(ValueError, match=r"url=.*zmq://HOST:PORT"):
        parse_url(url)


# -- real sockets -----------------------------------------------------------------------
@contextmanager
def connected(url: str, fragments: list[int]) -> Iterator[tuple[LearnerTransport, SyncerTransport]]:
    syncer = connect_syncer(
        url, run_id=RUN, syncer_id="syncer-0", fragments=fragments, identity_hold_s=15.0
    )
    try:
        learner = connect_learner(
            url, run_id=RUN, learner_id="learner-a", incarnation=1, num_fragments=len(fragments)
        )
        try:
            yield learner, syncer
        finally:
            learner.close()
    finally:
        syncer.close()


def deliver(learner: LearnerTransport, syncer: SyncerTransport, sent: Delta) -> Inbound:
    """Send ``sent``, receive it at the syncer (the learner polling meanwhile, which
    is what resends it), and return what the syncer got."""
    learner.send_delta(sent)
    got: list[Inbound] = []

    def received() -> bool:
        learner.poll(0.01)
        got.extend(i for i in syncer.receive(0.05) if isinstance(i.message, Delta))
        return bool(got)

    wait_until(received, TIMEOUT_S, what="the delta to reach the syncer")
    assert len(got) == 1 and got[0].message == sent
    return got[0]


@pytest.mark.integration
def test_zmq_delta_and_ack_over_real_sockets() -> None:
    url = f"zmq://127.0.0.1:{free_port_pair()}?max_unacked=3&ack_timeout_s=0.2"
    with connected(url, [0, 1]) as (learner, syncer):
        assert isinstance(learner, ZmqLearnerTransport)
        assert learner.options.max_unacked == 3
        inbound = deliver(learner, syncer, delta(seq=1, fragment=1))
        assert learner.unacked == 1  # not acked yet: it would be resent
        syncer.ack([inbound])

        def acked() -> bool:
            learner.poll(0.05)
            return learner.unacked == 0

        wait_until(acked, TIMEOUT_S, what="the ack to reach the learner")
        # max_unacked=3 from the URL holds: three deltas in flight, a fourth refused.
        for seq in (2, 3, 4):
            learner.send_delta(delta(seq))
        with pytest.raises(Backpressure):
            learner.send_delta(delta(5))
        assert learner.unacked == 3


@pytest.mark.integration
def test_redis_delta_and_ack_over_a_real_server(redis_server: RedisServer) -> None:
    url = (
        f"{redis_server.url}?max_unacked=3&claim_idle_s=7&group=g-test&block_ms=50"
        "&client_name=ddiloco-test"
    )
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        with connected(url, [0, 1]) as (learner, syncer):
            assert isinstance(learner, RedisLearnerTransport)
            assert isinstance(syncer, RedisSyncerTransport)
            assert learner.options.max_unacked == 3
            assert (syncer.options.claim_idle_s, syncer.options.group) == (7.0, "g-test")
            stream = delta_stream_key(RUN, 1, learner.learner_id)
            inbound = deliver(learner, syncer, delta(seq=1, fragment=1))
            # The syncer made its consumer group under the URL's name, not the default.
            assert [g["name"] for g in client.xinfo_groups(stream)] == [b"g-test"]
            assert GROUP != "g-test"
            assert learner.unacked == 0  # redis has it: delivered
            assert client.xpending(stream, "g-test")["pending"] == 1
            syncer.ack([inbound])
            wait_until(
                lambda: client.xpending(stream, "g-test")["pending"] == 0,
                TIMEOUT_S,
                what="the XACK",
            )
            # redis-py's own query parameter reached redis-py: the clients are named.
            names = [c.get("name") for c in client.client_list()]
            assert "ddiloco-test" in names
    finally:
        client.close()


def free_shard_ports(shards: int) -> int:
    """A port from which the ``2 * shards`` ports of one endpoint for all shards are free."""
    for _ in range(100):
        base = free_port_pair()
        if all(free_port_pair_at(base + 2 * s) for s in range(1, shards)):
            return base
    raise RuntimeError("no free run of ports on loopback")


def free_port_pair_at(port: int) -> bool:
    try:
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    except OSError:
        return False
    return True


@pytest.mark.integration
def test_one_zmq_endpoint_for_two_shards_reaches_each_where_its_host_is_now() -> None:
    """Two shards behind one name (replicas of a compose service): the learner
    finds shard s at port + 2s on whichever address the name has, and follows a
    shard that comes back at another address (a restarted container)."""
    base = free_shard_ports(2)
    addresses = {"127.0.0.1", "127.0.0.2"}
    looked_up: list[str] = []

    def resolve(host: str) -> set[str]:
        looked_up.append(host)
        return set(addresses)

    shard_0 = ZmqSyncerTransport(f"tcp://127.0.0.1:{base}", RUN, [0], identity_hold_s=15.0)
    shard_1 = ZmqSyncerTransport(f"tcp://127.0.0.2:{base + 2}", RUN, [1], identity_hold_s=15.0)
    learner = ZmqLearnerTransport(
        [f"tcp://syncers.test:{base}"], RUN, "learner-a", 1, 2,
        syncer_shards=2, resolve_host=resolve,
    )  # fmt: skip
    try:
        for seq, shard, other in ((1, shard_0, shard_1), (2, shard_1, shard_0)):
            shard.ack([deliver(learner, shard, delta(seq=seq, fragment=seq - 1))])
            assert other.receive(0.05) == []  # each delta went to its own shard only
        shard_1.close()
        addresses = {"127.0.0.1", "127.0.0.3"}
        shard_1 = ZmqSyncerTransport(f"tcp://127.0.0.3:{base + 2}", RUN, [1], identity_hold_s=15.0)
        shard_1.ack([deliver(learner, shard_1, delta(seq=3, fragment=1))])
        assert set(looked_up) == {"syncers.test"} and len(looked_up) >= 2
    finally:
        learner.close()
        shard_0.close()
        shard_1.close()
