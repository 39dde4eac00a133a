"""Config dataclasses: defaults are valid, each bad value names its field, and
every setting is defined once (in one dataclass that the configs nest).

The tables below name settings by their flattened name (the command line's
``--name``), and the tests find the dataclass that defines each one, so a
setting that moves from one nested group to another keeps its tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from broker import checks as config_checks
from broker.connect import parse_url
from broker.run.settings import NO_BROKER, RunSettings, default_quorum
from broker.wire.codecs import Codec
from learner.config import EvaluatorConfig, InitConfig, LearnerConfig, WorkloadConfig
from learner.model import ModelConfig
from syncer.config import OuterConfig, SyncerConfig
from syncer.membership import Membership

NAN = float("nan")
SERVICE_CONFIGS: tuple[type, ...] = (LearnerConfig, SyncerConfig, EvaluatorConfig, InitConfig)
# Dataclasses that are one setting's value, not a group of settings.
VALUE_TYPES: tuple[type, ...] = (Codec,)


def is_group(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and tp not in VALUE_TYPES


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """(flattened name, dataclass that defines it, its field name there) of every
    setting of ``cls``, nested groups flattened as the command line does."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        if is_group(tp):
            yield from leaves(tp, prefix + f.metadata.get("flag_prefix", ""))
        else:
            yield prefix + f.name, cls, f.name


def groups(cls: type) -> Iterator[type]:
    """``cls`` and every dataclass nested in it."""
    yield cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if is_group(hints[f.name]):
            yield from groups(hints[f.name])


ALL_CONFIGS: tuple[type, ...] = tuple(
    dict.fromkeys(g for cls in SERVICE_CONFIGS for g in groups(cls))
)
# flattened name -> every (dataclass, field) that defines it
DEFINED_BY: dict[str, set[tuple[type, str]]] = {}
for _cls in SERVICE_CONFIGS:
    for _name, _owner, _field in leaves(_cls):
        DEFINED_BY.setdefault(_name, set()).add((_owner, _field))


def make(cls: type, **flat: Any) -> Any:
    """``cls`` with the settings given by flattened name, nested groups built too."""
    used: set[str] = set()

    def build(c: type, prefix: str) -> Any:
        hints = typing.get_type_hints(c)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(c):  # type: ignore[arg-type]
            if is_group(hints[f.name]):
                kwargs[f.name] = build(hints[f.name], prefix + f.metadata.get("flag_prefix", ""))
            elif prefix + f.name in flat:
                kwargs[f.name] = flat[prefix + f.name]
                used.add(prefix + f.name)
        return c(**kwargs)

    obj = build(cls, "")
    assert set(flat) == used, f"{cls.__name__} has no {sorted(set(flat) - used)}"
    return obj


# -- defaults and valid values ------------------------------------------------
def test_the_configs_nest_the_expected_groups() -> None:
    for cls in SERVICE_CONFIGS:
        assert RunSettings in set(groups(cls)), cls.__name__
    for cls in (LearnerConfig, EvaluatorConfig, InitConfig):
        assert {WorkloadConfig, ModelConfig} <= set(groups(cls)), cls.__name__
    assert OuterConfig in set(groups(SyncerConfig))


@pytest.mark.parametrize("cls", ALL_CONFIGS, ids=lambda c: c.__name__)
def test_defaults_valid(cls: type) -> None:
    cls()


def test_services_agree_by_default() -> None:
    runs = {cls.__name__: cls().run for cls in SERVICE_CONFIGS}
    assert all(run == RunSettings() for run in runs.values()), runs
    workloads = [cls().workload for cls in (LearnerConfig, EvaluatorConfig, InitConfig)]
    assert all(w == WorkloadConfig() for w in workloads)
    run = RunSettings()
    assert parse_url(run.url).backend == "zmq"
    assert run.sync_every % run.fragments == 0 and run.overlap < run.sync_every
    assert run.quorum == 0 and default_quorum(run.learners) == 3
    assert run.delta_codec == Codec.parse("int2+zstd")
    assert run.global_codec == Codec.parse("int2+zstd")
    assert (OuterConfig().outer_lr, OuterConfig().outer_momentum) == (0.7, 0.9)


