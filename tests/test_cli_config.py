"""Config dataclasses from flags and DDILOCO_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from compose.cli_config import add_dataclass_args, dataclass_from_args
from learner.config import LearnerConfig
from learner.model import ModelConfig
from syncer.config import SyncerConfig


def parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, cls)
    return dataclass_from_args(cls, parser.parse_args(argv))


@pytest.fixture(autouse=True)
def no_ddiloco_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the shell running the tests exports must not leak into them."""
    for name in list(os.environ):
        if name.startswith("DDILOCO_"):
            monkeypatch.delenv(name)


def test_no_flags_give_the_defaults() -> None:
    assert parse(LearnerConfig, []) == LearnerConfig()
    assert parse(SyncerConfig, []) == SyncerConfig()


def test_every_field_has_a_flag() -> None:
    for cls in (LearnerConfig, SyncerConfig):
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls)
        flags = set(parser._option_string_actions)
        for f in dataclasses.fields(cls):
            if f.name == "model":
                for m in dataclasses.fields(ModelConfig):
                    assert "--model-" + m.name.replace("_", "-") in flags
            else:
                assert "--" + f.name.replace("_", "-") in flags, f.name


def test_learner_flags() -> None:
    cfg = parse(LearnerConfig, [
        "--learner-id", "learner-7", "--transport", "redis", "--batch-size", "8",
        "--lr", "0.01", "--zmq-endpoints", "tcp://a:1,tcp://b:2", "--error-feedback", "false",
        "--blocking", "YES", "--data", "none", "--metrics-file", "out/m.jsonl",
        "--fragments", "3", "--sync-every", "9", "--codec", "int4+zstd",
        "--model-d-model", "64", "--model-n-head", "2", "--model-seq-len", "32",
    ])
    assert cfg == LearnerConfig(
        learner_id="learner-7", transport="redis", batch_size=8, lr=0.01,
        zmq_endpoints=("tcp://a:1", "tcp://b:2"), error_feedback=False, blocking=True,
        data=None, metrics_file="out/m.jsonl", fragments=3, sync_every=9, codec="int4+zstd",
        model=ModelConfig(d_model=64, n_head=2, seq_len=32),
    )
    assert isinstance(cfg, LearnerConfig)
    assert type(cfg.batch_size) is int and type(cfg.lr) is float


def test_syncer_flags() -> None:
    cfg = parse(SyncerConfig, [
        "--owned-fragments", "0,2", "--quorum", "3", "--grace-gamma", "0.25",
        "--aggregation", "radial", "--outer-momentum", "0", "--staleness", "1",
        "--model-n-layer", "2",
    ])
    assert cfg == SyncerConfig(owned_fragments=(0, 2), quorum=3, grace_gamma=0.25,
                               aggregation="radial", outer_momentum=0.0, staleness=1,
                               model=ModelConfig(n_layer=2))


@pytest.mark.parametrize(("text", "expected"), [
    ("none", None), ("None", None), ("", None), ("1", (1,)), ("0,3", (0, 3)),
    ("0,3,", (0, 3)), ("3,1,2", (3, 1, 2)),
])
def test_owned_fragments(text: str, expected: tuple[int, ...] | None) -> None:
    cfg = parse(SyncerConfig, ["--owned-fragments", text])
    assert isinstance(cfg, SyncerConfig) and cfg.owned_fragments == expected


@pytest.mark.parametrize(("text", "value"), [
    ("1", True), ("true", True), ("On", True), ("yes", True),
    ("0", False), ("FALSE", False), ("off", False), ("no", False),
])
def test_bools(text: str, value: bool) -> None:
    cfg = parse(LearnerConfig, ["--blocking", text])
    assert isinstance(cfg, LearnerConfig) and cfg.blocking is value


