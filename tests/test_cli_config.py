"""Config dataclasses from flags and DDILOCO_* environment variables, and back."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from broker.cli_config import (
    add_dataclass_args,
    dataclass_from_args,
    dataclass_to_args,
    dataclass_values,
)
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from compose.local import LocalConfig
from learner.config import EvaluatorConfig, InitConfig, LearnerConfig
from learner.model import ModelConfig
from syncer.config import SyncerConfig
from tests.test_config import SERVICE_CONFIGS, leaves, make


def class_name(cls: type) -> str:
    return cls.__name__


def parser_for(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, cls)
    return parser


def parse(cls: type, argv: list[str]) -> Any:
    cfg = dataclass_from_args(cls, parser_for(cls).parse_args(argv))
    assert type(cfg) is cls
    return cfg


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.fixture(autouse=True)
def no_ddiloco_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the shell running the tests exports must not leak into them."""
    for name in list(os.environ):
        if name.startswith("DDILOCO_"):
            monkeypatch.delenv(name)


# -- flags --------------------------------------------------------------------
@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=class_name)
def test_no_flags_give_the_defaults(cls: type) -> None:
    assert parse(cls, []) == cls()


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=class_name)
def test_every_setting_has_a_flag(cls: type) -> None:
    flags = set(parser_for(cls)._option_string_actions) - {"-h", "--help"}
    assert flags == {flag(name) for name, _, _ in leaves(cls)}
    assert "--fragments" in flags and "--delta-codec" in flags
    if cls is not SyncerConfig:
        assert "--model-d-model" in flags


def test_learner_flags() -> None:
    cfg = parse(
        LearnerConfig,
        [
            "--learner-id",
            "learner-7",
            "--batch-size",
            "8",
            "--lr",
            "1e-5",
            "--url",
            "redis://10.0.0.5:6379/1?max_unacked=8",
            "--error-feedback",
            "false",
            "--blocking",
            "YES",
            "--data",
            "none",
            "--metrics-file",
            "out/m.jsonl",
            "--fragments",
            "3",
            "--sync-every",
            "9",
            "--delta-codec",
            "int4+zstd",
            "--model-d-model",
            "64",
            "--model-n-head",
            "2",
            "--model-seq-len",
            "32",
            "--mix-alpha",
            "0.25",
            "--learners",
            "2",
            "--quorum",
            "2",
        ],
    )
    assert cfg == make(
        LearnerConfig,
        learner_id="learner-7",
        batch_size=8,
        lr=1e-5,
        url="redis://10.0.0.5:6379/1?max_unacked=8",
        error_feedback=False,
        blocking=True,
        data=None,
        metrics_file="out/m.jsonl",
        fragments=3,
        sync_every=9,
        delta_codec=Codec.parse("int4+zstd"),
        model_d_model=64,
        model_n_head=2,
        model_seq_len=32,
        mix_alpha=0.25,
        learners=2,
        quorum=2,
    )
    assert type(cfg.train.batch_size) is int and type(cfg.train.lr) is float
    assert cfg.workload.model == ModelConfig(d_model=64, n_head=2, seq_len=32)
    assert cfg.run.delta_codec == Codec("int4", "zstd")


def test_syncer_flags() -> None:
    cfg = parse(
        SyncerConfig,
        [
            "--syncer-shards",
            "2",
            "--syncer-shard",
            "auto",
            "--learners",
            "5",
            "--quorum",
            "3",
            "--grace-gamma",
            "0.25",
            "--aggregation",
            "radial",
            "--outer-momentum",
            "0",
            "--staleness",
            "1",
            "--global-codec",
            "bf16+lz4",
            "--url",
            "zmq://0.0.0.0:7000",
        ],
    )
    assert cfg == make(
        SyncerConfig,
        syncer_shards=2,
        syncer_shard="auto",
        learners=5,
        quorum=3,
        grace_gamma=0.25,
        aggregation="radial",
        outer_momentum=0.0,
        staleness=1,
        global_codec=Codec.parse("bf16+lz4"),
        url="zmq://0.0.0.0:7000",
    )
    assert cfg.run.quorum == 3


