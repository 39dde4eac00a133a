"""Attackers of a live run, scripted inside it (tests/test_e2e_local.py), over
ZeroMQ (:func:`attack_live_run`) or Redis (:func:`attack_live_redis_run`).

Three kinds, as docs/security.md names them: an outsider who reaches the
ports with no key; a process that holds the join secret; an enrolled learner
that poses as another. Each runs the attacks the transport used to let
through (roster squatting, posing as learner-0 with a future incarnation and
poisoned deltas, reading the weights, filling the learner slots, a flood of
snapshot requests; over Redis also forged globals and refusals, oversized
entries and scripts) and records what came back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch
import zmq

from broker.identity.keys import Identity, RunKeys, enroll_proof
from broker.redis.frames import FIELD
from broker.redis.names import (
    delta_stream_key,
    globals_stream_key,
    heartbeat_key,
    model_key,
    notices_key,
    requests_key,
    roster_key,
)
from broker.redis.users import (
    JOIN_USER,
    join_password,
    member_password,
    member_user,
    password_digest,
)
from broker.wire import messages as wire
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, Enroll, Heartbeat, LeaseRequest, SnapshotRequest
from broker.zmq.addressing import pub_endpoint
from broker.zmq.frames import GLOBALS_TOPIC


@dataclass
class Outcome:
    """What each attacker got back from the syncer, by kind of message."""

    replies: Counter[str] = field(default_factory=Counter)
    globals_seen: int = 0
    sent: int = 0


def _delta(run_id: str, learner: str, incarnation: int, seq: int, numel: int) -> Delta:
    """A poisoned delta: the largest step count the old transport took, huge values."""
    return Delta(
        run_id=run_id, learner_id=learner, incarnation=incarnation, seq=seq, fragment=seq % 2,
        plan_hash="0" * 16, base_version=0, step=256 * seq, c_steps=256, c_tokens=10**6,
        sent_at=time.time(), codec=Codec(), numel=numel,
        payload=Codec().encode(torch.full((numel,), 1e3)),
    )  # fmt: skip


class _Peer:
    """A DEALER and a SUB to one syncer, with or without a CURVE key."""

    def __init__(self, endpoint: str, keys: RunKeys | None, identity: Identity | None) -> None:
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.sub = self.ctx.socket(zmq.SUB)
        for sock in (self.dealer, self.sub):
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None and identity is not None:
                sock.curve_serverkey = keys.curve_public
                sock.curve_publickey = identity.public
                sock.curve_secretkey = identity.secret
        self.sub.setsockopt(zmq.SUBSCRIBE, GLOBALS_TOPIC)
        self.dealer.connect(endpoint)
        self.sub.connect(pub_endpoint(endpoint))
        self.outcome = Outcome()

    def send(self, msg: wire.Message) -> None:
        try:
            self.dealer.send_multipart(wire.encode_parts(msg), zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected (an unkeyed peer never is)
        self.outcome.sent += 1

    def drain(self) -> None:
        while self.dealer.poll(0):
            frames = self.dealer.recv_multipart()
            try:
                msg = wire.decode(b"".join(frames))
                self.outcome.replies[type(msg).__name__] += 1
            except wire.WireError:
                self.outcome.replies["undecodable"] += 1
        while self.sub.poll(0):
            self.sub.recv_multipart()
            self.outcome.globals_seen += 1

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _outsider(run_id: str, endpoint: str, stop: threading.Event) -> Outcome:
    """No key: squat the roster with two made-up ids, pose as learner-0, ask
    for snapshots (the fp32 weights) and every learner slot."""
    peer = _Peer(endpoint, None, None)
    seq = 0
    while not stop.wait(0.2):
        seq += 1
        for learner in ("squatter-0", "squatter-1", "learner-0"):
            peer.send(_delta(run_id, learner, int(time.time()) + 50, seq, 8))
            peer.send(
                Heartbeat(run_id=run_id, learner_id=learner, incarnation=1, sent_at=time.time())
            )
        peer.send(SnapshotRequest(run_id=run_id, learner_id="outsider", fragments=[]))
        peer.send(LeaseRequest(run_id=run_id, holder=f"h{seq}", ttl_s=3600.0))
        peer.drain()
    peer.close()
    return peer.outcome


def _joiner(
    run_id: str, endpoint: str, keys: RunKeys, stop: threading.Event, victim: str
) -> Outcome:
    """Holds the join secret: enrolls a key of its own, learns as ``intruder-0``
    (allowed: it may add a learner), and poses as ``victim`` with an
    incarnation 50 s in the future and poisoned deltas, floods snapshot
    requests, and asks for the victim's slot by its holder name."""
    identity = Identity.new()
    peer = _Peer(endpoint, keys, identity)
    key = identity.key_hex
    enroll = Enroll(
        run_id=run_id, key=key, role="learner",
        proof=enroll_proof(keys.join_secret, run_id, key, "learner"),
    )  # fmt: skip
    future = time.time_ns() + 50 * 10**9
    seq = 0
    while not stop.wait(0.2):
        seq += 1
        peer.send(enroll)
        peer.send(
            Heartbeat(run_id=run_id, learner_id="intruder-0", incarnation=1, sent_at=time.time())
        )
        peer.send(_delta(run_id, victim, future, seq, 8))
        peer.send(
            Heartbeat(run_id=run_id, learner_id=victim, incarnation=future, sent_at=time.time())
        )
        for _ in range(20):
            peer.send(SnapshotRequest(run_id=run_id, learner_id="intruder-0", fragments=[0, 1]))
        peer.send(LeaseRequest(run_id=run_id, holder=victim, held_slot=0, ttl_s=0.001))
        peer.drain()
    peer.close()
    return peer.outcome


