"""What the syncer counts and reports: Prometheus metrics, the run's totals
and its event log (JSON lines)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client import Counter as PromCounter

from broker.files import EventLog
from broker.transport import TransportStats
from syncer.fragment_state import RoundResult

log = logging.getLogger(__name__)


class _Prometheus:
    def __init__(self, port: int, host: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.deltas_applied = PromCounter(
            "ddiloco_syncer_deltas_applied", "Deltas merged", registry=r
        )
        self.deltas_rejected = PromCounter(
            "ddiloco_syncer_deltas_rejected", "Deltas refused", ["reason"], registry=r
        )
        self.duplicates = PromCounter(
            "ddiloco_syncer_deltas_duplicate", "Deltas already applied (acked)", registry=r
        )
        self.deltas_clipped = PromCounter(
            "ddiloco_syncer_deltas_clipped", "Deltas scaled down to the quarantine bar", registry=r
        )
        self.weights_clipped = PromCounter(
            "ddiloco_syncer_weights_clipped", "Weights capped at the typical weight", registry=r
        )
        self.heartbeats_ignored = PromCounter(
            "ddiloco_syncer_heartbeats_ignored", "Heartbeats of ids not on the roster", registry=r
        )
        self.roster = Gauge("ddiloco_syncer_roster", "Learner ids on the roster", registry=r)
        self.rounds = PromCounter(
            "ddiloco_syncer_rounds", "Globals published", ["fragment"], registry=r
        )
        self.version = Gauge("ddiloco_syncer_fragment_version", "Version", ["fragment"], registry=r)
        self.live = Gauge(
            "ddiloco_syncer_live_learners", "Learners rounds wait for (deltas arriving)", registry=r
        )
        self.quorum = Gauge("ddiloco_syncer_quorum", "K, the deltas that close a round", registry=r)
        self.quorum_s = Gauge(
            "ddiloco_syncer_quorum_seconds", "Time to quorum", ["fragment"], registry=r
        )
        self.grace_s = Gauge(
            "ddiloco_syncer_grace_seconds", "Grace window", ["fragment"], registry=r
        )
        self.sync_s = Gauge("ddiloco_syncer_sync_seconds", "Merge+checkpoint+publish", registry=r)
        self.bytes_in = Gauge("ddiloco_syncer_bytes_received", "Bytes received", registry=r)
        self.bytes_out = Gauge("ddiloco_syncer_bytes_sent", "Bytes sent", registry=r)
        if port:
            start_http_server(port, addr=host, registry=r)


class SyncerMetrics:
    """The run's totals (for the summary), mirrored to Prometheus on
    ``metrics_port`` when given, and every event in ``metrics_file``."""

    def __init__(self, metrics_port: int, metrics_file: str | None, metrics_host: str) -> None:
        self.prometheus = _Prometheus(metrics_port, metrics_host)
        self.events = EventLog(metrics_file)
        self.rejected: Counter[str] = Counter()
        self.rounds = 0
        self.deltas_applied = 0
        self.duplicates = 0
        self.deltas_clipped = 0
        self.weights_clipped = 0
        self.heartbeats_ignored = 0
        self.merged_tokens = 0
        self.checkpoint_bytes = 0  # written to checkpoints and their logs

    def event(self, kind: str, **fields: Any) -> None:
        self.events.write(kind, **fields)

    def reject(self, reason: str, learner: str, fragment: int, seq: int) -> None:
        self.rejected[reason] += 1
        self.prometheus.deltas_rejected.labels(reason).inc()
        log.warning("rejected delta %s/%d from %s: %s", fragment, seq, learner, reason)
        self.event("reject", reason=reason, learner=learner, fragment=fragment)

    def duplicate(self) -> None:
        self.duplicates += 1
        self.prometheus.duplicates.inc()

    def ignored_heartbeats(self, count: int) -> None:
        self.heartbeats_ignored += count
        self.prometheus.heartbeats_ignored.inc(count)

    def round(
        self,
        fragment: int,
        epoch: int,
        result: RoundResult,
        quorum: int,
        timings: dict[str, float | None],
    ) -> None:
        """A published round (``epoch``: its lineage's, which a syncer rebuilt
        from the broker keeps); ``timings``: its sync_s, grace_s, quorum_s and
        quorum_to_publish_s (the last two None when it closed before quorum)."""
        p = self.prometheus
        self.rounds += 1
        self.deltas_applied += result.included
        self.merged_tokens += result.tokens
        self.deltas_clipped += len(result.clipped)
        self.weights_clipped += result.weights_clipped
        p.rounds.labels(str(fragment)).inc()
        p.deltas_applied.inc(result.included)
        p.deltas_clipped.inc(len(result.clipped))
        p.weights_clipped.inc(result.weights_clipped)
        p.version.labels(str(fragment)).set(result.version)
        p.sync_s.set(timings["sync_s"] or 0.0)
        p.grace_s.labels(str(fragment)).set(timings["grace_s"] or 0.0)
        if timings["quorum_s"] is not None:
            p.quorum_s.labels(str(fragment)).set(timings["quorum_s"])
        self.event(
            "round",
            fragment=fragment,
            epoch=epoch,
            version=result.version,
            included=result.included,
            tokens=result.tokens,
            learners=result.learners,
            keys=result.keys,
            spans=result.spans,
            clipped=result.clipped,
            weights_clipped=result.weights_clipped,
            quorum=quorum,
            **timings,
            merged_tokens=self.merged_tokens,
        )

    def gauges(self, waited: int, roster: int, quorum: int, stats: TransportStats) -> None:
        p = self.prometheus
        p.live.set(waited)
        p.roster.set(roster)
        p.quorum.set(quorum)
        p.bytes_in.set(stats.bytes_received)
        p.bytes_out.set(stats.bytes_sent)

    def summary(self, stats: TransportStats) -> dict[str, Any]:
        """Totals of the run. Each counter counts one thing: ``deltas_rejected``
        the deltas the syncer refused (the sum of ``rejected_by_reason``);
        ``transport_refused`` the frames and messages the transport refused
        before they reached the syncer (malformed, unauthenticated, a key
        claiming another's id: ``transport_refused_by_reason``). Duplicates
        are acked, not refused, and counted beside them."""
        return {
            "fragments_published": self.rounds,
            "deltas_applied": self.deltas_applied,
            "deltas_rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
            "transport_refused": sum(stats.rejected.values()),
            "transport_refused_by_reason": dict(stats.rejected),
            "duplicates": self.duplicates,
            "snapshot_requests_rate_limited": stats.rate_limited,
            "snapshots_lost": stats.snapshots_lost,
            "deltas_clipped": self.deltas_clipped,
            "weights_clipped": self.weights_clipped,
            "heartbeats_ignored": self.heartbeats_ignored,
            "merged_tokens": self.merged_tokens,
            "checkpoint_bytes": self.checkpoint_bytes,
            "bytes_received": stats.bytes_received,
            "bytes_sent": stats.bytes_sent,
        }

    def close(self) -> None:
        self.events.close()