RUN_ARGV = [
    "--run-id",
    "r1",
    "--url",
    "zmq://syncer-0:6000",
    "--learners",
    "3",
    "--fragments",
    "2",
    "--sync-every",
    "8",
    "--overlap",
    "3",
    "--steps",
    "40",
    "--heartbeat-timeout-s",
    "2.5",
    "--delta-codec",
    "int4@128",
    "--global-codec",
    "bf16",
    "--initial-model",
    "m.safetensors",
]


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=class_name)
def test_run_flags_mean_the_same_in_every_service(cls: type) -> None:
    expected = RunSettings(
        run_id="r1",
        url="zmq://syncer-0:6000",
        learners=3,
        fragments=2,
        sync_every=8,
        overlap=3,
        steps=40,
        heartbeat_timeout_s=2.5,
        delta_codec=Codec("int4", block_size=128),
        global_codec=Codec("bf16"),
        initial_model="m.safetensors",
    )
    assert parse(cls, RUN_ARGV).run == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        ("0,3", (0, 3)),
        ("0,3,", (0, 3)),
        ("3,0,2", (3, 0, 2)),
    ],
)
def test_tuple_flag(text: str, expected: tuple[int, ...]) -> None:
    learners = str(max(2, len(expected)))  # a step per learner
    argv = ["--learners", learners, "--join-at-step", text]
    assert parse(LocalConfig, argv).join_at_step == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", None),
        ("NONE", None),
        ("", None),
        ("corpus.txt", "corpus.txt"),
    ],
)
def test_optional_text(text: str, expected: str | None) -> None:
    assert parse(LearnerConfig, ["--data", text]).workload.data == expected
    assert parse(EvaluatorConfig, ["--metrics-file", text]).metrics_file == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("true", True),
        ("On", True),
        ("yes", True),
        ("0", False),
        ("FALSE", False),
        ("off", False),
        ("no", False),
    ],
)
def test_bools(text: str, value: bool) -> None:
    assert parse(LearnerConfig, ["--blocking", text]).sync.blocking is value  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "codec"),
    [
        ("int8", Codec("int8")),
        ("int4+zstd", Codec("int4", "zstd")),
        ("int8@128", Codec("int8", block_size=128)),
        ("bf16+lz4", Codec("bf16", "lz4")),
    ],
)
def test_codecs(text: str, codec: Codec) -> None:
    cfg = parse(SyncerConfig, ["--delta-codec", text, "--global-codec", text])
    assert cfg.run.delta_codec == codec and cfg.run.global_codec == codec


# -- environment variables -------------------------------------------------------------
def test_env_vars_are_defaults_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_FRAGMENTS", "2")
    monkeypatch.setenv("DDILOCO_MODEL_D_MODEL", "96")
    monkeypatch.setenv("DDILOCO_DELTA_CODEC", "int4+zstd")
    int4_zstd = Codec.parse("int4+zstd")
    for cls in (LearnerConfig, EvaluatorConfig, InitConfig):
        assert parse(cls, []) == make(cls, fragments=2, model_d_model=96, delta_codec=int4_zstd), (
            cls.__name__
        )
    # The syncer has no model: the model's variable is no business of it.
    assert parse(SyncerConfig, []) == make(SyncerConfig, fragments=2, delta_codec=int4_zstd)
    flags_win = parse(
        LearnerConfig, ["--fragments", "3", "--model-d-model", "32", "--delta-codec", "bf16"]
    )
    assert flags_win == make(
        LearnerConfig, fragments=3, model_d_model=32, delta_codec=Codec.parse("bf16")
    )


def test_env_vars_for_bool_tuple_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_ERROR_FEEDBACK", "false")
    monkeypatch.setenv("DDILOCO_JOIN_AT_STEP", "0,3")
    monkeypatch.setenv("DDILOCO_METRICS_FILE", "none")
    monkeypatch.setenv("DDILOCO_LR", "1e-5")
    learner = parse(LearnerConfig, [])
    assert learner == make(LearnerConfig, error_feedback=False, metrics_file=None, lr=1e-5)
    syncer = parse(SyncerConfig, [])
    assert syncer.metrics_file is None
    assert parse(LocalConfig, ["--learners", "2"]).join_at_step == (0, 3)