def test_run_settings_are_frozen() -> None:
    run = RunSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.fragments = 3  # type: ignore[misc]


VALID_RUN: dict[str, Any] = dict(
    run_id="run-2.a:b_c",
    url="redis://user:pw@host:6380/1?claim_idle_s=2&socket_keepalive=true",
    learners=3,
    quorum=3,
    fragments=3,
    sync_every=9,
    overlap=8,
    steps=1,
    heartbeat_timeout_s=0.5,
    delta_codec=Codec.parse("int4+zstd@128"),
    global_codec=Codec.parse("bf16+lz4"),
    initial_model="out/init.safetensors",
)
VALID_WORKLOAD: dict[str, Any] = dict(
    model_vocab_size=64,
    model_seq_len=32,
    model_n_layer=1,
    model_n_head=2,
    model_d_model=64,
    data="corpus.txt",
    seed=7,
)


def test_valid_non_defaults() -> None:
    learner = make(
        LearnerConfig,
        **VALID_RUN,
        **VALID_WORKLOAD,
        batch_size=1,
        lr=1e-5,
        min_lr_ratio=1.0,
        warmup_steps=0,
        weight_decay=0.0,
        grad_clip=0.0,
        learner_id="learner-7",
        error_feedback=False,
        flush_before_overwrite=False,
        blocking=True,
        mix_alpha=0.5,
        finish_timeout_s=0.0,
        sync_pause_every=4,
        shard=2,
        num_shards=3,
        slowdown=2.5,
        join_timeout_s=0.5,
        state_dir="state",
        metrics_file="m.jsonl",
        torch_threads=2,
        metrics_port=9100,
        log_every=1,
        eval_every=5,
    )
    assert learner.run == RunSettings(**VALID_RUN)
    assert learner.workload.model == ModelConfig(64, 32, 1, 2, 64)
    make(
        SyncerConfig,
        url="zmq://syncer-0:5555?ack_timeout_s=2&max_batch=10",
        aggregation="radial",
        outer_lr=1.0,
        outer_momentum=0.0,
        grace_gamma=0.0,
        staleness=1,
        quarantine_factor=1.5,
        syncer_id="syncer-1",
        syncer_shards=2,
        syncer_shard="1",
        checkpoint_dir="ckpt",
        metrics_port=9200,
        metrics_file="s.jsonl",
    )
    make(
        EvaluatorConfig,
        **VALID_RUN,
        **VALID_WORKLOAD,
        eval_every_s=0.0,
        eval_batches=1,
        eval_batch_size=1,
        join_timeout_s=1.0,
        metrics_file="e.jsonl",
        torch_threads=3,
    )
    make(InitConfig, **VALID_RUN, **VALID_WORKLOAD)
    RunSettings(url="unix:///run/redis.sock?db=2", learners=1, quorum=1)
    RunSettings(url="rediss://h:6380/0?ssl_cert_reqs=none&block_ms=50")
    # Several zmq endpoints (one per syncer), and no broker at all.
    RunSettings(url="zmq://syncer-0:5555,syncer-1:5555,10.0.0.2:6000?max_unacked=3")
    RunSettings(url=NO_BROKER)