def test_env_vars_are_defaults_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_QUORUM", "2")
    monkeypatch.setenv("DDILOCO_OWNED_FRAGMENTS", "1,3")
    monkeypatch.setenv("DDILOCO_AGGREGATION", "radial")
    monkeypatch.setenv("DDILOCO_MODEL_D_MODEL", "96")
    monkeypatch.setenv("DDILOCO_METRICS_FILE", "none")
    from_env = parse(SyncerConfig, [])
    assert from_env == SyncerConfig(quorum=2, owned_fragments=(1, 3), aggregation="radial",
                                    model=ModelConfig(d_model=96))
    flags_win = parse(SyncerConfig, ["--quorum", "4", "--owned-fragments", "none",
                                     "--model-d-model", "32"])
    assert flags_win == SyncerConfig(quorum=4, owned_fragments=None, aggregation="radial",
                                     model=ModelConfig(d_model=32))


def test_env_var_for_learner_bool_and_tuple(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_ERROR_FEEDBACK", "false")
    monkeypatch.setenv("DDILOCO_ZMQ_ENDPOINTS", "tcp://syncer-0:5555,tcp://syncer-1:5555")
    cfg = parse(LearnerConfig, [])
    assert isinstance(cfg, LearnerConfig)
    assert cfg.error_feedback is False
    assert cfg.zmq_endpoints == ("tcp://syncer-0:5555", "tcp://syncer-1:5555")


@pytest.mark.parametrize(("cls", "argv", "kwargs"), [
    (SyncerConfig, ["--quorum", "0"], {"quorum": 0}),
    (SyncerConfig, ["--owned-fragments", "0,9"], {"owned_fragments": (0, 9)}),
    (SyncerConfig, ["--aggregation", "median"], {"aggregation": "median"}),
    (LearnerConfig, ["--sync-every", "10"], {"sync_every": 10}),
    (LearnerConfig, ["--codec", "int3"], {"codec": "int3"}),
    (LearnerConfig, ["--zmq-endpoints", "udp://x:1"], {"zmq_endpoints": ("udp://x:1",)}),
])
def test_invalid_value_fails_with_the_dataclass_message(
    cls: type, argv: list[str], kwargs: dict[str, object]
) -> None:
    with pytest.raises(ValueError) as direct:
        cls(**kwargs)
    with pytest.raises(ValueError) as via_cli:
        parse(cls, argv)
    assert str(via_cli.value) == str(direct.value)


def test_invalid_model_value_fails_with_the_model_message() -> None:
    with pytest.raises(ValueError) as direct:
        ModelConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError) as via_cli:
        parse(LearnerConfig, ["--model-d-model", "100", "--model-n-head", "3"])
    assert str(via_cli.value) == str(direct.value)


def test_invalid_env_value_fails_like_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_QUORUM", "0")
    with pytest.raises(ValueError, match="quorum"):
        parse(SyncerConfig, [])


@pytest.mark.parametrize("argv", [
    ["--quorum", "two"], ["--grace-gamma", "x"], ["--owned-fragments", "0,a"],
    ["--quorum", "2.5"], ["--no-such-flag", "1"],
])
def test_unparsable_flag_is_an_argparse_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(SyncerConfig, argv)
    assert e.value.code == 2


def test_unparsable_bool_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(LearnerConfig, ["--blocking", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_help_names_the_env_var() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, SyncerConfig)
    text = parser.format_help()
    assert "DDILOCO_OWNED_FRAGMENTS" in text and "DDILOCO_MODEL_N_HEAD" in text


@pytest.mark.parametrize("text", ["", "none"])
def test_empty_list_for_a_required_tuple_fails_with_value_error(text: str) -> None:
    with pytest.raises((ValueError, SystemExit)):
        parse(LearnerConfig, ["--zmq-endpoints", text])


def test_unparsable_env_var_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_QUORUM", "two")
    with pytest.raises((ValueError, SystemExit)) as e:
        parse(SyncerConfig, [])
    assert isinstance(e.value, SystemExit) or "DDILOCO_QUORUM" in str(e.value)