@pytest.mark.parametrize(
    ("cls", "env", "text"),
    [
        (LearnerConfig, "DDILOCO_FRAGMENTS", "two"),
        (LearnerConfig, "DDILOCO_FRAGMENTS", "2.5"),
        (LearnerConfig, "DDILOCO_MODEL_D_MODEL", "wide"),
        (LearnerConfig, "DDILOCO_DELTA_CODEC", "int3"),
        (SyncerConfig, "DDILOCO_GLOBAL_CODEC", "int8@7"),
        (LearnerConfig, "DDILOCO_BLOCKING", "maybe"),
        (LearnerConfig, "DDILOCO_LR", "fast"),
        (LocalConfig, "DDILOCO_JOIN_AT_STEP", "0,a"),
        (SyncerConfig, "DDILOCO_SYNCER_SHARDS", "two"),
    ],
)
def test_unparsable_env_var_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, cls: type, env: str, text: str
) -> None:
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=env):
        parse(cls, [])


@pytest.mark.parametrize(
    ("env", "text", "field"),
    [
        ("DDILOCO_QUORUM", "9", "quorum"),
        ("DDILOCO_SYNC_EVERY", "10", "sync_every"),
        ("DDILOCO_URL", "tcp://syncer:5555", "url"),
        ("DDILOCO_AGGREGATION", "median", "aggregation"),
    ],
)
def test_invalid_env_value_fails_like_a_flag(
    monkeypatch: pytest.MonkeyPatch, env: str, text: str, field: str
) -> None:
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        parse(SyncerConfig, [])


# -- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "argv", "flat"),
    [
        (SyncerConfig, ["--quorum", "9"], {"quorum": 9}),
        (SyncerConfig, ["--syncer-shards", "9"], {"syncer_shards": 9}),
        (SyncerConfig, ["--aggregation", "median"], {"aggregation": "median"}),
        (LearnerConfig, ["--sync-every", "10"], {"sync_every": 10}),
        (LearnerConfig, ["--url", "tcp://x:1"], {"url": "tcp://x:1"}),
        (LearnerConfig, ["--url", "zmq://x:1?bogus=1"], {"url": "zmq://x:1?bogus=1"}),
        (LearnerConfig, ["--mix-alpha", "1"], {"mix_alpha": 1.0}),
        (EvaluatorConfig, ["--eval-batches", "0"], {"eval_batches": 0}),
        (
            InitConfig,
            ["--model-d-model", "100", "--model-n-head", "3"],
            {"model_d_model": 100, "model_n_head": 3},
        ),
    ],
)
def test_invalid_value_fails_with_the_dataclass_message(
    cls: type, argv: list[str], flat: dict[str, Any]
) -> None:
    with pytest.raises(ValueError) as direct:
        make(cls, **flat)
    with pytest.raises(ValueError) as via_cli:
        parse(cls, argv)
    assert str(via_cli.value) == str(direct.value)


