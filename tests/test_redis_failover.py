"""A Redis that fails over (compose/compose.sentinel.yaml): Sentinel URLs, the
errors of a failover counted as transient, the compose file running what the
tests run, and what a member may ask a Sentinel. The run through a lost
primary is tests/test_syncer_faults.py's
test_a_lost_redis_primary_fails_over_and_the_run_loses_nothing."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from redis.sentinel import MasterNotFoundError, Sentinel

from broker.errors import ConfigError
from broker.identity.keys import JOIN_SECRET, REDIS_SENTINEL
from broker.identity.tls import TLS_CA
from broker.redis.link import NotReplicated, brief, is_transient
from broker.redis.sentinel import DEFAULT_SERVICE, SENTINEL_CONF, parse_sentinel_url
from broker.redis.server import free_port
from broker.redis.users import JOIN_USER, SENTINEL_USER, join_password
from broker.run.key_folder import make_keys
from broker.url import parse_url
from compose.cli import main as ddiloco
from compose.failover import REDIS_NODE, FailoverRedis

COMPOSE = Path(__file__).resolve().parent.parent / "compose"


def test_a_sentinel_url_names_its_sentinels_service_and_db_and_waits_for_a_replica() -> None:
    url = parse_url("rediss+sentinel://s1:26379,s2:26380/ddiloco/2?claim_idle_s=5")
    assert url.backend == "redis"
    assert url.options.wait_replicas == 1  # the sentinel default
    assert url.options.claim_idle_s == 5
    address = parse_sentinel_url(url.endpoints[0])
    assert address.sentinels == (("s1", 26379), ("s2", 26380))
    assert (address.service, address.db, address.tls) == ("ddiloco", 2, True)
    assert parse_url("redis+sentinel://s1:1/x?wait_replicas=0").options.wait_replicas == 0
    assert parse_url("redis://h:1/0").options.wait_replicas == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no service
        "redis+sentinel://s1/ddiloco",  # no port
        "redis+sentinel://s1:1/ddiloco/x",  # db not a number
        "redis+sentinel://s1:1/ddiloco?ssl_cert_reqs=none",  # nothing passes through
        "redis+sentinel://s1:1/ddiloco?wait_replicas=-1",
    ],
)
def test_a_bad_sentinel_url_says_what_to_change(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)


def test_the_errors_of_a_failover_are_transient() -> None:
    # NOREPLICAS as a command's reply, and as a transaction reports it.
    assert is_transient(redis.ResponseError("NOREPLICAS Not enough good replicas to write."))
    assert is_transient(
        redis.ResponseError(
            "Command # 1 (SET k v) of pipeline caused error: NOREPLICAS Not enough good replicas"
        )
    )
    assert is_transient(NotReplicated("0 of 1 replicas hold the delta"))
    assert is_transient(redis.exceptions.ReadOnlyError("READONLY"))
    assert not is_transient(redis.ResponseError("WRONGTYPE Operation against a key"))


# What every container's resolver is told (compose.yaml, x-settings): a name
# that does not resolve fails in one second, not ten.
ONE_SECOND_LOOKUPS = "timeout:1 attempts:1"


def test_compose_runs_each_server_with_the_script_and_settings_the_tests_run() -> None:
    """compose.sentinel.yaml: both servers run compose/redis-node.sh with the
    variables tests/failover.py gives it, the Sentinels the configuration
    `ddiloco keys sentinel` writes, every service the sentinel URL, and every
    container one-second name lookups."""
    spec = yaml.safe_load((COMPOSE / "compose.sentinel.yaml").read_text())
    assert spec["secrets"]["redis-node.sh"]["file"] == f"./{REDIS_NODE.name}"
    script_env = {
        line.split()[1] for line in REDIS_NODE.read_text().splitlines()
        if line.startswith("#   DDILOCO_")
    }  # fmt: skip
    for name in ("redis", "redis-replica"):
        service = spec["services"][name]
        assert "sh /run/secrets/redis-node.sh" in service["entrypoint"][-2]
        assert {v for v in service["environment"] if v.startswith("DDILOCO_")} == script_env
        assert service["environment"]["DDILOCO_REDIS_NODE"] == f"{name}:6379"
        assert service["environment"]["RES_OPTIONS"] == ONE_SECOND_LOOKUPS
    for i in (1, 2, 3):
        sentinel = spec["services"][f"sentinel-{i}"]
        assert SENTINEL_CONF in sentinel["secrets"]
        assert "--sentinel" in sentinel["entrypoint"][-1]
        # A lookup of a server that is down must not stall a Sentinel into TILT.
        assert sentinel["environment"]["RES_OPTIONS"] == ONE_SECOND_LOOKUPS
    base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    for name, service in base["services"].items():
        assert service["environment"]["RES_OPTIONS"] == ONE_SECOND_LOOKUPS, name
    for name in ("syncer", "evaluator", "reporter", "learner"):
        url = spec["services"][name]["environment"]["DDILOCO_URL"]
        address = parse_sentinel_url(url)
        assert address.service == DEFAULT_SERVICE and address.tls
        assert {host for host, _ in address.sentinels} == {"sentinel-1", "sentinel-2", "sentinel-3"}


def test_ddiloco_keys_sentinel_writes_a_private_configuration(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    assert ddiloco(["keys", "sentinel", "--keys", str(keys), "--primary", "redis:6379"]) == 0
    conf = keys / SENTINEL_CONF
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the servers' password
    text = conf.read_text()
    assert "sentinel monitor ddiloco redis 6379 2" in text
    assert "user default off" in text
    assert f"user {SENTINEL_USER} " in (keys / "redis.acl").read_text()
    assert ddiloco(["keys", "sentinel", "--keys", str(keys), "--primary", "redis"]) == 2


@pytest.fixture(scope="module")
def failover_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverRedis]:
    folder = tmp_path_factory.mktemp("failover")
    cluster = FailoverRedis(folder / "redis", make_keys(folder / "keys"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_a_member_may_only_ask_a_sentinel_where_the_primary_is(
    failover_redis: FailoverRedis,
) -> None:
    """Anyone without a user is refused; a holder of the join secret may ask
    where the primary is, and may not fail it over, point the Sentinels at
    another server, change their settings or forget the run."""
    cluster = failover_redis
    tls = {"ssl": True, "ssl_ca_certs": str(cluster.keys / TLS_CA), "socket_timeout": 2}
    port = cluster.sentinel_ports[0]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, **tls).ping()
    secret = bytes.fromhex((cluster.keys / JOIN_SECRET).read_text().strip())
    member = redis.Redis(port=port, username=JOIN_USER, password=join_password(secret), **tls)
    host, server_port = member.sentinel_get_master_addr_by_name(DEFAULT_SERVICE)
    assert int(server_port) == cluster.ports[cluster.primary() or "a"]
    for attack in (
        ["SENTINEL", "FAILOVER", DEFAULT_SERVICE],
        ["SENTINEL", "SET", DEFAULT_SERVICE, "down-after-milliseconds", "1"],
        ["SENTINEL", "MONITOR", "evil", "127.0.0.1", "1", "1"],
        ["SENTINEL", "REMOVE", DEFAULT_SERVICE],
        ["SENTINEL", "RESET", "*"],
        ["SENTINEL", "CONFIG", "SET", "resolve-hostnames", "no"],
        ["ACL", "LIST"],
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            member.execute_command(*attack)


def test_a_member_cannot_replicate_the_run_or_turn_a_server_into_a_replica(
    failover_redis: FailoverRedis,
) -> None:
    """The servers' own user is not a member's: the join user (every member's
    first user) may not sync a copy of the data or make a server follow
    another."""
    cluster = failover_redis
    primary = cluster.primary() or "a"
    secret = bytes.fromhex((cluster.keys / JOIN_SECRET).read_text().strip())
    member = redis.Redis(
        port=cluster.ports[primary], username=JOIN_USER, password=join_password(secret),
        ssl=True, ssl_ca_certs=str(cluster.keys / TLS_CA), socket_timeout=2,
    )  # fmt: skip
    for attack in (["REPLICAOF", "127.0.0.1", "1"], ["SYNC"], ["CONFIG", "REWRITE"]):
        with pytest.raises(redis.exceptions.NoPermissionError):
            member.execute_command(*attack)
    assert (cluster.keys / REDIS_SENTINEL).stat().st_mode & 0o077 == 0


def test_no_primary_found_is_said_in_one_short_line() -> None:
    """redis-py's error names every Sentinel's whole client (2 kB for two); the
    log line says which Sentinels answered what."""
    ports = [free_port(), free_port()]
    sentinel = Sentinel([("127.0.0.1", p) for p in ports], socket_timeout=0.5)
    with pytest.raises(MasterNotFoundError) as caught:
        sentinel.discover_master(DEFAULT_SERVICE)
    line = brief(caught.value)
    assert len(line) < 300 < len(str(caught.value))
    assert line.startswith(f"No master found for '{DEFAULT_SERVICE}'")
    assert all(f"127.0.0.1:{p}: " in line for p in ports)
