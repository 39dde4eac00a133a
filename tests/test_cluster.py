"""The container cluster against a real Docker engine: one lifecycle with docker
compose over Redis (up with two syncer shards, scale, a learner and one shard
crashed by ddiloco chaos, a throttled learner, the end), and the same file with
its ZeroMQ variant on a single-node swarm (two syncer shards behind one name,
one killed and replaced by a task at another address).

Every wait polls a condition with a timeout. Each test removes its containers,
volumes and networks; the images are built once and removed at the end.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.identity.keys import REDIS_SYNCER
from broker.redis.users import SYNCER_USER
from broker.run.key_folder import make_keys
from broker.run.settings import default_quorum
from compose.throttle import parse_rate
from tests.docker_env import (
    COMPOSE_DIR,
    COMPOSE_FILE,
    ClusterImages,
    build_images,
    compose_command,
    ddiloco,
    docker_client,
    learner_events,
    read_jsonl,
    run,
)
from tests.servers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

# A small model and frequent syncs: the lifecycle shows every event in minutes.
CLUSTER_SETTINGS = {
    "DDILOCO_STEPS": "100000",  # learners train until the test stops them
    "DDILOCO_FRAGMENTS": "2",
    "DDILOCO_SYNC_EVERY": "4",
    "DDILOCO_OVERLAP": "1",
    "DDILOCO_MODEL_D_MODEL": "32",
    "DDILOCO_MODEL_N_LAYER": "1",
    "DDILOCO_MODEL_N_HEAD": "2",
    "DDILOCO_MODEL_SEQ_LEN": "32",
    "DDILOCO_BATCH_SIZE": "8",
    "DDILOCO_EVAL_EVERY_S": "5",
    "DDILOCO_EVERY_S": "5",
    "DDILOCO_NUM_SHARDS": "8",
}
TIMINGS: dict[str, float] = {}
PROBE_BYTES = 1_000_000
RATE = "2mbit"


@pytest.fixture(scope="module")
def images() -> Iterator[ClusterImages]:
    client = docker_client()
    compose_command()
    yield from build_images(client, TIMINGS)
    print(f"\ncluster timings: {json.dumps(TIMINGS)}")


class Cluster:
    """One compose project of the test: its settings, commands and run folder."""

    def __init__(
        self, images: ClusterImages, run_dir: Path, replicas: int, syncer_shards: int = 1
    ) -> None:
        self.project = f"ddtest{uuid.uuid4().hex[:8]}"
        self.run_dir = run_dir
        self.keys = make_keys(run_dir.parent / "keys")
        # Redis takes nobody without a user: the test looks in as the syncers.
        self.redis_auth = (SYNCER_USER, (self.keys / REDIS_SYNCER).read_text().strip())
        self.env = {
            **CLUSTER_SETTINGS,
            "DDILOCO_IMAGE": images.app,
            "DDILOCO_REDIS_IMAGE": images.redis,
            "DDILOCO_RUN_DIR": str(run_dir),
            "DDILOCO_KEYS_DIR": str(self.keys),
            "DDILOCO_RUN_ID": self.project,
            "DDILOCO_LEARNER_REPLICAS": str(replicas),
            "DDILOCO_SYNCER_SHARDS": str(syncer_shards),
        }

    def compose(self, *args: str, timeout: float = 900) -> str:
        cmd = [*compose_command(), "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        return run(cmd, env=self.env, timeout=timeout)

    def leases(self) -> dict[str, dict[str, Any]]:
        """learner id -> its newest lease event."""
        return {e["learner"]: e for e in learner_events(self.run_dir) if e["event"] == "lease"}

    def stepping(self, since: float) -> set[str]:
        return {
            e["learner"]
            for e in learner_events(self.run_dir)
            if e["event"] == "step" and e["t"] > since
        }

    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "syncer.jsonl") if e["event"] == "round"]


def container_log(container: str) -> str:
    return run(["sh", "-c", f"docker logs {container} 2>&1"])


def shard_in_log(container: str) -> int:
    """The shard a syncer container said it serves, the last time it started."""
    said = [line for line in container_log(container).splitlines() if ", shard " in line]
    assert said, f"{container} named no shard"
    return int(said[-1].split(", shard ")[1].split()[0])


def redis_cli(container: str, auth: tuple[str, str], *args: str) -> Any:
    user, password = auth
    cli = ["redis-cli", "--tls", "--cacert", "/run/secrets/tls.ca.crt", "--no-auth-warning",
           "--user", user, "--pass", password, "--json"]  # fmt: skip
    return json.loads(run(["docker", "exec", container, *cli, *args]))


def probe_transfer(container: str, auth: tuple[str, str]) -> dict[str, float]:
    """Seconds to send and to receive PROBE_BYTES between a learner and Redis."""
    code = (
        "import json, os, time, redis\n"
        f"r = redis.Redis(host='redis', port=6379, socket_timeout=300, username={auth[0]!r},"
        f" password={auth[1]!r}, ssl=True, ssl_ca_certs='/run/secrets/tls.ca.crt')\n"
        f"data = os.urandom({PROBE_BYTES})\n"
        "t = time.perf_counter(); r.set('throttle-probe', data); up = time.perf_counter() - t\n"
        "t = time.perf_counter(); got = r.get('throttle-probe'); down = time.perf_counter() - t\n"
        "assert got == data; r.delete('throttle-probe')\n"
        "print(json.dumps({'up_s': up, 'down_s': down}))\n"
    )
    return json.loads(run(["docker", "exec", container, "python3", "-c", code]))


@pytest.mark.timeout(3600)
def test_cluster_lifecycle(images: ClusterImages, tmp_path: Path) -> None:
    started = time.monotonic()
    # Two syncer shards: fragment 0 on one, fragment 1 on the other.
    cluster = Cluster(images, tmp_path / "run", replicas=3, syncer_shards=2)
    cluster.run_dir.mkdir()
    redis_c = f"{cluster.project}_redis_1"
    syncers = [f"{cluster.project}_syncer_{i}" for i in (1, 2)]
    try:
        # -- up with 3 learners over Redis: 3 slots, 3 shards, all training -------
        cluster.compose("up", "-d")
        wait_until(
            lambda: len(cluster.leases()) == 3 and len(cluster.stepping(0)) == 3,
            600,
            interval_s=2,
            what="3 learners leased and training",
        )
        # Each syncer container leased its own shard, which serves its fragment.
        wait_until(
            lambda: {r["fragment"] for r in cluster.rounds()} == {0, 1},
            300,
            interval_s=1,
            what="rounds of both fragments",
        )
        shard_of = {c: shard_in_log(c) for c in syncers}
        assert sorted(shard_of.values()) == [0, 1], shard_of
        TIMINGS["cluster_up_s"] = round(time.monotonic() - started, 1)
        # Redis speaks TLS only: a client in the clear gets no answer at all,
        # not even a refusal, and the services said nothing of the clear.
        clear = run(["docker", "exec", redis_c, "sh", "-c", "redis-cli ping 2>&1 || true"])
        assert "PONG" not in clear and "NOAUTH" not in clear, clear
        assert not any("in the clear" in container_log(c) for c in syncers)

        # -- scaled to 4: a fourth slot and shard, without editing anything ---------
        cluster.compose("up", "-d", "--scale", "learner=4", "--no-recreate")
        wait_until(
            lambda: len(cluster.leases()) == 4 and len(cluster.stepping(0)) == 4,
            600,
            interval_s=2,
            what="a fourth learner leased and training",
        )
        leases = cluster.leases()
        assert sorted(leases) == ["learner-0", "learner-1", "learner-2", "learner-3"]
        assert sorted(e["shard"] for e in leases.values()) == [0, 1, 2, 3]
        assert len({e["holder"] for e in leases.values()}) == 4

        # -- a learner crashed by ddiloco chaos comes back with its slot and shard ---
        chaos_log = cluster.run_dir / "chaos.jsonl"
        ddiloco(
            "chaos",
            "--project",
            cluster.project,
            "--target",
            "learner",
            "--mtbf-s",
            "0.5",
            "--max-kills",
            "1",
            "--restart-s",
            "2",
            "--seed",
            "7",
            "--events",
            str(chaos_log),
        )
        kill = next(e for e in read_jsonl(chaos_log) if e["event"] == "kill")
        assert any(e["event"] == "restart" and e["by"] == "chaos" for e in read_jsonl(chaos_log))
        victim = next(n for n, e in leases.items() if e["holder"] == kill["hostname"])

        def rejoined() -> bool:
            events = [e for e in learner_events(cluster.run_dir) if e.get("learner") == victim]
            after = [e for e in events if e["t"] > kill["t"]]
            relet = [e for e in after if e["event"] == "lease"]
            starts = [e for e in after if e["event"] == "start"]
            return bool(relet and starts and any(e["event"] == "step" for e in after))

        wait_until(rejoined, 300, interval_s=1, what=f"{victim} back after its crash")
        back = next(
            e["t"]
            for e in learner_events(cluster.run_dir)
            if e.get("learner") == victim and e["event"] == "step" and e["t"] > kill["t"]
        )
        TIMINGS["crash_to_rejoin_s"] = round(back - kill["t"], 1)  # to its first step event
        relet = cluster.leases()[victim]
        assert (relet["slot"], relet["shard"], relet["holder"]) == (
            leases[victim]["slot"],
            leases[victim]["shard"],
            leases[victim]["holder"],
        )
        restart = next(
            e
            for e in learner_events(cluster.run_dir)
            if e.get("learner") == victim and e["event"] == "start" and e["t"] > kill["t"]
        )
        assert restart["step"] > 0  # resumed its own progress (state volume)
        others = cluster.stepping(kill["t"]) - {victim}
        assert len(others) == 3  # the others trained on through the crash

        # -- one syncer shard's host lost (killed, its checkpoint folder deleted): --
        # -- the other's rounds go on; it comes back with its own shard, rebuilt --
        # -- from Redis in the same epoch ----------------------------------------------
        before = {r["fragment"]: r["version"] for r in cluster.rounds()}
        ddiloco(
            "chaos",
            "--project",
            cluster.project,
            "--target",
            "syncer",
            "--mtbf-s",
            "0.5",
            "--max-kills",
            "1",
            "--restart-s",
            "3",
            "--lose-state",
            "--seed",
            "7",
            "--events",
            str(chaos_log),
        )
        syncer_kill = [e for e in read_jsonl(chaos_log) if e["event"] == "kill"][-1]
        assert syncer_kill["role"] == "syncer"
        killed = syncer_kill["container"]
        dead_fragment = shard_of[killed]  # shard s serves fragment s of 2
        wait_until(
            lambda: any(
                r["t"] > syncer_kill["t"] and r["fragment"] == dead_fragment
                for r in cluster.rounds()
            ),
            300,
            interval_s=1,
            what="rounds of the killed shard after its restart",
        )
        assert syncer_kill["lost_state"] == f"/ddiloco/checkpoint/shard-{dead_fragment}"
        assert "rebuilt from the run's latest globals" in container_log(killed)
        assert shard_in_log(killed) == dead_fragment  # its own shard back, not the other's
        after = [r for r in cluster.rounds() if r["t"] > syncer_kill["t"]]
        for r in after:  # versions go on from the checkpoint, never back to the start
            assert r["version"] > before.get(r["fragment"], 0)
        # The outage: from the kill to the first round of the restarted shard. The
        # other shard's rounds went on through it.
        outage = (
            syncer_kill["t"],
            next(r["t"] for r in after if r["fragment"] == dead_fragment),
        )
        TIMINGS["shard_outage_s"] = round(outage[1] - outage[0], 1)
        during = [r for r in after if r["t"] < outage[1]]
        assert during and {r["fragment"] for r in during} == {1 - dead_fragment}, during
        trained_in_outage = {
            e["learner"]
            for e in learner_events(cluster.run_dir)
            if e["event"] == "step" and outage[0] < e["t"] < outage[1]
        }
        assert trained_in_outage, "learners stopped while the syncer was down"

        # -- a throttled learner: the limit holds both ways, then it is cleared -----
        target = next(
            c.name
            for c in docker_client().containers.list(
                filters={"label": f"com.docker.compose.project={cluster.project}"},
                ignore_removed=True,
            )
            if c.labels.get("com.docker.compose.service") == "learner"
        )
        records = [
            json.loads(x)
            for x in ddiloco("throttle", "set", "--container", target, "--rate", RATE).splitlines()
        ]
        rate_bits = parse_rate(RATE)
        assert records == [
            {"target": target, "dev": "eth0", "up_bits": rate_bits, "down_bits": rate_bits}
        ]
        throttled_since = time.time()
        throttled = probe_transfer(target, cluster.redis_auth)
        floor_s = PROBE_BYTES * 8 / rate_bits
        TIMINGS.update({f"throttled_{k}": round(v, 2) for k, v in throttled.items()})
        TIMINGS["throttle_floor_s"] = round(floor_s, 2)
        assert throttled["up_s"] >= floor_s and throttled["down_s"] >= floor_s, throttled
        shown = json.loads(ddiloco("throttle", "show", "--container", target))
        assert shown["up_bits"] == rate_bits and shown["down_bits"] == rate_bits
        ddiloco("throttle", "clear", "--container", target)
        cleared = json.loads(ddiloco("throttle", "show", "--container", target))
        assert cleared["up_bits"] is None and cleared["down_bits"] is None
        free = probe_transfer(target, cluster.redis_auth)
        TIMINGS.update({f"unthrottled_{k}": round(v, 2) for k, v in free.items()})
        assert free["up_s"] < floor_s and free["down_s"] < floor_s
        assert len(cluster.stepping(throttled_since)) == 4  # all trained through it

        # -- the end: learners stop, the last rounds merge, the outputs are written ---
        cluster.compose("stop", "-t", "60", "learner")
        auth = cluster.redis_auth
        acked_streams = redis_cli(redis_c, auth, "KEYS", f"ddiloco:{cluster.project}:deltas:*")
        assert len(acked_streams) >= 2 * 4  # a stream per fragment and learner

        def drained() -> bool:
            # Every delta Redis acknowledged was delivered to the syncer group,
            # and the syncer acked each only after merging (or refusing) it.
            for stream in acked_streams:
                info = redis_cli(redis_c, auth, "XINFO", "STREAM", stream)
                group = redis_cli(redis_c, auth, "XINFO", "GROUPS", stream)[0]
                if group["pending"] or group["last-delivered-id"] != info["last-generated-id"]:
                    return False
            return True

        wait_until(drained, 120, interval_s=1, what="every delta in Redis merged and acked")
        # The evaluator takes its last snapshot, the syncer writes its totals, then
        # the reporter writes the final summary and plots.
        for service in ("evaluator", "syncer", "reporter"):
            cluster.compose("stop", "-t", "60", service)
        TIMINGS["lifecycle_s"] = round(time.monotonic() - started, 1)

        # Nothing applied twice: no (learner, incarnation, seq) in two rounds, across
        # every syncer process.
        keys = [tuple(k) for r in cluster.rounds() for k in r["keys"]]
        assert keys and len(keys) == len(set(keys))
        summary = json.loads((cluster.run_dir / "summary.json").read_text())
        assert summary["learners"] == 4
        assert summary["learner_kills"] == 1 and summary["syncer_kills"] == 1
        assert summary["learner_restarts"] == 1  # the chaos restart, mapped to its learner
        assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
        assert summary["deltas_applied"] == len(keys)
        for plot in ("loss_vs_tokens.png", "timeline.png"):
            assert (cluster.run_dir / "plots" / plot).stat().st_size > 0
        logs = run(["sh", "-c", f"docker logs {cluster.project}_reporter_1 2>&1"], timeout=60)
        assert "learners 4" in logs  # progress in `docker compose logs`
    finally:
        cluster.compose("down", "-v", "--remove-orphans", "-t", "10")
        print(f"\ncluster timings: {json.dumps(TIMINGS)}")


def print_swarm_state(stack: str, run_dir: Path) -> None:
    """What a failed swarm test needs to be understood: tasks, their logs, events."""
    print(run(["docker", "stack", "ps", "--no-trunc", stack], timeout=60))
    listed = run(["docker", "stack", "services", stack, "--format", "{{.Name}}"], timeout=60)
    for service in listed.split():
        logs = run(["sh", "-c", f"docker service logs --tail 40 {service} 2>&1"], timeout=60)
        print(f"--- {service}\n{logs}")
    for path in sorted(run_dir.rglob("*.jsonl")):
        print(f"--- {path.relative_to(run_dir)}: last events")
        for event in read_jsonl(path)[-5:]:
            print(json.dumps(event)[:400])


def swarm_rounds(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "syncer.jsonl") if e["event"] == "round"]


@pytest.mark.timeout(3600)
def test_swarm_stack_over_zeromq_with_two_learners_and_two_syncer_shards(
    images: ClusterImages, tmp_path: Path
) -> None:
    client = docker_client()
    joined_here = client.info().get("Swarm", {}).get("LocalNodeState") != "active"
    had_gateway = any(n.name == "docker_gwbridge" for n in client.networks.list())
    if joined_here:
        run(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"], timeout=120)
    stack = f"ddswarm{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        **CLUSTER_SETTINGS,
        "DDILOCO_IMAGE": images.app,
        "DDILOCO_REDIS_IMAGE": images.redis,
        "DDILOCO_RUN_DIR": str(run_dir),
        # Deployed as swarm secrets (compose/compose.yaml's top-level secrets).
        "DDILOCO_KEYS_DIR": str(make_keys(tmp_path / "keys")),
        "DDILOCO_RUN_ID": stack,
        "DDILOCO_LEARNER_REPLICAS": "2",
        "DDILOCO_SYNCER_SHARDS": "2",
    }
    started = time.monotonic()
    files = ["-c", str(COMPOSE_FILE), "-c", str(COMPOSE_DIR / "compose.zmq.yaml")]
    try:
        run(["docker", "stack", "deploy", *files, stack], env=env, timeout=300)

        def rounds_closed() -> bool:
            rounds = swarm_rounds(run_dir)
            learners = {name for r in rounds for name in r["learners"]}
            # M is 4 by default: K follows the 2 learners that joined, no edit.
            # Fragment s of 2 is served by shard s, each a replica of `syncer`.
            return (
                len(rounds) >= 4
                and {r["fragment"] for r in rounds} == {0, 1}
                and learners == {"learner-0", "learner-1"}
                and rounds[-1]["quorum"] == default_quorum(2)
            )

        try:
            wait_until(rounds_closed, 900, interval_s=2, what="rounds with both swarm learners")
        except TimeoutError:
            print_swarm_state(stack, run_dir)
            raise
        TIMINGS["swarm_rounds_s"] = round(time.monotonic() - started, 1)
        listed = run(["docker", "stack", "services", stack, "--format", "{{json .}}"])
        services = {json.loads(line)["Name"]: json.loads(line) for line in listed.splitlines()}
        assert services[f"{stack}_learner"]["Replicas"] == "2/2"
        assert services[f"{stack}_syncer"]["Replicas"] == "2/2"

        # One shard's container killed: swarm replaces it by a task at another
        # address, which takes the freed shard folder; the learners find it
        # there, and the other shard's rounds go on meanwhile.
        syncer_tasks = client.containers.list(
            filters={"label": f"com.docker.swarm.service.name={stack}_syncer"}
        )
        shards = {shard_in_log(c.name): c for c in syncer_tasks}
        assert sorted(shards) == [0, 1], shards
        victim = shards[0]
        networks = victim.attrs["NetworkSettings"]["Networks"]
        old_address = {n["IPAddress"] for n in networks.values()}
        victim.kill()
        killed_at = time.time()

        def shard_0_back() -> bool:
            return any(r["fragment"] == 0 and r["t"] > killed_at for r in swarm_rounds(run_dir))

        try:
            wait_until(shard_0_back, 300, interval_s=1, what="shard 0's rounds after its kill")
        except TimeoutError:
            print_swarm_state(stack, run_dir)
            raise
        after = [r for r in swarm_rounds(run_dir) if r["t"] > killed_at]
        back_at = next(r["t"] for r in after if r["fragment"] == 0)
        TIMINGS["swarm_shard_outage_s"] = round(back_at - killed_at, 1)
        assert any(r["fragment"] == 1 and r["t"] < back_at for r in after), after
        replaced = [
            c
            for c in client.containers.list(
                filters={"label": f"com.docker.swarm.service.name={stack}_syncer"}
            )
            if c.id != victim.id and shard_in_log(c.name) == 0
        ]
        assert replaced, "no new task holds shard 0"
        assert "resumed fragments" in container_log(replaced[0].name)  # the shared checkpoint
        new_networks = replaced[0].attrs["NetworkSettings"]["Networks"]
        TIMINGS["swarm_shard_moved_address"] = float(
            not old_address & {n["IPAddress"] for n in new_networks.values()}
        )
        # The keys went as swarm secrets: the syncer's seven, a learner's four.
        secrets = {s.name for s in client.secrets.list()}
        assert {f"{stack}_{name}" for name in ("join.secret", "signing.key")} <= secrets
        learner_spec = client.services.get(f"{stack}_learner").attrs["Spec"]
        given = learner_spec["TaskTemplate"]["ContainerSpec"].get("Secrets", [])
        assert sorted(s["File"]["Name"] for s in given) == [
            "join.secret", "signing.pub", "syncer.curve.pub", "tls.ca.crt"
        ]  # fmt: skip
    finally:

        def gone() -> bool:
            # `docker stack rm` fails to remove the network while a task still
            # holds it (tasks stop asynchronously): ask again until all is gone.
            subprocess.run(["docker", "stack", "rm", stack], capture_output=True, timeout=120)
            labels = {"label": f"com.docker.stack.namespace={stack}"}
            # ignore_removed: a task's container may go between listing and inspection.
            listed = client.containers.list(all=True, filters=labels, ignore_removed=True)
            return not listed and not [
                n for n in client.networks.list() if n.name.startswith(stack)
            ]

        wait_until(gone, 300, interval_s=2, what="the stack's containers and network to go")
        for volume in client.volumes.list(filters={"label": f"com.docker.stack.namespace={stack}"}):
            volume.remove(force=True)
        if joined_here:
            run(["docker", "swarm", "leave", "--force"], timeout=120)
            if not had_gateway:  # made by swarm init, left behind by leave
                for network in client.networks.list(names=["docker_gwbridge"]):
                    network.remove()
        print(f"\ncluster timings: {json.dumps(TIMINGS)}")
