"""One exception tree (broker/errors.py): every exception class the project
defines is a DdilocoError, ZeroMQ's errors become TransportError at the seam,
and the command line turns what a user can fix into one line and exit code 2."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from broker.connect import connect_learner, connect_syncer
from broker.errors import ConfigError, DdilocoError, TransportError
from broker.fragments import FragmentPlan, ParamSpec
from broker.run.initial_model import write_initial_model
from broker.transport import SyncerTransport
from compose import cli
from tests.servers import run_keys

PACKAGES = ("broker", "learner", "syncer", "compose")


def _exception_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        path = [str(Path(__file__).resolve().parents[1] / package)]
        for info in pkgutil.walk_packages(path, prefix=f"{package}."):
            module = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[name] for name in sorted(found)]


def test_the_walk_finds_the_known_classes() -> None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in _exception_classes()}
    # The tree itself: the walk does look, into every folder.
    assert {"broker.errors.DdilocoError", "broker.errors.TrustError"} <= names


@pytest.mark.parametrize(
    "cls",
    _exception_classes(),
    ids=lambda c: f"{c.__module__}.{c.__qualname__}",
)
def test_every_exception_class_is_a_ddiloco_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, DdilocoError), f"{cls.__module__}.{cls.__qualname__}"


def test_the_old_homes_still_name_the_same_classes() -> None:
    from broker import errors, transport
    from broker.wire import codecs
    from broker.wire import messages as wire

    assert transport.TransportError is errors.TransportError
    assert transport.Backpressure is errors.Backpressure
    assert wire.WireError is errors.WireError
    assert codecs.CodecError is errors.CodecError
    # Bad values stay ValueErrors, as Python's own parsers raise.
    assert issubclass(ConfigError, ValueError)
    assert issubclass(errors.WireError, ValueError)
    assert issubclass(errors.CodecError, ValueError)


@pytest.fixture
def bound_port() -> Iterator[int]:
    """A loopback port that another ZeroMQ socket holds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        yield int(endpoint.rsplit(":", 1)[1])
    finally:
        ctx.destroy(linger=0)


def test_connect_on_a_port_in_use_is_a_transport_error(bound_port: int) -> None:
    url = f"zmq://127.0.0.1:{bound_port}"
    with pytest.raises(TransportError, match=f"127.0.0.1:{bound_port}") as e:
        connect_syncer(
            url, run_id="errors", syncer_id="syncer-0", fragments=[0], identity_hold_s=15.0
        )
    assert not isinstance(e.value, zmq.ZMQError)
    assert isinstance(e.value.__cause__, zmq.ZMQError)  # kept for a traceback
    # The half-built transport's context is destroyed at the seam: left to the
    # collector (the traceback holds it), it can hang in zmq_ctx_term.
    contexts = []
    tb = e.value.__cause__.__traceback__
    while tb is not None:
        half_built = tb.tb_frame.f_locals.get("self")
        if isinstance(half_built, SyncerTransport):
            contexts += [v for v in vars(half_built).values() if isinstance(v, zmq.Context)]
        tb = tb.tb_next
    assert contexts and all(ctx.closed for ctx in contexts)


def test_a_bad_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        connect_learner(
            "zmq://127.0.0.1:1?no_such_option=1",
            run_id="errors",
            learner_id="learner-0",
            incarnation=1,
            num_fragments=1,
        )


def _run_cli(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    """``ddiloco ARGV`` in this process: (exit code, its stderr lines)."""
    for key in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(key)
    # No root handler of its own on pytest's captured stream.
    monkeypatch.setattr(cli, "_setup_logging", lambda level: None)
    code = cli.main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_cli_bad_value_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_cli(["syncer", "--quorum", "-1"], monkeypatch, capsys)
    assert code == 2
    assert err == ["ddiloco syncer: quorum=-1: must be >= 0"], err


def test_cli_port_in_use_is_one_line(
    bound_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    initial = tmp_path / "initial.safetensors"
    plan = FragmentPlan.build([ParamSpec("w", (4,), "float32")], num_fragments=1, sync_every=2)
    write_initial_model(initial, plan, {"w": torch.zeros(4)})
    argv = [
        "syncer",
        f"--url=zmq://127.0.0.1:{bound_port}",
        "--fragments=1",
        "--sync-every=2",
        "--overlap=1",
        f"--initial-model={initial}",
        f"--checkpoint-dir={tmp_path / 'checkpoint'}",
    ]
    code, err = _run_cli([*argv, f"--keys={run_keys()}"], monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"ddiloco syncer: syncer transport on zmq://127.0.0.1:{bound_port}")
    # Without the run's keys, the syncer names what is missing and how to make it.
    code, err = _run_cli([*argv, f"--keys={tmp_path / 'nokeys'}"], monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"no run key folder at {tmp_path / 'nokeys'}" in err[0]
    assert "ddiloco keys --keys" in err[0] and "--insecure" in err[0]
