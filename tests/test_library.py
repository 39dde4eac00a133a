"""The library API around user models, against a real syncer over real ZeroMQ sockets.

The syncer runs in this process on a thread (the real service object, its real
transport on a free loopback port); learners are threads with their own models,
or, for the kill test, a real process that gets SIGKILLed.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from broker.errors import ConfigError
from broker.fragments import FragmentPlan, synced_parameters
from broker.identity.keys import RunKeys
from broker.redis.frames import FIELD
from broker.redis.names import changes_key, globals_stream_key, model_key
from broker.redis.server import RedisServer, free_port
from broker.redis.users import SYNCER_USER
from broker.run.initial_model import write_initial_model
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from broker.wire.messages import GlobalFragment, encode, weights_checksum
from compose.processes import free_port_pair
from learner.library import DecoupledDiLoCo, load_global_model
from syncer.config import OuterConfig, SyncerConfig
from syncer.service import Syncer
from tests.servers import run_keys, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, Any] = dict(run_id="lib", fragments=2, sync_every=4, overlap=1, keys=run_keys())
STEP_S = 0.005  # the least time one training step takes (see train)


class Regressor(nn.Module):
    """Small, with batch norm (buffers), a frozen layer and optional tied weights."""

    def __init__(self, dtype: torch.dtype = torch.float32, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False, dtype=dtype)
        self.frozen = nn.Linear(8, 8, dtype=dtype)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(8, dtype=dtype)
        self.hidden = nn.Linear(8, 16, dtype=dtype)
        self.out = nn.Linear(16, 8, bias=False, dtype=dtype)
        self.unembed = nn.Linear(8, 8, bias=False, dtype=dtype)
        if tied:
            self.unembed.weight = self.embed.weight  # one tensor, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.frozen(self.embed(x)))
        return self.unembed(self.out(torch.relu(self.hidden(h))))


def make_model(seed: int = 0, **kw: Any) -> Regressor:
    torch.manual_seed(seed)
    return Regressor(**kw)


TARGET = torch.Generator().manual_seed(99)
MAP = torch.randn(8, 8, generator=TARGET) / 3


def batch(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8, generator=gen)
    return x, x @ MAP


def held_out_loss(model: nn.Module) -> float:
    """On fixed held-out data, with batch-norm on the batch's own statistics: the
    global model carries parameters only (buffers stay with each learner)."""
    with torch.no_grad():
        x, y = batch(torch.Generator().manual_seed(12345), 512)
        return float(nn.functional.mse_loss(model(x.to(model.embed.weight.dtype)).float(), y))


@contextmanager
def running_syncer(
    tmp_path: Path,
    model: nn.Module,
    learners: int,
    quorum: int,
    url: str | None = None,
    insecure: bool = False,
    recall_s: float = 0.0,
) -> Iterator[tuple[Syncer, str]]:
    """``recall_s``: 0 unless a test asks, since its learners hold nothing a new
    syncer could take back (tests/test_recall.py waits, as deployed)."""
    url = url or f"zmq://127.0.0.1:{free_port_pair()}"
    initial = tmp_path / "initial.safetensors"
    plan = FragmentPlan.for_model(model, SETTINGS["fragments"], SETTINGS["sync_every"])
    write_initial_model(initial, plan, synced_parameters(model))
    run = RunSettings(
        url=url,
        learners=learners,
        quorum=quorum,
        initial_model=str(initial),
        insecure=insecure,
        **SETTINGS,
    )
    cfg = SyncerConfig(
        run=run,
        outer=OuterConfig(outer_lr=1.0, outer_momentum=0.0),
        checkpoint_dir=str(tmp_path / "checkpoint"),
        metrics_file=str(tmp_path / "syncer.jsonl"),
        recall_s=recall_s,
    )
    syncer = Syncer(cfg)
    thread = threading.Thread(target=syncer.run, daemon=True)
    thread.start()
    try:
        yield syncer, url
    finally:
        syncer.stop_requested.set()
        thread.join(timeout=60)


def train(
    sync: DecoupledDiLoCo,
    model: nn.Module,
    steps: int,
    seed: int,
    opt: torch.optim.Optimizer | None = None,
) -> None:
    """The user's own loop: the dozen lines the library is made for."""
    if opt is None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = batch(gen)
        dtype = model.embed.weight.dtype
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # A real model's step takes milliseconds; this toy's takes a fraction of
        # one, and its learners share the process (and the GIL) with the syncer
        # under test, which they would otherwise outrun by whole rounds when the
        # machine is busy: rounds of one learner, superseded deltas, and a pace
        # measured in a stall that makes its honest step counts look impossible.
        time.sleep(STEP_S)
        sync.step(weight=len(x))