@pytest.mark.parametrize(
    ("cls", "argv"),
    [
        (SyncerConfig, ["--quorum", "two"]),
        (SyncerConfig, ["--grace-gamma", "x"]),
        (LocalConfig, ["--join-at-step", "0,a"]),
        (SyncerConfig, ["--quorum", "2.5"]),
        (SyncerConfig, ["--no-such-flag", "1"]),
        (SyncerConfig, ["--model-d-model", "64"]),  # the syncer has no model
        (LearnerConfig, ["--delta-codec", "int3"]),
        (LearnerConfig, ["--fragments"]),
    ],
)
def test_unparsable_flag_is_an_argparse_error(
    cls: type, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse(cls, argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_unparsable_values_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(LearnerConfig, ["--blocking", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(LearnerConfig, ["--delta-codec", "int3"])
    assert "int3" in capsys.readouterr().err


def test_help_names_the_env_vars() -> None:
    text = parser_for(LearnerConfig).format_help()
    for env in ("DDILOCO_FRAGMENTS", "DDILOCO_MODEL_N_HEAD", "DDILOCO_DELTA_CODEC"):
        assert env in text


# -- back to flags ------------------------------------------------------------------------
NON_DEFAULT_RUN: dict[str, Any] = dict(
    run_id="run.7",
    url="zmq://syncer-0:6000,syncer-1:6000?ack_timeout_s=0.5&max_unacked=3",
    learners=5,
    quorum=4,
    fragments=3,
    sync_every=9,
    overlap=8,
    steps=17,
    heartbeat_timeout_s=0.1 + 0.2,
    delta_codec=Codec.parse("int4+zstd@128"),
    global_codec=Codec.parse("bf16+lz4"),
    initial_model="out dir/init.safetensors",
)
NON_DEFAULT_WORKLOAD: dict[str, Any] = dict(
    model_vocab_size=97,
    model_seq_len=33,
    model_n_layer=1,
    model_n_head=3,
    model_d_model=48,
    data="corpus,with comma.txt",
    seed=-3,
)
NON_DEFAULT: list[Any] = [
    make(
        LearnerConfig,
        **NON_DEFAULT_RUN,
        **NON_DEFAULT_WORKLOAD,
        lr=1e-5,
        min_lr_ratio=0.0,
        warmup_steps=0,
        weight_decay=2.5e-7,
        grad_clip=0.0,
        batch_size=3,
        learner_id="learner-9",
        error_feedback=False,
        flush_before_overwrite=False,
        blocking=True,
        mix_alpha=1 / 3,
        finish_timeout_s=0.0,
        sync_pause_every=6,
        shard=1,
        num_shards=2,
        slowdown=1.5,
        join_timeout_s=1e-3,
        state_dir="state/l9",
        metrics_file="m.jsonl",
        torch_threads=2,
        metrics_port=9101,
        log_every=1,
        eval_every=7,
    ),
    make(
        SyncerConfig,
        **NON_DEFAULT_RUN,
        outer_lr=1e-5,
        outer_momentum=0.0,
        aggregation="radial",
        grace_gamma=0.95,
        staleness=1,
        quarantine_factor=1e5,
        syncer_id="syncer-1",
        syncer_shards=2,
        syncer_shard="1",
        checkpoint_dir="ckpt/1",
        metrics_port=9200,
        metrics_file=None,
    ),
    make(SyncerConfig, url="redis://:pw@redis:6379/2?claim_idle_s=7", syncer_shard="auto"),
    make(
        EvaluatorConfig,
        **NON_DEFAULT_RUN,
        **NON_DEFAULT_WORKLOAD,
        eval_every_s=0.0,
        eval_batches=1,
        eval_batch_size=2,
        join_timeout_s=3.5,
        metrics_file="e.jsonl",
        torch_threads=4,
    ),
    make(InitConfig, **NON_DEFAULT_RUN, **(NON_DEFAULT_WORKLOAD | {"data": None})),
    make(InitConfig, url="none"),
]


@pytest.mark.parametrize(
    "cfg",
    [cls() for cls in SERVICE_CONFIGS] + NON_DEFAULT,
    ids=[f"{c.__name__}-default" for c in SERVICE_CONFIGS]
    + [f"{type(c).__name__}-{i}" for i, c in enumerate(NON_DEFAULT)],
)
def test_to_args_rebuilds_the_config(cfg: Any) -> None:
    args = dataclass_to_args(cfg)
    assert all(isinstance(a, str) for a in args)
    flags = args[0::2]
    assert len(flags) == len(set(flags)) == len(args) // 2
    rebuilt = parse(type(cfg), args)
    assert rebuilt == cfg
    # Types survive too (== alone would take 1 for 1.0 or True).
    for name, value in dataclass_values(rebuilt).items():
        assert type(value) is type(dataclass_values(cfg)[name]), name


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=class_name)
def test_values_are_flat_and_complete(cls: type) -> None:
    cfg = cls()
    values = dataclass_values(cfg)
    assert list(values) == [name for name, _, _ in leaves(cls)]
    assert values["fragments"] == cfg.run.fragments
    assert values["delta_codec"] == cfg.run.delta_codec
    assert isinstance(values["delta_codec"], Codec)
