"""The run's keys: the folder, enrollment proofs, signed globals, and the
ZeroMQ transports under CURVE with them, on real sockets."""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from broker.errors import ConfigError
from broker.identity.keys import (
    CURVE_SECRET,
    JOIN_SECRET,
    REDIS_ACL,
    SIGNING_KEY,
    Identity,
    RunKeys,
    enroll_proof,
    revoke,
    rotate_curve_key,
    rotate_signing_key,
)
from broker.identity.members import MAX_IDS_PER_KEY, Members
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.run.key_folder import make_keys
from broker.wire import messages as wire
from broker.wire.messages import (
    Delta,
    Enroll,
    GlobalFragment,
    Heartbeat,
    LeaseRequest,
    SnapshotRequest,
)
from broker.zmq.addressing import pub_endpoint
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.options import ZmqOptions
from broker.zmq.syncer import ZmqSyncerTransport
from compose import cli
from tests.servers import wait_until
from tests.test_zmq_transport import RUN, delta, endpoint, global_fragment


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return make_keys(tmp_path / "keys")


def test_the_key_folder_is_private_and_each_role_gets_what_it_needs(keys_dir: Path) -> None:
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    for f in keys_dir.iterdir():
        # Redis's users file holds digests only, read by the Redis server's user.
        assert stat.S_IMODE(f.stat().st_mode) == (0o644 if f.name == REDIS_ACL else 0o600), f
    syncer = RunKeys.load(keys_dir, "syncer")
    learner = RunKeys.load(keys_dir, "learner")
    assert syncer.signing_key is not None and syncer.curve_secret is not None
    assert learner.signing_key is None and learner.curve_secret is None
    # A learner's mount may lack the syncers' secrets; it starts without them.
    (keys_dir / SIGNING_KEY).unlink()
    (keys_dir / CURVE_SECRET).unlink()
    RunKeys.load(keys_dir, "learner")
    with pytest.raises(ConfigError, match=r"no syncer\.curve in the run's key folder"):
        RunKeys.load(keys_dir, "syncer")