# -- bad values name their field ----------------------------------------------
BAD: list[tuple[str, Any]] = [
    # RunSettings
    ("run_id", ""),
    ("run_id", "has space"),
    ("run_id", "x" * 65),
    ("run_id", 3),
    ("url", ""),
    ("url", None),
    ("url", "http://localhost:6379"),
    ("url", "tcp://host:5555"),
    ("url", "localhost:6379"),
    ("url", "zmq://host"),
    ("url", "zmq://host:123456"),
    ("url", "zmq://host:5555/path"),
    ("url", "zmq://host:5555?no_such_option=1"),
    ("url", "zmq://host:5555?max_unacked=many"),
    ("url", "redis://host:6379/0?claim_idle_s=soon"),
    ("learners", 0),
    ("learners", -1),
    ("learners", 2.0),
    ("learners", True),
    ("quorum", -1),
    ("quorum", 1.5),
    ("quorum", 5),  # > learners=4
    ("fragments", 0),
    ("fragments", 2.0),
    ("sync_every", 0),
    ("sync_every", -24),
    ("sync_every", 10),  # not a multiple of fragments=4
    ("sync_every", "12"),
    ("overlap", -1),
    ("overlap", 12),  # not < sync_every=12
    ("overlap", 1.5),
    ("steps", 0),
    ("steps", "300"),
    ("heartbeat_timeout_s", 0.0),
    ("heartbeat_timeout_s", -1.0),
    ("heartbeat_timeout_s", NAN),
    ("heartbeat_timeout_s", "5"),
    ("delta_codec", "int8"),  # text, not a Codec
    ("delta_codec", None),
    ("global_codec", "fp32"),
    ("initial_model", ""),
    # the model
    ("model_vocab_size", 0),
    ("model_seq_len", 0),
    ("model_n_layer", 0),
    ("model_n_head", 0),
    ("model_d_model", -1),
    # the workload
    ("seed", 1.5),
    ("seed", "0"),
    # the inner optimizer
    ("batch_size", 0),
    ("batch_size", -4),
    ("batch_size", 2.5),
    ("lr", 0.0),
    ("lr", -1e-3),
    ("lr", NAN),
    ("lr", "3e-3"),
    ("warmup_steps", -1),
    ("weight_decay", -0.1),
    ("weight_decay", NAN),
    ("grad_clip", -1.0),
    ("min_lr_ratio", -0.1),
    ("min_lr_ratio", 1.5),
    ("min_lr_ratio", NAN),
    # evaluation
    ("eval_every_s", -1.0),
    ("eval_every_s", NAN),
    ("eval_batches", 0),
    ("eval_batches", 2.0),
    ("eval_batch_size", 0),
    # the learner
    ("learner_id", ""),
    ("learner_id", "a/b"),
    ("learner_id", 3),
    ("torch_threads", 0),  # learner and evaluator
    ("torch_threads", 1.5),
    ("join_timeout_s", 0),  # learner and evaluator
    ("join_timeout_s", NAN),
    ("log_every", 0),
    ("metrics_port", -1),  # learner and syncer
    ("eval_every", -1),
    ("sync_pause_every", -1),
    ("shard", -1),
    ("shard", 1),  # not < num_shards=1
    ("finish_timeout_s", -1.0),
    ("finish_timeout_s", NAN),
    ("mix_alpha", 1.0),
    ("mix_alpha", -0.5),
    ("mix_alpha", NAN),
    ("slowdown", 0.5),
    ("slowdown", NAN),
    # the syncer
    ("aggregation", "median"),
    ("outer_lr", 0.0),
    ("outer_lr", -0.7),
    ("outer_lr", NAN),
    ("outer_lr", "0.7"),
    ("outer_momentum", 1.0),
    ("outer_momentum", -0.1),
    ("outer_momentum", NAN),
    ("grace_gamma", 1.0),
    ("grace_gamma", -0.1),
    ("grace_gamma", NAN),
    ("staleness", 0),
    ("staleness", 1.5),
    ("quarantine_factor", 1.0),
    ("quarantine_factor", NAN),
    ("syncer_id", "no spaces"),
    ("syncer_id", ""),
    ("syncer_shards", 0),
    ("syncer_shards", 5),  # fragments=4
    ("syncer_shard", "1"),  # syncer_shards=1
    ("syncer_shard", "-1"),
    ("syncer_shard", "first"),
]
# One case per (defining dataclass, bad value): a name that two services define
# each for itself is checked in both.
BAD_CASES = [
    (owner, field, value)
    for name, value in BAD
    for owner, field in sorted(DEFINED_BY[name], key=lambda d: d[0].__name__)
]