@pytest.mark.timeout(120)
def test_two_learners_train_a_user_model_in_their_own_loops(tmp_path: Path) -> None:
    initial = make_model()
    before = held_out_loss(initial)
    frozen_before = {k: v.clone() for k, v in initial.frozen.state_dict().items()}
    models = [make_model() for _ in range(2)]
    # Both learners train at once, as the rounds-of-both check below needs: a join
    # slower than the other learner's 60 steps left one learner training alone.
    joined = threading.Barrier(2, timeout=60)
    with running_syncer(tmp_path, initial, learners=2, quorum=2) as (syncer, url):

        def learner(i: int) -> None:
            with DecoupledDiLoCo(models[i], url, learner_id=f"l{i}", learners=2, **SETTINGS) as s:
                joined.wait()
                train(s, models[i], steps=60, seed=i)

        threads = [threading.Thread(target=learner, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=100)
        assert not any(t.is_alive() for t in threads)
        wait_until(lambda: not any(s.pending_learners for s in syncer.states.values()), 20)
        final = make_model()  # the initial weights; every trained one comes from the syncer
        versions = load_global_model(final, url, **SETTINGS)
        assert all(
            not torch.equal(p, q)
            for p, q in zip(final.parameters(), initial.parameters(), strict=True)
            if p.requires_grad
        )
    rounds = [json.loads(line) for line in (tmp_path / "syncer.jsonl").read_text().splitlines()]
    both = [e for e in rounds if e["event"] == "round" and e["learners"] == ["l0", "l1"]]
    assert len(both) >= 10, f"only {len(both)} rounds merged both learners"
    assert min(versions) >= 5
    after = held_out_loss(final)
    assert after < 0.5 * before, (before, after)
    for model in models:
        # Frozen parameters: never sent, never changed.
        for k, v in model.frozen.state_dict().items():
            assert torch.equal(v, frozen_before[k]), k
    # Buffers stay local: each learner's batch-norm statistics are its own.
    assert not any(
        s.name.startswith("bn.running") for s in FragmentPlan.for_model(initial, 2, 4).specs
    )
    assert not torch.equal(models[0].bn.running_mean, models[1].bn.running_mean)


@pytest.mark.timeout(120)
def test_bf16_parameters_and_tied_weights_round_trip(tmp_path: Path) -> None:
    model = make_model(dtype=torch.bfloat16, tied=True)
    plan = FragmentPlan.for_model(model, 2, 4)
    names = [s.name for s in plan.specs]
    assert "embed.weight" in names and "unembed.weight" not in names  # sent once
    assert all(s.dtype == "bfloat16" for s in plan.specs)
    with running_syncer(tmp_path, model, learners=1, quorum=1) as (syncer, url):
        with DecoupledDiLoCo(model, url, learner_id="bf", learners=1, **SETTINGS) as sync:
            train(sync, model, steps=24, seed=0)
            # Up: a bf16 learner's delta is exact in fp32, so the syncer rebuilds
            # the learner's weights from it (base - delta) to fp32 rounding.
            for p in range(2):
                rebuilt = sync.fragments.base[p] - sync.fragments.delta(p, sync.params)
                held = sync.plan.flatten(sync.params, p)
                assert torch.allclose(rebuilt, held, rtol=1e-6, atol=1e-7)
        assert sync.delivered and not syncer.metrics.rejected
        assert min(s.version for s in syncer.states.values()) >= 3
        # Down: a global lands in bf16 parameters as exactly its bf16 rounding.
        fresh = make_model(dtype=torch.bfloat16, tied=True)
        load_global_model(fresh, url, **SETTINGS)
        published = {p: syncer.states[p].weights for p in range(2)}
    assert model.unembed.weight is model.embed.weight  # still one tensor
    assert fresh.unembed.weight is fresh.embed.weight
    assert model.embed.weight.dtype == torch.bfloat16
    fresh_params = synced_parameters(fresh)
    for p, flat in published.items():
        for name, value in plan.unflatten(flat, p).items():
            assert fresh_params[name].dtype == torch.bfloat16
            assert torch.equal(fresh_params[name], value.to(torch.bfloat16)), name


def test_a_ddp_wrapped_model_maps_to_the_plan_of_the_bare_model() -> None:
    bare = make_model()
    plan = FragmentPlan.for_model(bare, 2, 4)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        wrapped = DistributedDataParallel(make_model())
        assert next(iter(dict(wrapped.named_parameters()))).startswith("module.")
        assert FragmentPlan.for_model(wrapped, 2, 4) == plan
        assert FragmentPlan.for_model(torch.compile(make_model()), 2, 4) == plan
    finally:
        dist.destroy_process_group()


def test_the_inner_optimizer_state_survives_a_global_overwrite() -> None:
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sync = DecoupledDiLoCo(model, "none", **SETTINGS)
    x, y = batch(torch.Generator().manual_seed(0))
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    flat = torch.zeros(sync.plan.fragment_numel(0))
    sync.fragments.apply(0, (0, 1), flat, sync.params)
    assert all(
        torch.equal(p, torch.zeros_like(p))
        for p in sync.plan.unflatten(sync.plan.flatten(sync.params, 0), 0).values()
    )
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k


@pytest.mark.timeout(60)
def test_a_model_of_another_plan_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    with running_syncer(tmp_path, make_model(), learners=1, quorum=1) as (_, url):
        other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        with (
            pytest.raises(ValueError, match="plan .* differs .*same model") as refused,
            DecoupledDiLoCo(other, url, learner_id="odd", **SETTINGS),
        ):
            pass
    # The failed join released its sockets (``with`` calls no __exit__ then): a
    # ZeroMQ context left to the collector hangs the next collection, as the
    # next syncer's at its startup did.
    del refused
    collection = threading.Thread(target=gc.collect, daemon=True)
    collection.start()
    collection.join(timeout=60)
    assert not collection.is_alive(), "a collection hung on the failed learner's sockets"


def test_unknown_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'fragmnets'"):
        DecoupledDiLoCo(make_model(), "none", fragmnets=2)
    sync = DecoupledDiLoCo(make_model(), "none", delta_codec="int4", **SETTINGS)
    assert sync.run.delta_codec == Codec("int4")


LEARNER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.test_library import make_model, train
from learner.library import DecoupledDiLoCo
model = make_model()
opt_steps = 400
with DecoupledDiLoCo(model, {url!r}, learner_id="k", state_dir={state!r}, learners=1,
                     **{settings!r}) as sync:
    print(json.dumps({{"start_step": sync.start_step,
                      "versions": sync.fragments.versions()}}), flush=True)
    train(sync, model, steps=opt_steps - sync.start_step, seed=sync.start_step)
    print(json.dumps({{"done": sync.step_count}}), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_learner_killed_inside_the_context_restarts_and_rejoins(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with running_syncer(tmp_path, make_model(), learners=1, quorum=1) as (syncer, url):
        script = LEARNER_SCRIPT.format(root=str(ROOT), url=url, state=str(state), settings=SETTINGS)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
        assert first.stdout is not None
        assert json.loads(first.stdout.readline())["start_step"] == 0
        progress = state / "k.json"
        wait_until(
            lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 40,
            60,
            what="progress saved",
        )
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        merged = syncer.metrics.deltas_applied
        second = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
        )
        assert second.returncode == 0, second.stderr[-2000:]
        lines = [json.loads(line) for line in second.stdout.splitlines()]
        # It resumed its schedule and loaded the merged global model.
        assert lines[0]["start_step"] >= 40 and min(lines[0]["versions"]) >= 1
        assert lines[-1] == {"done": 400}
        assert syncer.metrics.deltas_applied > merged  # and it contributed again


def test_a_restart_resumes_step_tokens_incarnation_and_optimizer_state(tmp_path: Path) -> None:
    """Without a syncer (url none) the bookkeeping is the same: what a restarted
    learner keeps is in ``state_dir``."""
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = DecoupledDiLoCo(model, "none", optimizer=opt, state_dir=str(tmp_path), **SETTINGS)
    with first as sync:
        train(sync, model, steps=9, seed=0, opt=opt)
    saved = json.loads((tmp_path / "learner-0.json").read_text())
    assert saved == {"step": 9, "tokens": 9 * 32, "incarnation": first.incarnation}

    model2 = make_model()
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    second = DecoupledDiLoCo(model2, "none", optimizer=opt2, state_dir=str(tmp_path), **SETTINGS)
    with second:
        assert (second.start_step, second.tokens) == (9, 9 * 32)
        # Without a syncer its own weights are the model: they are restored too.
        trained = model.state_dict()
        for name, restored_weights in model2.state_dict().items():
            assert torch.equal(restored_weights, trained[name])
        assert second.incarnation > first.incarnation
        restored = opt2.state_dict()["state"]
        original = opt.state_dict()["state"]
        assert restored.keys() == original.keys() and restored
        for key, state in original.items():
            assert torch.equal(restored[key]["exp_avg"], state["exp_avg"])
            assert torch.equal(restored[key]["exp_avg_sq"], state["exp_avg_sq"])
    # Without optimizer= nothing of the optimizer is written or read.
    assert not (tmp_path / "learner-1.optimizer.pt").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recall_s", [4.0, 0.0], ids=["taken_back", "new_epoch"])
def test_a_syncer_that_lost_its_checkpoint_cannot_lock_learners_out(
    tmp_path: Path, recall_s: float
) -> None:
    """The attack (or accident): a syncer restarted on an empty checkpoint folder,
    while learners hold higher versions. Before epochs, it started again at version
    0, learners ignored its globals as old and it refused their deltas: the run
    learned nothing, silently. Now it takes the learner's version back, in its
    epoch (docs/design.md, "Epochs"); where it asks nobody (--recall-s 0) its
    globals carry a new epoch, which learners take as newer."""
    model = make_model()
    url = f"zmq://127.0.0.1:{free_port_pair()}"
    sync = DecoupledDiLoCo(model, url, learner_id="l", learners=1, **SETTINGS)
    with running_syncer(tmp_path / "first", make_model(), 1, 1, url=url) as (first, _):
        sync.join()

        def moved_on() -> bool:
            train(sync, model, steps=4, seed=0)
            return min(sync.fragments.versions()) >= 3

        wait_until(moved_on, 60, what="the learner to hold version 3 or later")
    held = sync.fragments.versions()
    with running_syncer(tmp_path / "second", make_model(), 1, 1, url=url, recall_s=recall_s) as (
        second,
        _,
    ):
        epoch = second.states[0].epoch
        if recall_s:
            assert epoch == first.states[0].epoch
            assert all(second.states[p].version >= held[p] >= 3 for p in range(2))
        else:
            assert epoch != first.states[0].epoch

        def learning_again() -> bool:
            train(sync, model, steps=4, seed=2)
            return second.metrics.deltas_applied >= 4

        wait_until(learning_again, 60, what="the new syncer to merge the learner's deltas")
        assert all(sync.fragments.base_epoch[p] == epoch for p in range(2))
        sync.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keyed", [True, False], ids=["keys", "insecure"])
def test_a_global_forged_into_redis_with_a_huge_version_locks_no_learner_out(
    tmp_path: Path, redis_server: RedisServer, keyed: bool
) -> None:
    """Attack: anyone who can write to Redis puts a well-formed global of version
    2^62 into the globals stream and the snapshot key. With the run's keys the
    learner refuses it (no syncer signed it) and never leaves the real lineage.
    Without keys (--insecure) the learner takes it (it is well-formed), but the
    syncer refuses the deltas based on it ("future_version") and says so: the
    learner takes the syncer's real global whatever its version (the syncer
    republishes an idle fragment every heartbeat timeout), and its deltas count
    again."""
    settings = SETTINGS if keyed else {**SETTINGS, "insecure": True}
    model = make_model()
    gen = torch.Generator().manual_seed(1)

    def one_step() -> None:
        x, y = batch(gen)
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-2)
                    p.grad = None
        sync.step(weight=len(x))
        time.sleep(0.03)  # a step of a real model takes a while

    with running_syncer(
        tmp_path, model, learners=1, quorum=1, url=redis_server.url, insecure=not keyed
    ) as (syncer, url):
        with DecoupledDiLoCo(model, url, learner_id="l0", learners=1, **settings) as sync:
            for _ in range(12):
                one_step()
            wait_until(lambda: sync.comm is not None and sync.comm.pending == 0, 10)
            wait_until(lambda: not any(s.pending_learners for s in syncer.states.values()), 10)
            flat = sync.plan.flatten(sync.params, 0)
            forged = GlobalFragment(
                run_id="lib", fragment=0, plan_hash=sync.plan.plan_hash,
                epoch=syncer.states[0].epoch, version=2**62, codec=Codec(),
                numel=flat.numel(), payload=Codec().encode(flat),
                weights_crc=weights_checksum(flat),
            )  # fmt: skip
            client = redis.Redis.from_url(url)
            if keyed:
                # With the run's keys Redis takes nobody without a user: an
                # outsider writes nothing. A forger who got the syncers' own
                # user (Redis itself compromised) is left to the signatures.
                with pytest.raises(redis.AuthenticationError):
                    client.set(model_key("lib", 0), encode(forged))
                client.close()
                syncer_keys = RunKeys.load(run_keys(), "syncer")
                client = redis.Redis.from_url(
                    url, username=SYNCER_USER, password=syncer_keys.redis_password
                )
            client.set(model_key("lib", 0), encode(forged))
            client.delete(changes_key("lib", 0))  # else they no longer follow the "weights"
            client.xadd(globals_stream_key("lib"), {FIELD: encode(forged)})
            client.close()
            assert sync.comm is not None
            if keyed:
                rejected = sync.globals_rejected
                stats = sync.stats
                wait_until(lambda: stats.rejected["bad_signature"] >= 1, 10, what="the refusal")
                version_then = syncer.states[0].version
                for _ in range(24):
                    one_step()
                assert sync.fragments.base_version[0] <= syncer.states[0].version
                wait_until(lambda: syncer.states[0].version > version_then, 20)
                assert not rejected and not syncer.metrics.rejected
                return
            arrived = sync.comm._arrived
            wait_until(lambda: 0 in arrived and arrived[0][1][1] == 2**62, 10, what="the forgery")
            one_step()
            assert sync.fragments.base_version[0] == 2**62  # taken: it is well-formed
            version_then = syncer.states[0].version

            def recovered() -> bool:
                one_step()
                real = sync.fragments.base_version[0] <= syncer.states[0].version
                return real and syncer.states[0].version > version_then

            wait_until(recovered, 60, interval_s=0, what="the learner to count again")
        assert sync.stats.refused["future_version"] >= 1
        assert syncer.metrics.rejected["future_version"] >= 1


@pytest.mark.timeout(120)
def test_a_blown_up_fragment_never_reaches_the_syncer_or_stays(tmp_path: Path) -> None:
    """Training that made a fragment's weights NaN (a bad batch, an overflow):
    the learner sends nothing of it, puts it back on the last good global it
    took, drops the optimizer's state of its parameters, counts it, and trains
    on; the syncer sees no refused or non-finite delta."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with running_syncer(tmp_path, model, learners=1, quorum=1) as (syncer, url):
        with DecoupledDiLoCo(
            model, url, learner_id="nan", learners=1, optimizer=opt, **SETTINGS
        ) as sync:
            train(sync, model, steps=8, seed=0, opt=opt)
            poisoned = model.embed.weight
            p = next(i for i in range(2) if "embed.weight" in
                     {s.name for s in sync.plan.fragment_specs(i)})  # fmt: skip
            good = sync.fragments.base[p].clone()
            with torch.no_grad():
                poisoned[0, 0] = float("nan")
            assert opt.state[poisoned]  # Adam's moments of the poisoned tensor
            while p not in sync.plan.fragments_due(sync.step_count + 1):
                sync.step(weight=1)
            sent_before = sync.seq
            sync.step(weight=1)  # the fragment's send: refused by the learner itself
            assert sync.non_finite_restored == 1 and poisoned not in opt.state
            assert torch.isfinite(poisoned).all()
            assert torch.equal(sync.plan.flatten(sync.params, p), sync.fragments.base[p])
            assert sync.fragments.base_version[p] >= 0 and good.numel() > 0
            assert sync.seq == sent_before  # nothing of it left for the syncer
            train(sync, model, steps=8, seed=1, opt=opt)
        assert sync.delivered and not syncer.metrics.rejected
        assert all(torch.isfinite(s.weights).all() for s in syncer.states.values())