def test_a_missing_or_loose_key_is_named_at_start(tmp_path: Path, keys_dir: Path) -> None:
    with pytest.raises(ConfigError, match="no run key folder.*ddiloco keys --keys"):
        RunKeys.load(tmp_path / "nowhere", "learner")
    os.chmod(keys_dir / JOIN_SECRET, 0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        RunKeys.load(keys_dir, "learner")
    os.chmod(keys_dir / JOIN_SECRET, 0o600)
    (keys_dir / JOIN_SECRET).write_text("not hex\n")
    with pytest.raises(ConfigError, match="expected 64 hex digits"):
        RunKeys.load(keys_dir, "learner")
    with pytest.raises(ConfigError, match="holds a run's keys already"):
        make_keys(keys_dir)


def test_keys_acl_writes_redis_users_again_from_the_folder(keys_dir: Path) -> None:
    """A folder made by an earlier release holds a redis.acl whose default user
    may run nothing (Redis then dropped the append-only file's transactions
    at a restart): `ddiloco keys acl` writes it again from the folder's secrets."""
    made = (keys_dir / REDIS_ACL).read_text()
    assert made.startswith("user default off resetpass ~* &* +@all\n")
    (keys_dir / REDIS_ACL).write_text("user default off resetchannels -@all\n")
    assert cli.main(["keys", "acl", "--keys", str(keys_dir)]) == 0
    assert (keys_dir / REDIS_ACL).read_text() == made


def test_an_identity_kept_in_a_file_is_the_same_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "home" / "learner-0.identity"
    first = Identity.kept_in(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.kept_in(path) == first
    assert Identity.kept_in(None) != first


def signed_global(keys_dir: Path, version: int = 1) -> GlobalFragment:
    return GlobalSigner(RunKeys.load(keys_dir, "syncer")).sign(global_fragment(0, version))


def test_a_signature_covers_every_field_and_the_payload(keys_dir: Path) -> None:
    verifier = GlobalVerifier(RunKeys.load(keys_dir, "learner"))
    g = signed_global(keys_dir)
    assert verifier.verify(wire.decode(wire.encode(g)))  # survives the wire
    payload = bytearray(g.payload)
    payload[0] ^= 1
    for forged in (
        replace(g, payload=bytes(payload)),
        replace(g, epoch=g.epoch + 1),
        replace(g, version=2**62),
        replace(g, weights_crc=g.weights_crc + 1),
        replace(g, signature=""),
        replace(g, signature="0" * 128),
    ):
        assert not verifier.verify(forged)
    # Another run's signing key signs nothing of this run.
    other = make_keys(keys_dir.parent / "other")
    assert not verifier.verify(signed_global(other))


def test_a_rotated_signing_key_is_accepted_once_listed(keys_dir: Path) -> None:
    verifier = GlobalVerifier(RunKeys.load(keys_dir, "learner"), reread_s=0.0)
    old = signed_global(keys_dir)
    rotate_signing_key(keys_dir)
    new = signed_global(keys_dir, version=2)
    assert verifier.verify(new)  # re-read the list on the unknown signature
    assert verifier.verify(old)  # the old key stays listed until removed


def test_an_enroll_proof_is_bound_to_run_key_and_role(keys_dir: Path) -> None:
    keys = RunKeys.load(keys_dir, "learner")
    key = Identity.new().key_hex
    proof = enroll_proof(keys.join_secret, RUN, key, "reader")
    assert proof != enroll_proof(keys.join_secret, RUN, key, "learner")
    assert proof != enroll_proof(keys.join_secret, "other", key, "reader")
    assert proof != enroll_proof(keys.join_secret, RUN, Identity.new().key_hex, "reader")
    msg = Enroll(run_id=RUN, key=key, role="reader", proof=proof)
    assert wire.decode(wire.encode(msg)) == msg


# -- ZeroMQ under CURVE ------------------------------------------------------
def keyed_pair(
    keys_dir: Path,
    role: str = "learner",
    learner_id: str = "learner-0",
    options: ZmqOptions = ZmqOptions(),
) -> tuple[ZmqSyncerTransport, ZmqLearnerTransport]:
    ep = endpoint()
    syncer = ZmqSyncerTransport(
        ep, RUN, [0, 1], keys=RunKeys.load(keys_dir, "syncer"), options=options,
        identity_hold_s=15.0,
    )  # fmt: skip
    learner = ZmqLearnerTransport(
        [ep], RUN, learner_id, 1, 2, keys=RunKeys.load(keys_dir, "learner"), role=role
    )
    return syncer, learner


def received(syncer: ZmqSyncerTransport, timeout_s: float = 5.0) -> list[wire.Message]:
    got: list[wire.Message] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not got:
        got = [i.message for i in syncer.receive(0.05)]
    return got


def heard_from(syncer: ZmqSyncerTransport, learner: ZmqLearnerTransport) -> Heartbeat:
    """Send learner-0's heartbeat until the syncer takes one (its key then holds
    the id); the heartbeat, to send again."""
    beat = Heartbeat(run_id=RUN, learner_id="learner-0", incarnation=1)

    def heard() -> bool:
        learner.send_heartbeat(beat)
        return any(isinstance(m, Heartbeat) for m in received(syncer, 0.2))

    wait_until(heard, 15, what="learner-0's heartbeat")
    return beat


def test_a_keyed_learner_enrolls_sends_and_gets_signed_globals(keys_dir: Path) -> None:
    syncer, learner = keyed_pair(keys_dir)
    try:
        learner.send_delta(delta("learner-0", 1, 0))
        items: list = []

        def got_delta() -> bool:
            items.extend(syncer.receive(0.05))
            learner.poll(0.01)  # resends until the enrollment was taken first
            return any(isinstance(i.message, Delta) for i in items)

        wait_until(got_delta, 15, what="the delta")
        syncer.ack([i for i in items if isinstance(i.message, Delta)])
        wait_until(lambda: learner.poll(0.05) == [] and learner.unacked == 0, 10, what="ack")

        def took_global() -> bool:
            syncer.publish(global_fragment(0, 1))
            return any(g.version == 1 for g in learner.poll(0.1))

        wait_until(took_global, 15, what="a signed global")
        assert learner.stats.rejected["bad_signature"] == 0
    finally:
        learner.close()
        syncer.close()


def test_an_unkeyed_peer_reaches_nothing(keys_dir: Path) -> None:
    """No CURVE key of the run: the handshake fails, so no frame is read and
    no global is sent (the issue's outsider: squatting, posing, reading)."""
    ep = endpoint()
    syncer = ZmqSyncerTransport(
        ep, RUN, [0, 1], keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=15.0
    )
    plain = ZmqLearnerTransport([ep], RUN, "learner-0", 1, 2)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint(ep))
    try:
        plain.send_delta(delta("learner-0", 1, 0))
        plain.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", incarnation=1))
        assert received(syncer, 2.0) == []
        syncer.publish(global_fragment(0, 1))
        assert sub.poll(500) == 0
        assert plain.snapshot([0], timeout_s=1.0) == {}
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)
        plain.close()
        syncer.close()