def _run_both(attackers: dict[str, Callable[[], Outcome]]) -> dict[str, Outcome]:
    """Run each attacker in a thread of its own until it returns; what each got."""
    results: dict[str, Outcome] = {}
    threads = [
        threading.Thread(target=lambda n=name, f=fn: results.__setitem__(n, f()))
        for name, fn in attackers.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def attack_live_run(
    run_id: str, endpoint: str, keys_dir: Path, stop: threading.Event, victim: str = "learner-0"
) -> dict[str, Outcome]:
    """Run both attackers until ``stop``; what each got back."""
    keys = RunKeys.load(keys_dir, "learner")
    return _run_both({
        "outsider": lambda: _outsider(run_id, endpoint, stop),
        "joiner": lambda: _joiner(run_id, endpoint, keys, stop, victim),
    })  # fmt: skip


# -- Redis ---------------------------------------------------------------------------
def _tried(outcome: Outcome, what: str, action: Callable[[], object]) -> None:
    """Run ``action``, and count what Redis answered, as ``what: answer``."""
    outcome.sent += 1
    try:
        action()
    except redis.RedisError as e:
        outcome.replies[f"{what}: {type(e).__name__}"] += 1
    else:
        outcome.replies[f"{what}: ok"] += 1


def _redis_outsider(run_id: str, port: int, stop: threading.Event) -> Outcome:
    """No user: read the weights, squat the roster, pose as learner-0 and forge
    a global, a refusal and a heartbeat."""
    client = redis.Redis(port=port, socket_timeout=5)
    outcome = Outcome()
    frame = wire.encode(_delta(run_id, "learner-0", int(time.time()) + 50, 1, 8))
    while not stop.wait(0.2):
        for what, action in {
            "read the model": lambda: client.get(model_key(run_id, 0)),
            "squat the roster": lambda: client.hset(roster_key(run_id), "squatter-0", "0" * 64),
            "write as learner-0": lambda: client.xadd(
                delta_stream_key(run_id, 0, "learner-0"), {FIELD: frame}
            ),
            "forge a global": lambda: client.xadd(globals_stream_key(run_id), {FIELD: frame}),
            "forge a refusal": lambda: client.xadd(
                notices_key(run_id, "learner-0"), {FIELD: frame}
            ),
            "beat as learner-0": lambda: client.set(heartbeat_key(run_id, "learner-0"), frame),
        }.items():
            _tried(outcome, what, action)
    client.close()
    return outcome


def _redis_joiner(
    run_id: str, port: int, keys: RunKeys, stop: threading.Event, victim: str
) -> Outcome:
    """Holds the join secret: enrolls a key of its own as ``intruder-0``
    (allowed: it may add a learner) and another key as ``victim``; floods the
    requests stream with 1 MB entries; and, logged in as its own member, tries
    to write the victim's stream, heartbeat and notices, the globals, and to
    run a script that would stall Redis."""
    joiner = redis.Redis(
        port=port, username=JOIN_USER, password=join_password(keys.join_secret), socket_timeout=5
    )
    own, posing = Identity.new(), Identity.new()

    def enrollment(identity: Identity, claims: str) -> bytes:
        key = password_digest(member_password(identity.secret))
        proof = enroll_proof(keys.join_secret, run_id, key, "learner")
        return wire.encode(
            Enroll(run_id=run_id, key=key, role="learner", proof=proof, claims=claims)
        )

    password = member_password(own.secret)
    member = redis.Redis(
        port=port, username=member_user(run_id, password_digest(password)), password=password,
        socket_timeout=5,
    )  # fmt: skip
    heartbeat = wire.encode(Heartbeat(run_id=run_id, learner_id="intruder-0", incarnation=1))
    poison = wire.encode(_delta(run_id, victim, time.time_ns() + 50 * 10**9, 1, 8))
    outcome = Outcome()
    requests = requests_key(run_id)
    while not stop.wait(0.2):
        for what, action in {
            "enroll as intruder-0": lambda: joiner.xadd(
                requests, {FIELD: enrollment(own, "intruder-0")}
            ),
            "enroll as the victim": lambda: joiner.xadd(
                requests, {FIELD: enrollment(posing, victim)}
            ),
            "a 1 MB request": lambda: joiner.xadd(requests, {FIELD: b"x" * 2**20}),
            "read the model unenrolled": lambda: joiner.get(model_key(run_id, 0)),
            "beat as intruder-0": lambda: member.set(
                heartbeat_key(run_id, "intruder-0"), heartbeat
            ),
            "read the model enrolled": lambda: member.get(model_key(run_id, 0)),
            "write as the victim": lambda: member.xadd(
                delta_stream_key(run_id, 0, victim), {FIELD: poison}
            ),
            "beat as the victim": lambda: member.set(heartbeat_key(run_id, victim), heartbeat),
            "forge a refusal": lambda: member.xadd(
                notices_key(run_id, "intruder-0"), {FIELD: poison}
            ),
            "forge a global": lambda: member.xadd(globals_stream_key(run_id), {FIELD: poison}),
            "stall redis with a script": lambda: member.eval("while true do end", 0),
        }.items():
            _tried(outcome, what, action)
    joiner.close()
    member.close()
    return outcome


def attack_live_redis_run(
    run_id: str, port: int, keys_dir: Path, stop: threading.Event, victim: str = "learner-0"
) -> dict[str, Outcome]:
    """Run both Redis attackers until ``stop``; what each got back."""
    keys = RunKeys.load(keys_dir, "learner")
    return _run_both({
        "outsider": lambda: _redis_outsider(run_id, port, stop),
        "joiner": lambda: _redis_joiner(run_id, port, keys, stop, victim),
    })  # fmt: skip
