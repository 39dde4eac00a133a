"""A ZeroMQ syncer that lost its checkpoint takes the run's latest weights back
from its learners (docs/design.md, takeover): no broker keeps them over
ZeroMQ, but every learner holds the version of each fragment it took last,
with the syncer's signature of it (:meth:`GlobalFragment.held_form`) and the
syncer state that goes with it (``resume``).

Two steps. Each peer heard from is asked what it holds (a :class:`Recall`
without weights: small claims, unchecked). Then, per fragment, the holder of
the newest claimed version is asked for its weights, which are taken only
if the run's signature and their checksum hold; a holder whose answer does
not, or does not come, is passed over for the next. The holder sends the
change that made that version first, if it took one: kept where the run's
signature holds, for the successor's momentum estimate. One learner can so
delay a takeover (by :data:`ASK_TIMEOUT_S`, once per key it holds), never
hand it weights the syncers did not sign."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from broker.errors import WireError
from broker.identity.signing import GlobalVerifier
from broker.transport import TransportStats
from broker.wire.codecs import Codec
from broker.wire.messages import GlobalFragment, Recall, weights_checksum

log = logging.getLogger(__name__)

# Claims end sooner once every fragment has one and no newer one came for this
# long: the learners that hold the latest version, nearly all, answer at once.
CLAIMS_SETTLED_S = 1.0
# How long a holder asked for its weights has to send them.
ASK_TIMEOUT_S = 10.0

Stamp = tuple[int, int]  # (epoch, version)


@dataclass
class _Fetch:
    """One fragment's weights being fetched: the holders not asked yet, newest
    claim first, and the one asked now."""

    holders: list[tuple[Stamp, bytes]]
    asked: tuple[Stamp, bytes] | None = None
    asked_at: float = 0.0
    refused: set[bytes] = field(default_factory=set)
    change: GlobalFragment | None = None  # the asked holder's, checked


class Recollection:
    """The claims and weights of one recall, fed by the syncer transport's
    receive loop (:meth:`heard`, :meth:`answered`); :meth:`asks` says what to
    send to whom. ``verifier``: the run's signing keys (None: a run without
    keys, whose weights are taken on their checksum alone)."""

    def __init__(
        self,
        run_id: str,
        fragments: list[int],
        verifier: GlobalVerifier | None,
        stats: TransportStats,
        now: float,
        window_s: float,
    ) -> None:
        """``window_s``: how long claims are gathered at most (learners dial a
        syncer at least every 2 s, broker.zmq.addressing, and send a heartbeat
        every step)."""
        self._run_id = run_id
        self._wanted = set(fragments)
        self._verifier = verifier
        self._stats = stats
        self._started = now
        self._window_s = window_s
        self._last_news = now
        self._to_ask: list[bytes] = []
        self._asked: set[bytes] = set()
        # Per fragment, per peer: the stamp it claims and its claim.
        self._claims: dict[int, dict[bytes, GlobalFragment]] = {p: {} for p in fragments}
        self._fetches: dict[int, _Fetch] | None = None  # set once claims are in
        self.taken: dict[int, GlobalFragment] = {}
        self.changes: dict[int, GlobalFragment] = {}  # the change that made a taken version

    # -- fed by the receive loop -------------------------------------------
    def heard(self, peer: bytes) -> None:
        """A peer sent something: ask it what it holds, once."""
        if peer not in self._asked:
            self._asked.add(peer)
            self._to_ask.append(peer)

    def answered(self, peer: bytes, g: GlobalFragment, now: float) -> None:
        """A peer's claim (no weights), or the weights it was asked for or the
        change that made them."""
        if g.fragment not in self._wanted:
            self._stats.rejected["recall_unasked"] += 1
        elif g.is_weightless:
            self._claim(peer, g, now)
        else:
            self._weights(peer, g)

    def _claim(self, peer: bytes, g: GlobalFragment, now: float) -> None:
        claims = self._claims[g.fragment]
        if self._fetches is not None or peer in claims:
            return  # late, or said twice
        best = max(((c.epoch, c.version) for c in claims.values()), default=None)
        claims[peer] = g
        if best is None or (g.epoch, g.version) > best:
            self._last_news = now

    def _weights(self, peer: bytes, g: GlobalFragment) -> None:
        fetches = self._fetches or {}
        fetch = fetches.get(g.fragment)
        if fetch is None or fetch.asked is None or fetch.asked[1] != peer:
            self._stats.rejected["recall_unasked"] += 1
            return
        stamp = fetch.asked[0]
        if g.is_change:
            if (g.epoch, g.version) == stamp and self._signed(g):
                fetch.change = g
            else:
                self._stats.rejected["recall_refused"] += 1
            return
        if (g.epoch, g.version) == stamp and self._checks(g):
            self.taken[g.fragment] = g
            if fetch.change is not None:
                self.changes[g.fragment] = fetch.change
            del fetches[g.fragment]
            return
        self._stats.rejected["recall_refused"] += 1
        log.warning(
            "fragment %d: a learner's weights of v%d are not the run's (bad signature or "
            "checksum): asking the next holder", g.fragment, stamp[1],
        )  # fmt: skip
        fetch.refused.add(peer)
        fetch.asked = None

    def _signed(self, g: GlobalFragment) -> bool:
        return self._verifier is None or self._verifier.verify(g)

    def _checks(self, g: GlobalFragment) -> bool:
        if g.codec != Codec() or not self._signed(g):
            return False
        try:
            return weights_checksum(g.tensor()) == g.weights_crc
        except WireError:
            return False

    # -- what to send, and when it is over ---------------------------------
    def asks(self, now: float) -> list[tuple[bytes, Recall]]:
        """The requests due now, to each peer."""
        out = [(peer, self._recall(sorted(self._wanted), False)) for peer in self._to_ask]
        self._to_ask.clear()
        if self._fetches is None and self._claims_in(now):
            self._fetches = {
                p: _Fetch(sorted(((c.epoch, c.version), peer) for peer, c in claims.items())[::-1])
                for p, claims in self._claims.items()
                if claims
            }
        for p, fetch in (self._fetches or {}).items():
            if fetch.asked is not None and now - fetch.asked_at >= ASK_TIMEOUT_S:
                self._stats.rejected["recall_timeout"] += 1
                fetch.refused.add(fetch.asked[1])
                fetch.asked = None
            while fetch.asked is None and fetch.holders:
                stamp, peer = fetch.holders.pop(0)
                if peer not in fetch.refused:
                    fetch.asked, fetch.asked_at, fetch.change = (stamp, peer), now, None
                    out.append((peer, self._recall([p], True)))
        return out

    def _claims_in(self, now: float) -> bool:
        if now - self._started >= self._window_s:
            return True
        every = all(self._claims.values())
        return every and now - self._last_news >= CLAIMS_SETTLED_S

    def _recall(self, fragments: list[int], weights: bool) -> Recall:
        return Recall(run_id=self._run_id, fragments=fragments, weights=weights)

    def done(self) -> bool:
        """Every fragment has its weights, or nobody left to ask for them."""
        if self._fetches is None:
            return False
        return all(f.asked is None and not f.holders for f in self._fetches.values())

    def claims(self) -> dict[int, int]:
        """Per fragment, how many peers claimed a version of it."""
        return {p: len(c) for p, c in self._claims.items()}
