"""benchmarks.scale: its synthetic deltas against a trained model's, and its
smoke run end to end (two real ZeroMQ syncer shards, four synthetic learners),
and a run that kills one of the two shards."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import scale
from broker.run.settings import RunSettings
from learner.data import BatchSampler, load_corpus
from learner.model import GPT, ModelConfig


def test_synthetic_deltas_compress_within_ten_percent_of_a_trained_models() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig()
    model = GPT(cfg)
    corpus = load_corpus(None, cfg.vocab_size, cfg.seq_len)
    batches = BatchSampler(corpus.train, cfg.seq_len, 16, 0, 1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def weights() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

    # One H of steps past the first (Adam's moments warmed up), as a learner sends it.
    for step in range(2 * scale.ADAM_STEPS):
        if step == scale.ADAM_STEPS:
            before = weights()
        loss = model(*batches.next())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    real = before - weights()
    codec = RunSettings().delta_codec
    real_size = len(codec.encode(real))
    synthetic_size = len(scale.synthetic_delta(real.numel(), codec, seed=1))
    assert synthetic_size == pytest.approx(real_size, rel=0.10)
    plain_gaussian = len(codec.encode(torch.randn(real.numel())))
    assert plain_gaussian < 0.9 * real_size  # why the synthetic deltas are Adam's


def test_percentile_is_the_nearest_rank_at_or_above() -> None:
    assert scale._percentile([], 0.99) is None
    assert scale._percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    values = [float(i) for i in range(1, 101)]
    assert scale._percentile(values, 0.99) == 99.0
    assert scale._percentile(values, 1.0) == 100.0


def check_run(run: dict, load: scale.Load) -> None:
    """What every run must show: nothing lost, every delta accounted for."""
    assert run["load"]["shards"] == load.shards and run["load"]["transport"] == load.transport
    assert run["lost_deltas"] == 0
    assert all(r["delivered"] for r in run["learners"]) and len(run["learners"]) == load.learners
    if load.transport == "zmq" and not load.kill_shard_at_s:
        # Acked once durable, one delta per learner a round: each in one round.
        assert run["deltas_applied"] == run["deltas_sent"]
    else:
        # A round counts one term per learner, and a restarted shard's rounds
        # fold the resent deltas of one learner into one; over Redis, deltas
        # are delivered once in Redis and the shards may hold some unread.
        assert 0 < run["deltas_applied"] <= run["deltas_sent"]
    assert run["round_latency_p99_s"] is not None and run["round_latency_p99_s"] > 0
    assert len(run["syncer_peak_rss_bytes"]) == load.shards and run["syncer_bytes_per_param"] > 0
    assert run["checkpoint_mb_per_s"] > 0
    assert 0 < run["delta_bytes_per_param"] < 1


def check_kill(run: dict) -> None:
    """A killed shard stops only its own rounds: the other's go on through its
    outage, and it comes back from its checkpoint."""
    kill = run["shard_kill"]
    assert kill["outage_s"] is not None  # shard 0 closed rounds after its restart
    assert kill["rounds_in_outage_by_shard"][1] > 0, kill
    refused = run["rejected_by_reason"]
    assert all(set(r) <= {"duplicate"} for r in refused), refused  # resent, never lost


@pytest.mark.timeout(300)
def test_smoke_two_zeromq_shards_lose_nothing(tmp_path: Path) -> None:
    assert scale.main(["--smoke", "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "scale-smoke.json").read_text())["runs"]
    check_run(run, scale.MODES["smoke"][0])
    assert run["rounds"] >= scale.MIN_ROUNDS and run["shard_kill"] is None
    memory = json.loads((tmp_path / "scale-smoke.json").read_text())["shard_memory"]
    assert memory["refused_deltas"] == 0
    # 12 bytes (master, momentum, current version), a few packed rows and
    # changes, and the allocator's fixed costs at this small size (13.5 here at
    # 40M; 38 before the kept versions were compact and the rows shared).
    assert 12 <= memory["held_bytes_per_param"] < 17
    overhead = json.loads((tmp_path / "scale-smoke.json").read_text())["learner_overhead"]
    assert overhead["params"] >= 9_000_000 and overhead["overhead_bytes_per_param"] > 0


@pytest.mark.timeout(300)
def test_a_killed_zeromq_shard_stops_only_its_own_rounds(tmp_path: Path) -> None:
    load = replace(scale.MODES["smoke"][0], kill_shard_at_s=5.0)
    run = scale.measure(load, tmp_path)
    check_run(run, load)
    check_kill(run)
