"""A real Docker engine for the container tests: the image they run, built once
per session, and the commands they drive (docker-compose, docker, ddiloco).

Where no container registry answers (``python:3.11-slim`` cannot be pulled) the
base and Redis images come from Debian packages (``compose/offline-images.sh``)
unless ``DDILOCO_BASE_IMAGE`` / ``DDILOCO_REDIS_IMAGE`` name images already
built. A torch wheel from pip's find-links and this host's CA bundle go into
the build context for the build's duration. Everything the session made
(images, the build's intermediate images, files in the build context) is
removed at its end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from compose.reporter import read_jsonl

REPO = Path(__file__).resolve().parents[1]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def missing(reason: str) -> NoReturn:
    """Skip where the engine is missing, except where it must be there
    (``DDILOCO_REQUIRE_DOCKER=1``, as ``.ci/run`` sets): fail there."""
    if os.environ.get("DDILOCO_REQUIRE_DOCKER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def docker_client() -> Any:
    """The engine's client, or a skip where there is none (CI installs one)."""
    try:
        import docker

        client = docker.from_env(timeout=900)
        client.ping()
        return client
    except Exception as e:  # docker raises several unrelated types when absent
        missing(f"no Docker engine answers: {e}")


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode == 0:
        return ["docker", "compose"]
    missing("neither docker-compose nor docker compose is installed")


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run a command to completion; its stdout, or an AssertionError with its output."""
    proc = subprocess.run(
        args,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        errors="replace",  # redis-cli prints stream entries, whose frames are binary
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def ddiloco(*args: str, timeout: float = 300) -> str:
    return run([sys.executable, "-m", "compose.cli", *args], timeout=timeout)


def _local_torch_wheel() -> Path | None:
    """A torch CPU wheel in one of pip's find-links folders, if this host has one."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            for folder in value.strip("'\" ").split():
                wheels = sorted(Path(folder).glob("torch-2.13.0*.whl"))
                if wheels:
                    return wheels[0]
    return None


def _pullable(client: Any, image: str) -> bool:
    try:
        client.images.pull(image)
        return True
    except Exception:
        return False


@dataclass
class ClusterImages:
    """The images a test cluster runs, and what building them took."""

    app: str
    redis: str
    seconds: dict[str, float] = field(default_factory=dict)


def build_images(client: Any, timings: dict[str, float]) -> Iterator[ClusterImages]:
    """Build (and finally remove) the cluster's images; see the module docstring."""
    tag = uuid.uuid4().hex[:8]
    before = {i.id for i in client.images.list(all=True)}
    made_files: list[Path] = []
    base = os.environ.get("DDILOCO_BASE_IMAGE")
    redis = os.environ.get("DDILOCO_REDIS_IMAGE")
    if not base and not _pullable(client, "python:3.11-slim"):
        base, redis = f"ddiloco-test-base:{tag}", f"ddiloco-test-redis:{tag}"
        started = time.monotonic()
        run(["bash", str(COMPOSE_DIR / "offline-images.sh"), "--base", base, "--redis", redis])
        timings["base_image_s"] = round(time.monotonic() - started, 1)
    if not redis:
        redis = "redis:7"
    if not list((COMPOSE_DIR / "wheels").glob("torch-*.whl")):
        wheel = _local_torch_wheel()
        if wheel is not None:
            made_files.append(COMPOSE_DIR / "wheels" / wheel.name)
            shutil.copy(wheel, made_files[-1])
    if not (COMPOSE_DIR / "certs" / "ca.crt").exists() and CA_BUNDLE.exists():
        made_files.append(COMPOSE_DIR / "certs" / "ca.crt")
        shutil.copy(CA_BUNDLE, made_files[-1])
    app = f"ddiloco-test:{tag}"
    env = {"DDILOCO_IMAGE": app}
    if base:
        env["DDILOCO_BASE_IMAGE"] = base
    try:
        started = time.monotonic()
        run(
            [*compose_command(), "-p", f"ddbuild{tag}", "-f", str(COMPOSE_FILE), "build", "syncer"],
            env=env,
            timeout=1800,
        )
        timings["image_build_s"] = round(time.monotonic() - started, 1)
        yield ClusterImages(app, redis, timings)
    finally:
        for path in made_files:
            path.unlink(missing_ok=True)
        made = [i for i in client.images.list(all=True) if i.id not in before]
        for image in made:  # the app, its intermediate images, the offline base
            with contextlib.suppress(Exception):  # gone with an image removed before it
                client.images.remove(image.id, force=True)


def learner_events(run_dir: Path) -> list[dict[str, Any]]:
    events = [e for p in sorted((run_dir / "learners").glob("*.jsonl")) for e in read_jsonl(p)]
    return sorted(events, key=lambda e: e["t"])