def test_every_bad_value_names_a_setting() -> None:
    assert [name for name, _ in BAD if name not in DEFINED_BY] == []


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    BAD_CASES,
    ids=[f"{c.__name__}-{f}-{v!r}"[:60] for c, f, v in BAD_CASES],
)
def test_bad_value_names_field(cls: type, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        cls(**{field: value})


def test_every_config_has_bad_values_in_the_table() -> None:
    covered = {cls for cls, _, _ in BAD_CASES}
    # InitConfig and EvaluatorConfig have no setting of their own: only nested groups.
    uncovered = [c.__name__ for c in ALL_CONFIGS if c not in covered]
    assert uncovered == ["EvaluatorConfig", "InitConfig"]


def test_cross_field_checks() -> None:
    with pytest.raises(ValueError, match=r"sync_every=10 .*fragments=4"):
        RunSettings(fragments=4, sync_every=10)
    RunSettings(fragments=5, sync_every=10)
    with pytest.raises(ValueError, match=r"overlap=24 .*sync_every=24"):
        RunSettings(sync_every=24, overlap=24)
    RunSettings(sync_every=24, overlap=23)
    with pytest.raises(ValueError, match=r"quorum=5.*learners=4"):
        RunSettings(learners=4, quorum=5)
    RunSettings(learners=4, quorum=4)
    RunSettings(learners=1, quorum=1)
    with pytest.raises(ValueError, match=r"quorum=2.*learners=1"):
        RunSettings(learners=1, quorum=2)
    with pytest.raises(ValueError, match=r"shard=3 .*num_shards=3"):
        make(LearnerConfig, shard=3, num_shards=3)
    make(LearnerConfig, shard=2, num_shards=3)
    # A syncer's shards are checked against the run's fragments.
    make(SyncerConfig, fragments=2, sync_every=6, syncer_shards=2, syncer_shard="auto")
    with pytest.raises(ValueError, match=r"syncer_shards=3: at most fragments=2"):
        make(SyncerConfig, fragments=2, sync_every=6, syncer_shards=3)
    with pytest.raises(ValueError, match=r"syncer_shard='2': use auto or an index in \[0, 2\)"):
        make(SyncerConfig, fragments=2, sync_every=6, syncer_shards=2, syncer_shard="2")


def test_model_head_divisibility() -> None:
    with pytest.raises(ValueError, match=r"d_model \(130\).*n_head \(4\)"):
        ModelConfig(d_model=130, n_head=4)


@pytest.mark.parametrize("spec", ["int3", "int8@7", "fp64", "int4+gzip", "int8@abc"])
def test_bad_codec_spec_is_a_value_error(spec: str) -> None:
    with pytest.raises(ValueError):
        Codec.parse(spec)


# -- quorum ---------------------------------------------------------------------
@pytest.mark.parametrize(("learners", "expected"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 4)])
def test_default_quorum(learners: int, expected: int) -> None:
    assert default_quorum(learners) == expected


@pytest.mark.parametrize("learners", [1, 2, 3, 4, 5])
def test_the_membership_owns_k(learners: int) -> None:
    """K is resolved in one place, the syncer's Membership: the quorum given,
    else the default of M."""
    members = Membership(RunSettings(learners=learners), learners, 0.0, ())
    assert members.quorum() == default_quorum(learners)
    for k in range(1, learners + 1):
        assert Membership(RunSettings(learners=learners, quorum=k), learners, 0.0, ()).quorum() == k


# -- one definition per setting -----------------------------------------------
@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_flattened_names_are_unique(cls: type) -> None:
    counts = Counter(name for name, _, _ in leaves(cls))
    assert [name for name, n in counts.items() if n > 1] == []
    # The run's settings are all there, under their own names.
    assert {f.name for f in dataclasses.fields(RunSettings)} <= set(counts)


# Names that two services define each for itself. Each is a second definition of
# a setting; keep this list short, and move a setting into a shared dataclass
# rather than add it here. The test below fails when an entry is no longer
# defined twice, so the list cannot go stale.
PER_SERVICE = {
    "metrics_file": "each service writes its own JSON lines",
    "metrics_port": "each service serves its own Prometheus endpoint",
}


