"""Attackers of a live ZeroMQ run, scripted inside it (tests/test_e2e_local.py).

Three kinds, as docs/security.md names them: an outsider who reaches the
ports with no key; a process that holds the join secret; an enrolled learner
that poses as another. Each runs the attacks the transport used to let
through (roster squatting, posing as learner-0 with a future incarnation and
poisoned deltas, reading the weights, filling the learner slots, a flood of
snapshot requests) and records what came back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from broker import wire
from broker.codecs import Codec
from broker.keys import Identity, RunKeys, enroll_proof
from broker.wire import Delta, Enroll, Heartbeat, LeaseRequest, SnapshotRequest
from broker.zmq_transport import GLOBALS_TOPIC, pub_endpoint


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


def attack_live_run(
    run_id: str, endpoint: str, keys_dir: Path, stop: threading.Event, victim: str = "learner-0"
) -> dict[str, Outcome]:
    """Run both attackers until ``stop``; what each got back."""
    keys = RunKeys.load(keys_dir, "learner")
    results: dict[str, Outcome] = {}
    threads = [
        threading.Thread(
            target=lambda: results.__setitem__("outsider", _outsider(run_id, endpoint, stop))
        ),
        threading.Thread(
            target=lambda: results.__setitem__(
                "joiner", _joiner(run_id, endpoint, keys, stop, victim)
            )
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