def test_a_key_that_did_not_enroll_is_refused_message_by_message(keys_dir: Path) -> None:
    """A CURVE key made by an outsider completes the handshake on the request
    socket (it must be able to enroll) but nothing it sends is taken, and no
    global reaches it."""
    syncer, learner = keyed_pair(keys_dir)
    outsider = Identity.new()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    for sock in (dealer,):
        sock.curve_serverkey = RunKeys.load(keys_dir, "learner").curve_public
        sock.curve_publickey = outsider.public
        sock.curve_secretkey = outsider.secret
    learner.close()
    ep = syncer._router.getsockopt(zmq.LAST_ENDPOINT).decode()
    dealer.connect(ep)
    try:
        forged = Enroll(run_id=RUN, key=outsider.key_hex, role="learner", proof="0" * 64)
        for msg in (
            forged,
            Heartbeat(run_id=RUN, learner_id="learner-0", incarnation=1),
            LeaseRequest(run_id=RUN, holder="host", ttl_s=10.0),
            SnapshotRequest(run_id=RUN, learner_id="x", fragments=[0]),
        ):
            dealer.send(wire.encode(msg))
        dealer.send_multipart(wire.encode_parts(delta("learner-0", 1, 0)))
        assert received(syncer, 2.0) == []
        rejected = syncer.stats.rejected
        assert rejected["bad_enroll_proof"] == 1 and rejected["not_enrolled"] == 4, rejected
        assert dealer.poll(300) == 0  # no snapshot, no lease
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)
        syncer.close()


def test_an_enrolled_learner_cannot_pose_as_another(keys_dir: Path) -> None:
    """The issue's learner-0 impostor: a second process holding the join secret
    claims the id of an enrolled learner; its deltas are refused (not acked as
    duplicates of the real learner's) and the real one goes on."""
    syncer, real = keyed_pair(keys_dir)
    impostor = ZmqLearnerTransport(
        [syncer._router.getsockopt(zmq.LAST_ENDPOINT).decode()],
        RUN, "learner-0", int(time.time()) + 50, 2,
        keys=RunKeys.load(keys_dir, "learner"),
    )  # fmt: skip
    try:
        real.send_delta(delta("learner-0", 1, 0))
        items: list = []

        def got(n: int, who: str) -> bool:
            items.extend(syncer.receive(0.05))
            real.poll(0.01)
            impostor.poll(0.01)
            return sum(isinstance(i.message, Delta) for i in items) >= n

        wait_until(lambda: got(1, "real"), 15, what="the real delta")
        impostor.send_delta(delta("learner-0", 1, 0, incarnation=int(time.time()) + 50))
        wait_until(lambda: syncer.stats.rejected["identity_taken"] >= 1 or got(2, "x"), 15)
        assert syncer.stats.rejected["identity_taken"] >= 1
        assert [i.message.incarnation for i in items if isinstance(i.message, Delta)] == [1]
    finally:
        impostor.close()
        real.close()
        syncer.close()


def test_a_reader_may_fetch_but_not_write(keys_dir: Path) -> None:
    syncer, reader = keyed_pair(keys_dir, role="reader", learner_id="evaluator")
    try:
        syncer.publish(global_fragment(0, 3))
        got: dict = {}

        def fetched() -> bool:
            syncer.receive(0.02)
            got.update(reader.snapshot([0], timeout_s=0.2))
            return 0 in got

        wait_until(fetched, 15, what="the reader's snapshot")
        assert got[0].version == 3
        reader.send_heartbeat(Heartbeat(run_id=RUN, learner_id="evaluator", incarnation=1))
        wait_until(lambda: syncer.receive(0.05) == [] and syncer.stats.rejected["read_only"], 5)
    finally:
        reader.close()
        syncer.close()


def test_a_revoked_learner_is_shut_out_without_a_restart(keys_dir: Path) -> None:
    syncer, learner = keyed_pair(keys_dir)
    try:
        beat = heard_from(syncer, learner)
        revoke(keys_dir, "learner-0")
        time.sleep(1.1)  # the syncer reads the list at most every second
        learner.send_heartbeat(beat)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert not any(isinstance(m, Heartbeat) for m in received(syncer, 0.1))
        assert syncer.stats.rejected["revoked"] >= 1
    finally:
        learner.close()
        syncer.close()


