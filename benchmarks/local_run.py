"""One ``ddiloco local`` run of a benchmark, kept so that a rerun resumes.

A finished run leaves its result beside its folder (``NAME.json`` next to
``NAME/``) together with every setting the run resolved to: the given flags
and the defaults of this version. A rerun takes the stored result only if a
run now would have the same settings, so a changed default reruns the
systems it touches and keeps the others (a pinned reference spells out what
it pins).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.cli_config import (
    add_dataclass_args,
    dataclass_from_args,
    dataclass_values,
    flag_text,
)
from compose.local import LocalConfig

# Not settings of what a run computes: where it writes, how it shows progress,
# and its keys and metrics port (they authenticate and encrypt, or bind).
_NOT_SETTINGS = ("out", "no_progress", "keys", "insecure", "metrics_host")
# The run settings only DiLoCo's modes read (data parallel has no syncer, fragments
# or codecs), so that changing one of them does not rerun data parallel.
_DILOCO_RUN_SETTINGS = (
    "quorum", "fragments", "sync_every", "overlap", "heartbeat_timeout_s", "delta_codec",
    "global_codec", "initial_model",
)  # fmt: skip


def resolved_settings(args: list[str]) -> dict[str, str]:
    """Every setting of ``ddiloco local ARGS`` that its mode reads, defaults
    included, as text."""
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, LocalConfig)
    cfg = dataclass_from_args(LocalConfig, parser.parse_args(args))
    unused = set(_NOT_SETTINGS)
    if cfg.mode == "ddp":
        unused |= {*_DILOCO_RUN_SETTINGS, *dataclass_values(cfg.sync), *dataclass_values(cfg.outer)}
    return {k: flag_text(v) for k, v in dataclass_values(cfg).items() if k not in unused}


def same_settings(stored: dict[str, str], now: dict[str, str]) -> bool:
    """Whether a stored run ran with today's settings. A setting the stored run
    does not name did not exist when it ran: it matches at today's default (what
    a new setting's default must keep: the behaviour before it)."""
    defaults = resolved_settings([])
    return all(
        stored.get(k, defaults.get(k)) == now.get(k, defaults.get(k))
        for k in {*stored, *now} - set(_NOT_SETTINGS)  # a run stored when they were
    )


def local_run(
    result_path: Path,
    args: list[str],
    describe: Callable[[Path, dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """``describe(folder, summary)`` of a run of ``ddiloco local ARGS``, stored in
    ``result_path`` with its settings; a stored result with the same settings is
    returned without running again."""
    settings = resolved_settings(args)
    if result_path.exists():
        done: dict[str, Any] = json.loads(result_path.read_text())
        if same_settings(done.get("settings", {}), settings):
            return done
        print(f"{result_path}: settings changed since it ran; running it again", flush=True)
    folder = result_path.with_suffix("")
    if folder.exists():  # an unfinished or outdated earlier try
        shutil.rmtree(folder)
    cmd = [sys.executable, "-m", "compose.cli", "local", "--no-progress", *args]
    cmd += ["--out", str(folder)]
    print("$ ddiloco local", " ".join(args), flush=True)
    subprocess.run(cmd, check=True)
    summary = json.loads((folder / "summary.json").read_text())
    result = describe(folder, summary) | {"arguments": args, "settings": settings}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