def test_shared_names_come_from_one_dataclass() -> None:
    """A name that two service configs share is one setting: both get it from the
    same field of the same nested dataclass (RunSettings, WorkloadConfig, ...),
    so it has one default, one check and one flag."""
    defined = {cls: {name: (owner, f) for name, owner, f in leaves(cls)} for cls in SERVICE_CONFIGS}
    twice: set[str] = set()
    for a, b in itertools.combinations(SERVICE_CONFIGS, 2):
        for name in sorted(defined[a].keys() & defined[b].keys()):
            (owner_a, field_a), (owner_b, field_b) = defined[a][name], defined[b][name]
            if (owner_a, field_a) != (owner_b, field_b) and name in PER_SERVICE:
                twice.add(name)
                continue
            assert (owner_a, field_a) == (owner_b, field_b), (
                f"--{name}: {a.__name__} has {owner_a.__name__}.{field_a}, "
                f"{b.__name__} has {owner_b.__name__}.{field_b}"
            )
            assert owner_a not in SERVICE_CONFIGS
    assert twice == set(PER_SERVICE)


def test_run_settings_are_shared_by_every_service() -> None:
    for cls in SERVICE_CONFIGS:
        owners = {name: owner for name, owner, _ in leaves(cls)}
        for f in dataclasses.fields(RunSettings):
            assert owners[f.name] is RunSettings, (cls.__name__, f.name)


# -- validators ---------------------------------------------------------------------
def test_check_helpers_directly() -> None:
    config_checks.check_positive("x", 1)
    config_checks.check_positive("x", 0, allow_zero=True)
    for bad, allow_zero in ((0, False), (-1, True), (NAN, True), (True, False), ("1", True)):
        with pytest.raises(ValueError, match="^x="):
            config_checks.check_positive("x", bad, allow_zero=allow_zero)  # type: ignore[arg-type]
    config_checks.check_id("i", "A-z_0.9:x")
    for bad_id in ("", "a b", "a/b", "x" * 65, None):
        with pytest.raises(ValueError, match="^i="):
            config_checks.check_id("i", bad_id)  # type: ignore[arg-type]
    config_checks.check_choice("c", "a", ("a", "b"))
    with pytest.raises(ValueError, match="^c="):
        config_checks.check_choice("c", "z", ("a", "b"))


def test_data_parallel_takes_learner_chaos_but_has_no_syncer_to_kill() -> None:
    from compose.local import LocalConfig

    LocalConfig(mode="ddp", chaos_mtbf_s=15, kill_learner_at_s=4)  # elastic restarts
    with pytest.raises(ValueError, match=r"mode=ddp has no syncer.*--kill-syncer-at-s"):
        LocalConfig(mode="ddp", kill_syncer_at_s=5)


def test_local_runs_one_syncer_and_says_where_shards_run() -> None:
    from compose.local import LocalConfig

    with pytest.raises(ValueError, match=r"syncer_shards=2: `ddiloco local` runs one syncer"):
        LocalConfig(run=RunSettings(syncer_shards=2))


def test_newcomers_join_a_decoupled_run_only_and_one_learner_starts_at_once() -> None:
    from broker.run.settings import RunSettings
    from compose.local import LocalConfig

    run = RunSettings(learners=4)
    LocalConfig(run=run, join_at_step=(0, 0, 100, 100))
    with pytest.raises(ValueError, match="give 4 steps >= 0"):
        LocalConfig(run=run, join_at_step=(0, 100))
    with pytest.raises(ValueError, match="one learner must start at 0"):
        LocalConfig(run=run, join_at_step=(5, 5, 5, 5))
    with pytest.raises(ValueError, match="mode=diloco cannot add learners mid-run"):
        LocalConfig(run=run, mode="diloco", join_at_step=(0, 0, 100, 100))
    LocalConfig(run=run, mode="ddp", join_at_step=(0, 0, 0, 0))  # nobody late: fine