def test_a_forged_global_never_reaches_a_keyed_learner(keys_dir: Path) -> None:
    """The issue's forged global (a new epoch, weights of 1e30, a correct
    checksum) published by a syncer holding another run's keys: dropped and
    counted, never offered."""
    other = make_keys(keys_dir.parent / "other")
    ep = endpoint()
    rogue = ZmqSyncerTransport(
        ep, RUN, [0, 1], keys=RunKeys.load(other, "syncer"), identity_hold_s=15.0
    )
    # A learner holding the run's join secret and server key, told the rogue's
    # server key (as a man in the middle would present it), still checks signatures.
    learner_keys = replace(
        RunKeys.load(keys_dir, "learner"),
        curve_public=RunKeys.load(other, "learner").curve_public,
        join_secret=RunKeys.load(other, "learner").join_secret,
    )
    learner = ZmqLearnerTransport([ep], RUN, "learner-0", 1, 2, keys=learner_keys)
    try:
        bad = replace(
            global_fragment(0, 1),
            epoch=int(time.time()) + 1,
            payload=torch.full((4,), 1e30).numpy().tobytes(),
        )

        def rejected() -> bool:
            rogue.receive(0.02)
            rogue.publish(bad)
            assert learner.poll(0.05) == []
            return learner.stats.rejected["bad_signature"] > 0

        wait_until(rejected, 15, what="the forged global to be refused")
    finally:
        learner.close()
        rogue.close()


def test_a_lease_never_hands_over_the_id_of_a_learner_that_named_itself(keys_dir: Path) -> None:
    """learner-0 named itself (``ddiloco local``); another key's lease request
    asks for slot 0 by that learner's holder name: it gets another slot, and
    learner-0 stays bound to the real learner's key."""
    syncer, real = keyed_pair(keys_dir)
    ep = syncer._router.getsockopt(zmq.LAST_ENDPOINT).decode()
    other = ZmqLearnerTransport([ep], RUN, "x", 1, 2, keys=RunKeys.load(keys_dir, "learner"))
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [syncer.receive(0.02) for _ in iter(stop.is_set, True)])
    try:
        heard_from(syncer, real)
        pump.start()
        slot = other.lease("learner-0", ttl_s=0.001, timeout_s=10, held_slot=0)
        assert slot != 0
        other.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", incarnation=9))
        wait_until(lambda: syncer.stats.rejected["identity_taken"] >= 1, 10)
    finally:
        stop.set()
        if pump.is_alive():
            pump.join()
        other.close()
        real.close()
        syncer.close()


def test_the_signing_key_rotates_while_syncer_and_learner_run(keys_dir: Path) -> None:
    """`ddiloco keys rotate` on the run's folder: the syncer signs with the new
    key within a second, the learner accepts it (it re-reads the list), and
    nothing restarts."""
    syncer, learner = keyed_pair(keys_dir)
    assert syncer._signer is not None
    syncer._signer.watch.every_s = 0.0
    try:
        version = 0

        def took_one() -> bool:
            nonlocal version
            version += 1
            syncer.receive(0.02)
            syncer.publish(global_fragment(0, version))
            got = learner.poll(0.1)
            for g in got:
                learner.accepted(g)
            return bool(got)

        wait_until(took_one, 15, what="a global before the rotation")
        before = learner.stats.rejected["bad_signature"]
        new_key = rotate_signing_key(keys_dir)
        wait_until(took_one, 15, what="a global after the rotation")
        # The syncer signs with the new key alone now.
        only_new = replace(
            RunKeys.load(keys_dir, "learner"),
            verify_keys=(Ed25519PublicKey.from_public_bytes(bytes.fromhex(new_key)),),
        )
        signer = syncer._signer
        assert signer is not None
        assert GlobalVerifier(only_new).verify(signer.sign(global_fragment(1, 1)))
        assert learner.stats.rejected["bad_signature"] == before
    finally:
        learner.close()
        syncer.close()


def test_one_key_holds_a_few_learner_ids_and_one_slot(keys_dir: Path) -> None:
    """Attack: an enrolled key claims id after id, to grow the roster (and, over
    Redis, its ACL user) alone. It holds MAX_IDS_PER_KEY at most, and one slot."""
    keys = RunKeys.load(keys_dir, "syncer")
    members = Members(keys, "r", hold_s=15.0)
    key = "ab" * 32
    enroll = Enroll(run_id="r", key=key, role="learner",
                    proof=enroll_proof(keys.join_secret, "r", key, "learner"))  # fmt: skip
    assert members.enroll(key, enroll) is None
    for i in range(MAX_IDS_PER_KEY):
        assert members.check(key, f"name-{i}", writes=True) is None
    assert members.check(key, "one-more", writes=True) == "too_many_ids"
    assert members.check(key, "name-0", writes=True) is None  # those it holds, it keeps
    members.bind(key, "learner-3")
    members.bind(key, "learner-5")  # a new slot: the old one's id goes
    assert {i for i in members.ids_of(key) if i.startswith("learner-")} == {"learner-5"}


