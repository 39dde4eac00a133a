"""The learner's own logic, without a network: fragment bookkeeping, flush before
overwrite, error feedback, and globals applied only at step boundaries.

The last tests drive a real :class:`Learner` through an in-memory transport: a
unit test of the learner's decisions, not of any transport (those have their
own tests against real sockets and a real Redis).
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from broker.files import EventLog
from broker.fragments import FragmentPlan, ParamSpec
from broker.transport import LearnerTransport, TransportStats
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta, GlobalFragment, Heartbeat, weights_checksum
from learner.comm import CommThread, Decoded, DeltaEncoder, OutgoingDelta
from learner.config import WorkloadConfig
from learner.evaluator import DeferredEvaluations
from learner.fragment_sync import FragmentSync
from learner.join import DIVERGED, NO_BASE, STALE, GlobalDecoder
from learner.library import DecoupledDiLoCo
from learner.model import ModelConfig
from learner.worker import SlowHardware
from learner.workload import WorkloadContext, load_workload

torch.set_num_threads(1)

PLAN = FragmentPlan.build(
    [ParamSpec("a", (4,), "float32"), ParamSpec("b", (2, 3), "float32")], 2, sync_every=4
)


def params() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(4.0), "b": torch.ones(2, 3)}


# -- fragment bookkeeping ---------------------------------------------------------------
def test_progress_counts_and_the_delta_is_base_minus_current() -> None:
    sync = FragmentSync(PLAN, overlap=1, flush_before_overwrite=True, keep_unsent=False)
    p = params()
    for frag in range(2):
        sync.apply(frag, (0, 3), PLAN.flatten(p, frag), p)
    assert not sync.has_progress(0)
    sync.trained(100)
    sync.trained(50)
    assert sync.c_steps == [2, 2] and sync.c_tokens == [150, 150]
    frag_a = PLAN.owner[0]
    p["a"] -= 0.5
    delta = sync.delta(frag_a, p)
    names = [s.name for s in PLAN.fragment_specs(frag_a)]
    expected = torch.cat([torch.full((4,), 0.5) if n == "a" else torch.zeros(6) for n in names])
    assert torch.equal(delta, expected)


def test_apply_overwrites_resets_counters_and_records_the_version() -> None:
    sync = FragmentSync(PLAN, overlap=1, flush_before_overwrite=True, keep_unsent=False)
    p = params()
    sync.trained(10)
    new = torch.full((PLAN.fragment_numel(0),), 7.0)
    assert sync.is_newer(0, (0, 0))
    sync.apply(0, (7, 5), new, p)
    assert sync.base_version[0] == 5 and sync.base_epoch[0] == 7
    assert not sync.is_newer(0, (7, 5)) and sync.is_newer(0, (7, 6))
    # A global of another epoch (a syncer that started over) is newer whatever its version.
    assert sync.is_newer(0, (8, 0))
    assert sync.c_steps[0] == 0 and sync.c_tokens[0] == 0
    assert sync.c_steps[1] == 1  # the other fragment keeps its progress
    assert torch.equal(PLAN.flatten(p, 0), new)
    new[0] = -1.0  # the base is a copy, not the caller's tensor
    assert sync.base[0][0] == 7.0


def test_mixing_keeps_alpha_of_the_local_weights() -> None:
    sync = FragmentSync(PLAN, overlap=1, flush_before_overwrite=True, keep_unsent=False)
    p = params()
    local = PLAN.flatten(p, 1)
    glob = torch.full_like(local, 10.0)
    sync.apply(1, (0, 1), glob, p, mix_alpha=0.25)
    assert torch.allclose(PLAN.flatten(p, 1), 0.25 * local + 0.75 * glob)
    assert torch.equal(sync.base[1], glob)  # the delta is measured against the global


@pytest.mark.parametrize(("keep_unsent", "mix_alpha"), [(True, 0.0), (False, 0.5)])
def test_non_finite_local_weights_never_survive_a_global(
    keep_unsent: bool, mix_alpha: float
) -> None:
    """A fragment whose own weights blew up (NaN) takes the global as it is:
    no progress kept on top of it, no mixing; apply says so (False)."""
    sync = FragmentSync(PLAN, overlap=1, flush_before_overwrite=True, keep_unsent=keep_unsent)
    p = params()
    sync.apply(0, (0, 1), PLAN.flatten(p, 0), p)
    sync.trained(10)
    p["a"][1] = float("nan") if PLAN.owner[0] == 0 else p["a"][1]
    p["b"][0, 0] = float("inf") if PLAN.owner[0] != 0 else p["b"][0, 0]
    assert sync.send(0, 4, p) is None  # nothing sent of a non-finite fragment
    glob = torch.full((PLAN.fragment_numel(0),), 3.0)
    assert sync.apply(0, (0, 2), glob, p, mix_alpha=mix_alpha) is False
    assert torch.equal(PLAN.flatten(p, 0), glob) and sync.c_steps[0] == 0
    sync.trained(1)
    p["a"] += 1.0
    p["b"] += 1.0
    sync.restore(0, p)  # back on the last good global
    assert torch.equal(PLAN.flatten(p, 0), glob) and sync.c_steps[0] == 0


@pytest.mark.parametrize(
    ("trained", "sent_at", "flag", "expected"),
    [
        (5, None, True, True),  # 5 unsent steps > 2 * overlap (4): would be lost
        (4, None, True, False),  # 4 steps are still within the overlap window
        (5, 4, True, False),  # sent one step ago: in flight, nothing to flush
        (9, 4, True, True),  # 5 steps since the last send
        (5, None, False, False),  # the option is off
    ],
)
def test_flush_before_overwrite(
    trained: int, sent_at: int | None, flag: bool, expected: bool
) -> None:
    sync = FragmentSync(PLAN, overlap=2, flush_before_overwrite=flag, keep_unsent=False)
    p = params()
    sync.apply(0, (0, 0), PLAN.flatten(p, 0), p)
    for _ in range(trained):
        sync.trained(1)
    if sent_at is not None:
        sync.send(0, sent_at, p)
    assert sync.must_flush(0, step=trained) is expected


@pytest.mark.parametrize("keep_unsent", [True, False])
def test_a_global_lands_under_the_progress_not_sent_yet(keep_unsent: bool) -> None:
    """Overwriting the fragment erased the steps trained since its last send: with
    4 learners, a tenth of all tokens trained never reached the global model."""
    sync = FragmentSync(PLAN, overlap=2, flush_before_overwrite=True, keep_unsent=keep_unsent)
    p = params()
    f = PLAN.owner[0]  # the fragment of "a"
    start = PLAN.flatten(p, f).clone()
    sync.apply(f, (0, 0), start, p)
    sync.trained(10)
    p["a"] += 1.0  # three steps' progress, sent
    sent = sync.send(f, step=3, params=p)
    sync.trained(10)
    p["a"] += 0.25  # a step more, not sent yet
    sync.trained(10)
    glob = torch.full_like(start, 5.0)
    sync.apply(f, (0, 1), glob, p)
    unsent = PLAN.flatten(p, f) - glob
    names = [s.name for s in PLAN.fragment_specs(f)]
    expected = torch.cat([torch.full((4,), 0.25) if n == "a" else torch.zeros(6) for n in names])
    assert torch.equal(sent, -expected * 4)
    assert torch.equal(sync.base[f], glob)  # deltas are measured from the global
    if keep_unsent:
        assert torch.equal(unsent, expected)
        # The next delta carries the kept progress, and counts its steps and tokens.
        assert torch.equal(sync.delta(f, p), -expected)
        assert (sync.c_steps[f], sync.c_tokens[f]) == (2, 20)
        # Sent, it is not kept again under the next global.
        sync.send(f, step=6, params=p)
        sync.apply(f, (0, 2), glob + 1, p)
        assert torch.equal(PLAN.flatten(p, f), glob + 1)
    else:
        assert torch.equal(unsent, torch.zeros_like(unsent))
        assert (sync.c_steps[f], sync.c_tokens[f]) == (0, 0)


# -- error feedback ----------------------------------------------------------------------
def outgoing(delta: torch.Tensor, fragment: int = 0) -> OutgoingDelta:
    return OutgoingDelta(delta, Delta(fragment=fragment))


def test_error_feedback_delays_quantisation_error_and_never_loses_it() -> None:
    """Sent so far == true so far - the one residual still held, exactly."""
    codec = Codec.parse("int4")
    encoder = DeltaEncoder(codec, error_feedback=True)
    plain = DeltaEncoder(codec, error_feedback=False)
    g = torch.Generator().manual_seed(0)
    true_sum = torch.zeros(256)
    sent_sum = torch.zeros(256)
    plain_sum = torch.zeros(256)
    for _ in range(20):
        d = torch.randn(256, generator=g) * 0.01
        true_sum += d
        sent = encoder.encode(outgoing(d))
        assert sent.codec == codec and sent.numel == 256
        sent_sum += codec.decode(sent.payload, 256)
        plain_sum += codec.decode(plain.encode(outgoing(d)).payload, 256)
    residual = encoder._residual[0]
    assert torch.allclose(sent_sum + residual, true_sum, atol=1e-6)
    # The residual is one step's rounding error at most; without feedback the
    # errors of all 20 steps add up.
    assert (true_sum - sent_sum).norm() < 0.5 * (true_sum - plain_sum).norm()


def test_error_feedback_sends_what_a_sparse_codec_left_out_later() -> None:
    """A sparse codec sends only the largest 25% of each block; what it leaves out
    stays in the residual and goes out once it has grown: a component too small
    to be picked in any single round still reaches the syncer."""
    codec = Codec("int8", "none", 8, 0.25)
    encoder = DeltaEncoder(codec, error_feedback=True)
    d = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.1])  # the same delta every round
    sent_sum = torch.zeros(8)
    for rounds in range(1, 41):
        sent_sum += codec.decode(encoder.encode(outgoing(d)).payload, 8)
        assert torch.allclose(sent_sum + encoder._residual[0], rounds * d, atol=1e-5)
    assert (sent_sum > 0).all()  # every component went out, the smallest too
    assert torch.allclose(sent_sum / 40, d, rtol=0.3)


def test_error_feedback_is_per_fragment_and_off_for_fp32() -> None:
    codec = Codec.parse("int8")
    encoder = DeltaEncoder(codec, error_feedback=True)
    encoder.encode(outgoing(torch.full((64,), 0.3) + torch.linspace(0, 1e-3, 64), fragment=0))
    d1 = torch.linspace(-1, 1, 64)
    first = codec.decode(encoder.encode(outgoing(d1, fragment=1)).payload, 64)
    assert torch.equal(first, codec.decode(codec.encode(d1), 64))  # fragment 0's error stays
    fp32 = DeltaEncoder(Codec(), error_feedback=True)
    fp32.encode(outgoing(d1))
    assert fp32._residual == {}


# -- the learner at step boundaries ---------------------------------------------------------
class InMemoryTransport(LearnerTransport):
    """Hands the learner whatever globals the test puts in; keeps what it sends."""

    def __init__(self) -> None:
        self.stats = TransportStats()
        self.latest: dict[int, GlobalFragment] = {}
        self.deltas: list[Delta] = []
        self.polled: list[GlobalFragment] = []  # what the next poll() returns
        self.accepted_versions: list[int] = []
        self.resynced: list[int] = []

    def send_delta(self, delta: Delta) -> None:
        self.deltas.append(delta)

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        pass

    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        polled, self.polled = self.polled, []
        return polled

    def accepted(self, fragment: GlobalFragment) -> None:
        self.accepted_versions.append(fragment.version)

    def refused_fragments(self) -> set[int]:
        return set()

    def resync(self, fragment: int) -> None:
        self.resynced.append(fragment)

    def snapshot(
        self, fragments: list[int], timeout_s: float, held: object = None
    ) -> dict[int, GlobalFragment]:
        return {p: self.latest[p] for p in fragments if p in self.latest}

    @property
    def unacked(self) -> int:
        return 0

    def close(self) -> None:
        pass


TINY = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)


def make_learner() -> tuple[DecoupledDiLoCo, InMemoryTransport]:
    model = load_workload(WorkloadContext(WorkloadConfig(model=TINY))).model
    transport = InMemoryTransport()
    learner = DecoupledDiLoCo(
        model, run_id="unit", fragments=2, sync_every=4, overlap=1, transport=transport
    )
    for p in range(2):  # what the syncer would publish at start: the initial weights
        transport.latest[p] = global_of(learner, p, 0, learner.plan.flatten(learner.params, p))
    return learner, transport


def unstarted_comm(learner: DecoupledDiLoCo, transport: InMemoryTransport) -> CommThread:
    """Swap the learner's comm thread for one that is not running: the test takes
    the deltas from its queue and puts arrived globals in by hand."""
    assert learner.comm is not None
    learner.comm.stop(flush_timeout_s=0.0)
    return CommThread(
        transport,
        DeltaEncoder(Codec(), error_feedback=False),
        check=GlobalDecoder(learner.plan).decode,
        max_queued_bytes=2**30,
    )


def decoded(learner: DecoupledDiLoCo, g: GlobalFragment) -> Decoded:
    result = GlobalDecoder(learner.plan).decode(g)
    assert not isinstance(result, str)
    return result


def global_of(learner: DecoupledDiLoCo, p: int, version: int, flat: torch.Tensor) -> GlobalFragment:
    return GlobalFragment(
        run_id="unit",
        fragment=p,
        plan_hash=learner.plan.plan_hash,
        version=version,
        codec=Codec(),
        numel=flat.numel(),
        payload=Codec().encode(flat),
        weights_crc=weights_checksum(flat),
    )


def test_a_global_that_would_erase_unsent_progress_is_flushed_first() -> None:
    learner, transport = make_learner()
    learner.join()
    # The comm thread is not started: the test takes the deltas from its queue.
    learner.comm = unstarted_comm(learner, transport)
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(0.01)  # as if five steps had trained
    for _ in range(5):
        learner.fragments.trained(32)  # as sync.step(weight=32) would count
    before = learner.plan.flatten(learner.params, 0)
    new = torch.full((learner.plan.fragment_numel(0),), 0.5)
    learner.comm._arrived[0] = decoded(learner, global_of(learner, 0, 1, new))

    learner._apply_arrived(step=5)

    flushed = learner.comm._outbox.get_nowait()
    assert flushed.meta.fragment == 0 and flushed.meta.base_version == 0
    assert flushed.meta.c_steps == 5 and flushed.meta.c_tokens == 160
    assert torch.allclose(flushed.delta, transport.latest[0].tensor() - before)
    assert torch.equal(learner.plan.flatten(learner.params, 0), new)
    assert learner.fragments.base_version == {0: 1, 1: 0}
    with pytest.raises(queue.Empty):  # fragment 1 kept its progress and sent nothing
        learner.comm._outbox.get_nowait()


def test_globals_are_applied_only_between_steps_and_only_when_newer() -> None:
    learner, transport = make_learner()
    learner.join()
    learner.comm = unstarted_comm(learner, transport)
    new = torch.full((learner.plan.fragment_numel(1),), 0.25)
    learner.comm._arrived[1] = decoded(learner, global_of(learner, 1, 3, new))
    # Arrived, but nothing changes until the loop reaches its step boundary.
    assert not torch.equal(learner.plan.flatten(learner.params, 1), new)
    learner._apply_arrived(step=1)
    assert torch.equal(learner.plan.flatten(learner.params, 1), new)
    # An older or equal version never goes back in time.
    learner.comm._arrived[1] = decoded(learner, global_of(learner, 1, 2, torch.zeros_like(new)))
    learner._apply_arrived(step=2)
    assert torch.equal(learner.plan.flatten(learner.params, 1), new)
    assert learner.fragments.base_version[1] == 3


def test_the_comm_thread_accepts_only_globals_that_fit_the_plan() -> None:
    """A malformed global is counted and never reaches the transport's version
    record: it cannot make the transport drop the real globals that follow."""
    learner, transport = make_learner()
    learner.join()
    comm = unstarted_comm(learner, transport)
    numel = learner.plan.fragment_numel(1)
    good = global_of(learner, 1, 4, torch.full((numel,), 0.5))
    wrong_plan = GlobalFragment(**{**global_of(learner, 1, 99, torch.zeros(numel)).__dict__,
                                   "plan_hash": "0" * 16})  # fmt: skip
    nan = global_of(learner, 1, 98, torch.full((numel,), float("nan")))
    transport.polled = [good, wrong_plan, nan]
    transport.accepted_versions.clear()  # joining accepted the snapshot
    comm._pump()
    assert comm.globals_rejected == {"wrong_plan": 1, "non_finite": 1}
    assert transport.accepted_versions == [4]
    [(p, stamp, flat)], forced = comm.take_globals()
    assert forced == set()
    assert (p, stamp) == (1, (0, 4)) and torch.equal(flat, torch.full((numel,), 0.5))


def test_joining_without_loading_keeps_the_weights_and_measures_progress_from_them() -> None:
    model = load_workload(WorkloadContext(WorkloadConfig(model=TINY))).model
    transport = InMemoryTransport()
    learner = DecoupledDiLoCo(
        model, run_id="unit", fragments=2, sync_every=4, overlap=1, transport=transport,
        load_global=False,
    )  # fmt: skip
    given = {p: learner.plan.flatten(learner.params, p) for p in range(2)}
    for p in range(2):  # the run's global differs from the weights given
        transport.latest[p] = global_of(learner, p, 7, torch.zeros_like(given[p]))
    learner.join()
    try:
        for p in range(2):
            assert torch.equal(learner.plan.flatten(learner.params, p), given[p])
            assert torch.equal(learner.fragments.base[p], given[p])  # deltas start at zero
        assert learner.fragments.versions() == [7, 7]  # and are rebased onto the run's version
    finally:
        learner.close()


def test_slow_hardware_paces_by_the_fastest_compute_so_a_freeze_is_not_multiplied() -> None:
    pace = SlowHardware(factor=20)
    assert pace.rest_s(0.010) == pytest.approx(0.190)  # the step lasts 20 x 10 ms
    # A process frozen 30 s mid-step: it goes on at once, not after 19 x 30 s.
    assert pace.rest_s(30.0) == 0.0
    # A CPU woken from the sleep computes slower: the next sleep does not grow.
    assert pace.rest_s(0.050) == pytest.approx(0.150)
    assert pace.rest_s(0.005) == pytest.approx(0.095)  # a faster machine state sets the pace
    assert SlowHardware(factor=1).rest_s(0.010) == 0.0


def test_a_change_applies_only_to_the_version_it_is_from() -> None:
    learner, transport = make_learner()
    decoder = GlobalDecoder(learner.plan, transport)
    base = learner.plan.flatten(learner.params, 0)
    step = torch.linspace(-1e-3, 1e-3, base.numel())
    codec = Codec("int8")

    sent = codec.decode(codec.encode(step), base.numel())

    def change(version: int) -> GlobalFragment:
        g = global_of(learner, 0, version, base)
        return replace(
            g, codec=codec, payload=codec.encode(step), change_from=version - 1,
            weights_crc=weights_checksum(apply_change(base, sent)),
        )  # fmt: skip

    # No base yet, then a base of another version: refused, and the snapshot asked for.
    assert decoder.decode(change(1)) == NO_BASE
    assert not isinstance(decoder.decode(global_of(learner, 0, 1, base)), str)
    assert decoder.decode(change(3)) == NO_BASE
    assert transport.resynced == [0, 0]
    result = decoder.decode(change(2))
    assert not isinstance(result, str)
    assert result[1] == (0, 2)
    assert torch.equal(result[2], apply_change(base, sent))
    # Another epoch's change is not from this version either.
    assert decoder.decode(replace(change(3), epoch=1)) == NO_BASE


def test_the_first_step_applies_what_arrived_while_the_learner_started() -> None:
    """Globals that arrived while a learner was busy starting are decoded by its comm
    thread, which that work starved of time. Its first steps went on without
    them: its first deltas were measured from the join version and refused as
    stale. The first step waits for them to be decoded."""
    learner, transport = make_learner()
    learner.join()
    try:
        assert learner.comm is not None
        decode = learner.comm.check

        def slow_check(g: GlobalFragment) -> Decoded | str:
            time.sleep(0.3)  # a comm thread short of CPU
            return decode(g)

        learner.comm.check = slow_check
        newer = {p: learner.plan.flatten(learner.params, p) + 1 for p in range(2)}
        transport.polled = [global_of(learner, p, 1, newer[p]) for p in range(2)]
        learner.step(16)
        assert learner.fragments.base_version == {0: 1, 1: 1}
        assert all(torch.equal(learner.plan.flatten(learner.params, p), newer[p]) for p in range(2))
    finally:
        learner.close()


def test_a_snapshot_that_overtakes_changes_asks_for_nothing_more() -> None:
    """On a slow link a snapshot (its own connection) can arrive beside, or
    before, changes to versions it already holds: those changes are dropped as
    stale, the snapshot is taken first, and no further snapshot is fetched."""
    learner, transport = make_learner()
    try:
        decoder = GlobalDecoder(learner.plan, transport)
        comm = CommThread(
            transport, DeltaEncoder(Codec(), error_feedback=False), check=decoder.decode,
            max_queued_bytes=2**30,
        )  # fmt: skip
        base = learner.plan.flatten(learner.params, 0)
        codec = Codec("int8")
        step = torch.full_like(base, 1e-3)
        sent = codec.decode(codec.encode(step), base.numel())
        versions = [base]
        for _ in range(3):
            versions.append(apply_change(versions[-1], sent))

        def change(v: int) -> GlobalFragment:
            return replace(
                global_of(learner, 0, v, versions[v]), codec=codec, payload=codec.encode(step),
                change_from=v - 1,
            )  # fmt: skip

        assert not isinstance(decoder.decode(global_of(learner, 0, 0, base)), str)
        # Change 1 was lost (the snapshot was asked for); change 2 came by PUB
        # beside the snapshot of version 2, then change 3.
        transport.polled = [change(2), global_of(learner, 0, 2, versions[2]), change(3)]
        comm._pump()
        assert comm.globals_rejected == {} and transport.resynced == []
        assert transport.accepted_versions == [2, 3]
        [(p, stamp, flat)], _ = comm.take_globals()
        assert (p, stamp) == (0, (0, 3)) and torch.equal(flat, versions[3])
        # A change that comes after the snapshot it is older than: stale, nothing fetched.
        assert decoder.decode(change(2)) == STALE and transport.resynced == []
    finally:
        learner.close()


def test_a_global_that_does_not_make_the_version_it_names_is_refused() -> None:
    """A change whose result is not the syncer's version (a learner that took a
    message it should not have, or any bug that breaks bit-identity) is never
    built on: refused as diverged, and the snapshot fetched."""
    learner, transport = make_learner()
    decoder = GlobalDecoder(learner.plan, transport)
    base = learner.plan.flatten(learner.params, 0)
    assert not isinstance(decoder.decode(global_of(learner, 0, 1, base)), str)
    codec = Codec("int8")
    step = torch.full_like(base, 1e-3)
    wrong = replace(
        global_of(learner, 0, 2, base), codec=codec, payload=codec.encode(step), change_from=1
    )  # its checksum is the base's, not base + step's
    assert decoder.decode(wrong) == DIVERGED
    assert transport.resynced == [0]
    # The version held is still the last good one: the right change applies to it.
    right = replace(wrong, weights_crc=weights_checksum(apply_change(base, codec.decode(
        codec.encode(step), base.numel()))))  # fmt: skip
    assert not isinstance(decoder.decode(right), str)


def test_deferred_evaluations_see_each_copy_at_its_time_and_restore_the_model(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    deferred = DeferredEvaluations()
    taken = []
    for value in (1.0, 2.0):
        with torch.no_grad():
            model.weight.fill_(value)
        taken.append(time.time())
        deferred.keep(model, step=int(value))
        time.sleep(0.01)
    with torch.no_grad():
        model.weight.fill_(3.0)  # the model when training ends
    # The copies wait on disk, not in memory, and are gone once evaluated.
    folder = deferred.folder
    assert len(list(folder.iterdir())) == 2
    events = EventLog(str(tmp_path / "events.jsonl"))
    losses = deferred.evaluate_all(model, lambda m: {"loss": float(m.weight.sum())}, events)
    assert list(folder.iterdir()) == []
    events.close()
    assert losses == [2.0, 4.0]  # each copy's weights, not the model's at the end
    assert model.weight.tolist() == [[3.0, 3.0]]
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["loss"], e["deferred"]) for e in written] == [
        ("eval", 1, 2.0, True),
        ("eval", 2, 4.0, True),
    ]
    # Each event is dated when its copy was taken, not when it was evaluated.
    for event, start in zip(written, taken, strict=True):
        assert start <= event["t"] < start + 0.01
    assert deferred.evaluate_all(model, lambda m: {"loss": 0.0}, events) == []  # evaluated once
