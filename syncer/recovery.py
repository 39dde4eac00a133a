"""A syncer's start on what it finds: its checkpoint folder checked against the
run, and fragments rebuilt from the run's latest globals where the folder
lacks them (docs/design.md, takeover)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

from broker.errors import ConfigError, WireError
from broker.fragments import FragmentPlan
from broker.run.settings import RunSettings
from broker.transport import SyncerTransport
from broker.wire.messages import GlobalFragment
from syncer.checkpoint import load_fragment, load_manifest, read_changes, save_manifest
from syncer.fragment_state import FragmentState
from syncer.outer import momentum_from_change

log = logging.getLogger(__name__)


def check_manifest(checkpoint_dir: Path, plan: FragmentPlan, run: RunSettings) -> None:
    """Refuse a checkpoint folder of another model or another shard count, then
    record this run's in it."""
    manifest = load_manifest(checkpoint_dir)
    if manifest is not None and manifest.get("plan_hash") != plan.plan_hash:
        raise ConfigError(
            f"{checkpoint_dir} holds a checkpoint of another model (plan "
            f"{manifest.get('plan_hash')} != {plan.plan_hash}); point "
            "checkpoint_dir elsewhere or delete it"
        )
    shards = manifest.get("syncer_shards", 1) if manifest is not None else None
    if shards is not None and shards != run.syncer_shards:
        raise ConfigError(
            f"{checkpoint_dir} holds the checkpoint of a run with syncer_shards="
            f"{shards}, not {run.syncer_shards}: fragments cannot move between "
            "shards in a run; start it with the same syncer_shards"
        )
    save_manifest(
        checkpoint_dir,
        {
            "run_id": run.run_id,
            "plan_hash": plan.plan_hash,
            "syncer_shards": run.syncer_shards,
            "fragments": plan.num_fragments,
            "sync_every": plan.sync_every,
            "initial_model": run.initial_model,
        },
    )


def resume_from_folder(
    checkpoint_dir: Path,
    owned: list[int],
    new_state: Callable[[int, torch.Tensor], FragmentState],
    initial: Callable[[int], torch.Tensor],
) -> tuple[dict[int, FragmentState], dict[int, int], list[int]]:
    """The states of the ``owned`` fragments whose checkpoint the folder holds
    (each built on its checkpoint's version, which it loads: the initial
    model, ``initial``, is read only for what starts from it, 1 GB at 250M),
    with the rounds logged after each full state replayed; the rounds in each
    log; and the fragments the folder lacks."""
    states: dict[int, FragmentState] = {}
    logged: dict[int, int] = {}
    fresh, resumed = [], []
    for p in owned:
        saved = load_fragment(checkpoint_dir, p)
        if saved is None:
            fresh.append(p)
            continue
        tensors, meta = saved
        current = tensors.get(f"version.{meta.get('version')}")
        state = new_state(p, initial(p) if current is None else current)
        state.load(tensors, meta)
        # The rounds logged after the full state, in order (older ones: a
        # crash between the full state's rename and the log's removal).
        records = read_changes(checkpoint_dir, p, cut=True)
        state.replay(records)
        logged[p] = len(records)
        resumed.append(f"{p}@v{state.version}")
        states[p] = state
    if resumed:
        log.info("resumed fragments from %s: %s", checkpoint_dir, ", ".join(resumed))
    return states, logged, fresh


def rebuild_from_broker(
    transport: SyncerTransport,
    states: dict[int, FragmentState],
    owned: list[int],
    plan: FragmentPlan,
    checkpoint_dir: Path,
    recall_s: float,
    outer_lr: float,
    new_state: Callable[[int, torch.Tensor], FragmentState],
) -> list[int]:
    """Rebuild each owned fragment whose latest version the broker keeps
    (Redis, with the state published beside it) or, over ZeroMQ, the
    learners hold (with the state that came with it, signed), and the
    checkpoint here does not: none of it (the host and its disk were lost), or
    an older one (this syncer served the shard before another took it
    over, elsewhere). It goes on from that version, in its epoch, with the
    de-duplication state that goes with it, so the run goes on where it
    was and nothing is applied twice; not from the initial model. The
    momentum is estimated from the change that made the version, where a
    learner held it (:func:`syncer.outer.momentum_from_change`), else starts
    again from zero. What only the lost checkpoint held is gone: the
    momentum itself, the master's lead over the published version and the
    older kept versions (deltas based on them are refused as stale, and
    their learners take the latest). ``recall_s``: how long learners are
    asked where they hold what no broker keeps (ZeroMQ). ``outer_lr``: the
    outer step's learning rate, to estimate momentum by. ``states``: those
    of the fragments with a checkpoint; a rebuilt fragment without one is
    added, built by ``new_state`` on the version found. Returns the
    fragments rebuilt."""
    held = {p: s.weights for p, s in states.items()}
    rebuilt, estimated = [], []
    for p, (latest, raw, last_change) in sorted(
        transport.resume_points(owned, held, recall_s).items()
    ):
        state = states.get(p)
        if state is not None and (latest.epoch, latest.version) <= (state.epoch, state.version):
            continue  # the checkpoint here is as new (or a round ahead: not yet published)
        try:
            meta = msgpack.unpackb(raw, raw=False) if raw else None
        except (ValueError, msgpack.UnpackException):
            meta = None
        if not isinstance(meta, dict) or (meta.get("epoch"), meta.get("version")) != (
            latest.epoch,
            latest.version,
        ):
            log.warning("fragment %d: the state found is not its latest version's", p)
            continue
        if latest.numel != plan.fragment_numel(p):
            log.warning("fragment %d: the latest version found is not this model's", p)
            continue
        weights = latest.tensor()
        tensors = {f"version.{latest.version}": weights}
        momentum = _momentum_estimate(last_change, latest, outer_lr)
        if momentum is not None:
            tensors["momentum"] = momentum
            estimated.append(p)
        try:
            if state is None:
                state = states[p] = new_state(p, weights)
            state.load(tensors, meta)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            # Signed by a syncer where the run has keys; a run without keys
            # takes a learner's at its word.
            raise ConfigError(
                f"fragment {p}: the state found with its latest version does not load ({e}): "
                "restore its checkpoint, or pass --new-epoch to start over"
            ) from e
        rebuilt.append(p)
    if rebuilt:
        log.warning(
            "fragment(s) %s: %s holds no checkpoint of their latest versions; rebuilt from "
            "the run's latest globals (%s), in their epoch; momentum estimated from the "
            "last change for %s, from zero for the rest; deltas on older versions are "
            "refused as stale",
            rebuilt, checkpoint_dir,
            ", ".join(f"{p}@v{states[p].version}" for p in rebuilt), estimated or "none",
        )  # fmt: skip
    return rebuilt


def _momentum_estimate(
    change: GlobalFragment | None, latest: GlobalFragment, outer_lr: float
) -> torch.Tensor | None:
    """The buffer estimated from the change that made ``latest``
    (:func:`syncer.outer.momentum_from_change`), or None where there is no
    such change or it does not decode."""
    if change is None or (change.epoch, change.version) != (latest.epoch, latest.version):
        return None
    if not change.is_change or change.numel != latest.numel:
        return None
    try:
        return momentum_from_change(change.tensor(), outer_lr)
    except WireError:
        return None