def test_fragments_cross_curve_in_frames_and_a_message_of_endless_parts_is_dropped(
    keys_dir: Path,
) -> None:
    """Under CURVE a payload travels in 1 MiB frames (libzmq's encryption keeps
    them in cache) and arrives whole, both ways. Attack: a peer that passed the
    handshake (any CURVE key may, to enroll) sends one message of endless small
    parts, each within MAXMSGSIZE: it is read frame by frame, dropped past the
    bound and counted, and the next delta is taken."""
    syncer, learner = keyed_pair(keys_dir, options=ZmqOptions(max_message_bytes=8 * 2**20))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    outsider = Identity.new()
    dealer.curve_serverkey = RunKeys.load(keys_dir, "learner").curve_public
    dealer.curve_publickey, dealer.curve_secretkey = outsider.public, outsider.secret
    dealer.connect(syncer._router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        numel = 5 * 2**20 // 4 + 3  # 5 MiB and a ragged last frame
        weights = torch.randn(numel).numpy().tobytes()
        learner.send_delta(replace(delta("learner-0", 1, 0), numel=numel, payload=weights))
        items: list = []

        def got_delta() -> bool:
            items.extend(syncer.receive(0.05))
            learner.poll(0.01)
            return any(isinstance(i.message, Delta) for i in items)

        wait_until(got_delta, 15, what="the 5 MiB delta")
        assert [bytes(i.message.payload) for i in items] == [weights]

        def took_global() -> bool:
            syncer.publish(replace(global_fragment(0, 1), numel=numel, payload=weights))
            return any(bytes(g.payload) == weights for g in learner.poll(0.1))

        wait_until(took_global, 15, what="a 5 MiB signed global")

        for _ in range(100_000):
            dealer.send(b"x" * 64, zmq.SNDMORE)
        dealer.send(b"x")
        wait_until(
            lambda: syncer.receive(0.05) == [] and syncer.stats.rejected["too_large"] == 1,
            30,
            what="the endless message dropped",
        )
        items.clear()
        learner.send_delta(delta("learner-0", 2, 1))
        wait_until(got_delta, 15, what="the next delta")
        assert syncer.stats.rejected["too_large"] == 1
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)
        learner.close()
        syncer.close()


def test_the_curve_key_rotates_while_syncer_and_learner_run(keys_dir: Path) -> None:
    """`ddiloco keys rotate-curve` on the run's folder: the syncer binds again with
    the new key, the learner (which re-reads the list) dials it, its deltas keep
    being taken, a newcomer with the new list connects, and nothing restarts."""
    syncer, learner = keyed_pair(keys_dir)
    assert syncer._curve_watch is not None and learner._curve_watch is not None
    syncer._curve_watch.every_s = learner._curve_watch.every_s = 0.0
    newcomer: ZmqLearnerTransport | None = None
    try:
        seq = 0

        def taken(sender: ZmqLearnerTransport) -> bool:
            nonlocal seq
            seq += 1
            sender.send_delta(delta(sender.learner_id, seq, seq % 2))
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                sender.poll(0.02)
                got = syncer.receive(0.02)
                syncer.ack(got)
                if any(isinstance(i.message, Delta) and i.message.seq == seq for i in got):
                    return True
            return False

        wait_until(lambda: taken(learner), 15, what="a delta before the rotation")
        old_public = RunKeys.load(keys_dir, "learner").curve_public
        new_public = rotate_curve_key(keys_dir)
        assert RunKeys.load(keys_dir, "learner").curve_public == new_public.encode() != old_public
        wait_until(lambda: taken(learner), 15, what="the learner's delta after the rotation")
        newcomer = ZmqLearnerTransport(
            [learner._shard_endpoints[0]], RUN, "learner-1", 1, 2,
            keys=RunKeys.load(keys_dir, "learner"),
        )  # fmt: skip
        wait_until(lambda: taken(newcomer), 15, what="a newcomer's delta")
    finally:
        if newcomer is not None:
            newcomer.close()
        learner.close()
        syncer.close()
