"""A fragment's settings, as FragmentState takes them, from the figures the
syncer's unit tests name."""

from __future__ import annotations

from typing import Any

from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from syncer.config import OuterConfig
from syncer.trust import ReportLimits


def syncer_settings(
    *, quorum: int, codec: str | Codec, limits: ReportLimits, overlap: int = 2, **outer: Any
) -> tuple[OuterConfig, RunSettings]:
    """(OuterConfig, RunSettings) for FragmentState: K = ``quorum``, the global
    ``codec``, ``limits`` (its step floor is 2 H), every other keyword an
    OuterConfig field."""
    run = RunSettings(
        learners=max(quorum, 4),
        quorum=quorum,
        sync_every=limits.step_floor // 2,
        overlap=overlap,
        global_codec=Codec.parse(codec) if isinstance(codec, str) else codec,
    )
    limits_of_outer = dict(
        max_tokens_per_step=limits.max_tokens_per_step, max_clock_skew_s=limits.max_clock_skew_s
    )
    return OuterConfig(**limits_of_outer, **outer), run
