"""The code's shape: tools that handle no tensors never load torch, no import
cycle ties the project's modules, folders or packages together, and broker/'s
modules and the classes of broker/, learner/ and syncer/ stay small enough to
read (one job each)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "what, code",
    [
        (
            "ddiloco keys --help",
            "from compose.cli import main\ntry:\n    main(['keys', '--help'])\n"
            "except SystemExit:\n    pass",
        ),
        (
            "ddiloco --help",
            "from compose.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass",
        ),  # fmt: skip
        ("the ZAP handler", "import broker.zmq.auth"),
        ("the Redis ACL users", "import broker.redis.access"),
        ("a run's key folder", "import broker.run.key_folder"),
    ],
)
def test_what_needs_no_tensors_loads_no_torch(what: str, code: str) -> None:
    loaded = loaded_after(code)
    assert "broker" in loaded or "compose" in loaded, f"{what}: the probe ran nothing"
    assert "torch" not in loaded, f"{what} loads torch"


def test_the_services_do_load_torch() -> None:
    """The probe can see torch: a learner's config holds codecs, which need it."""
    assert "torch" in loaded_after("import learner.config")


def test_no_import_cycle_between_modules_folders_or_packages() -> None:
    result = subprocess.run(
        [sys.executable, ".ci/import_graph.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


MAX_BROKER_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def test_broker_modules_and_the_services_classes_stay_small() -> None:
    too_long = []
    for folder in ("broker", "learner", "syncer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(ROOT)
            if folder == "broker" and len(text.splitlines()) > MAX_BROKER_MODULE_LINES:
                too_long.append(f"{name}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                    too_long.append(f"{name}: class {node.name}, {size} lines")
    assert not too_long, too_long


def _docker_pattern(pattern: str) -> str:
    """A .dockerignore pattern as a regular expression: ``*`` within a name, a
    folder's name for all it holds."""
    return re.escape(pattern).replace(r"\*", "[^/]*") + "(?:/.*)?"


def test_the_image_holds_every_module_of_the_services() -> None:
    """compose/Dockerfile copies broker/, learner/ and syncer/ whole, and
    .dockerignore lets every module of theirs through: a folder left out of
    the image stops every container at its first import."""
    allowed = [
        line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"
    ]
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    for package in ("broker", "learner", "syncer"):
        assert f"COPY {package} /src/{package}/" in dockerfile
        for module in sorted((ROOT / package).rglob("*.py")):
            path = module.relative_to(ROOT).as_posix()
            assert any(re.fullmatch(_docker_pattern(p), path) for p in allowed), path
