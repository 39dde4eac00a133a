"""The connection handling of the Redis Streams transport: :func:`connect`, the
backoff after transient errors (:class:`Reconnect`) and :class:`RedisLink`, a
client with its backoff and the one retry loop both sides wait in.

Which errors are transient (the same request may succeed later) is decided
in one place, :func:`is_transient`, and caught in one place,
:func:`transient_call`: every handler of the backend that carries on after
network weather goes through it, most of them by way of :class:`RedisLink`.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from broker.redis.sentinel import connect_sentinel, is_sentinel_url, parse_sentinel_url
from broker.transport import TransportError, TransportStats

if TYPE_CHECKING:
    from broker.identity.keys import RunKeys

log = logging.getLogger(__name__)

T = TypeVar("T")

_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0


class NotReplicated(TransportError):
    """A write the primary took that no replica confirmed within the wait
    (``wait_replicas``): it may be lost in a failover, so it is not done yet."""


# Errors after which the same request may succeed later: the server is down,
# restarting, loading its AOF, out of memory, or failing to write its AOF;
# with replicas also a failover under way (no primary, a primary turned
# replica, too few replicas in sync to take writes: NOREPLICAS, or to confirm
# one: NotReplicated).
# With the run's keys also a refused user or command (AUTH, NOPERM): a learner
# whose ACL user the syncer has not made, or widened to its learner id, yet; it
# enrolls again and waits (broker.redis.learner).
_TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.exceptions.NoPermissionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ExecAbortError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    NotReplicated,
)

# Redis refused our user or a command: not admitted (yet), not network weather.
REFUSED = (redis.AuthenticationError, redis.exceptions.NoPermissionError)


def is_transient(error: Exception) -> bool:
    """Whether the request that failed with ``error`` may succeed later (see
    ``_TRANSIENT_ERRORS``; a MISCONF reply too: Redis cannot write its AOF;
    and NOREPLICAS: the primary has too few replicas in sync to take writes)."""
    if isinstance(error, _TRANSIENT_ERRORS):
        return True
    # A transaction's error reads "Command # N (...) of pipeline caused error: REPLY".
    reply = str(error).rpartition("caused error: ")[2]
    return isinstance(error, redis.ResponseError) and reply.startswith(("MISCONF", "NOREPLICAS"))


def brief(error: Exception) -> str:
    """``error`` for a log line: redis-py's "no master found" names every
    Sentinel's whole client, a few kB; the Sentinels' answers are what say why."""
    text = str(error)
    if not isinstance(error, MasterNotFoundError):
        return text
    # "... : <client(... host=H,port=P ...)> - ERROR, <client(...)> - ERROR"
    answers = re.findall(r"\)>\)>\)> - (.*?)(?=, <redis\.client\.|$)", text)
    where = [f"{h}:{p}" for h, p in re.findall(r",host=([^,]+),port=(\d+)", text)]
    if len(where) != len(answers):
        return text.split(" : ", 1)[0]
    return (
        text.split(" : ", 1)[0]
        + "; "
        + "; ".join(f"{w}: {a}" for w, a in zip(where, answers, strict=True))
    )


@dataclass(frozen=True)
class Failed:
    """A transient error an action ended in (:func:`transient_call`)."""

    error: Exception


def transient_call(action: Callable[[], T]) -> T | Failed:
    """``action()``, or the transient error it raised as :class:`Failed`; any
    other error propagates. The backend's one handler of transient errors."""
    try:
        return action()
    except Exception as e:
        if not is_transient(e):
            raise
        return Failed(e)


def connect(
    url: str,
    socket_timeout_s: float,
    keys: RunKeys | None = None,
    user: tuple[str, str] | None = None,
) -> redis.Redis:
    """A client for ``url``, as ``user`` (name, password) when given. With the
    run's keys, a ``rediss://`` server must hold a certificate of the run's CA
    for the host dialled; a plain ``redis://`` URL to another host is said to
    be in the clear. A ``redis+sentinel://`` URL gives a client of the
    primary the Sentinels name (:mod:`broker.redis.sentinel`)."""
    parts = urlsplit(url)
    # One immediate retry replaces a pooled connection that a server restart
    # broke; longer outages are the caller's backoff loop's business.
    retry = Retry(NoBackoff(), 1)
    if is_sentinel_url(url):
        address = parse_sentinel_url(url)
        if keys is not None and not address.tls:
            _say_if_clear([host for host, _ in address.sentinels], "rediss+sentinel://")
        return connect_sentinel(address, socket_timeout_s, keys, user, retry=retry)
    options: dict[str, Any] = {}
    if user is not None:
        options["username"], options["password"] = user
    if keys is not None and parts.scheme == "rediss":
        options |= {"ssl_ca_certs": str(keys.tls_ca()), "ssl_cert_reqs": "required",
               "ssl_check_hostname": True}  # fmt: skip
    elif keys is not None and parts.scheme == "redis":
        _say_if_clear([parts.hostname], "rediss://")
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=retry,
        decode_responses=False,
        **options,
    )


def _say_if_clear(hosts: list[str | None], instead: str) -> None:
    """Warn that keys travel in the clear to any of ``hosts`` off this host."""
    away = [h for h in hosts if not _loopback(h)]
    if away:
        log.warning(
            "%s: redis in the clear, readable on the way; use %s (the run's keys hold its CA)",
            ",".join(str(h) for h in away), instead,
        )  # fmt: skip


def _loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, not an address: not known to be loopback
        return False


class Reconnect:
    """Exponential backoff (with jitter) between attempts after transient errors."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._backoff = EqualJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
        self.failures = 0
        self._retry_at = 0.0

    def wait_s(self) -> float:
        """Seconds until the next attempt may go out (0 when it may go now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def failed(self, error: Exception) -> None:
        self.failures += 1
        delay_s = self._backoff.compute(self.failures)
        self._retry_at = time.monotonic() + delay_s
        if self.failures == 1 and isinstance(error, redis.exceptions.OutOfMemoryError):
            log.error(
                "%s: redis is out of memory (its maxmemory, nothing evicted): nothing is "
                "dropped, everything waits queued here while it retries with backoff; "
                "raise redis's maxmemory, or see why the syncer does not keep up (%s)",
                self._what,
                error,
            )
        elif self.failures == 1 and isinstance(error, REFUSED):
            log.info("%s: not admitted by redis yet (%s); retrying", self._what, error)
        elif self.failures == 1:
            log.warning(
                "%s: redis unavailable (%s); retrying with backoff", self._what, brief(error)
            )
        else:
            log.debug(
                "%s: attempt %d failed (%s); next in %.2fs",
                self._what,
                self.failures,
                brief(error),
                delay_s,
            )

    def succeeded(self) -> None:
        if self.failures:
            log.info(
                "%s: redis reachable again after %d failed attempts", self._what, self.failures
            )
        self.failures = 0
        self._retry_at = 0.0


class Outage:
    """Says a run of failed tries of ``what`` once, for tries that keep no
    backoff of their own: the first failure at warning (with ``retry``, what
    happens next), the others at debug, and the first success after at info."""

    def __init__(self, what: str, retry: str) -> None:
        self._what = what
        self._retry = retry
        self.failures = 0  # in a row

    def failed(self, error: Exception) -> None:
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "%s failed (%s); %s", self._what, brief(error), self._retry)

    def ended(self) -> None:
        if self.failures:
            log.info("%s: done again after %d failed tries", self._what, self.failures)
        self.failures = 0


class RedisLink:
    """One redis client, the backoff after its transient errors, and their count
    (``errors``). ``on_failure`` runs after each transient error, with it: for
    state that a reply lost on the way may have made stale, or to enroll again."""

    def __init__(
        self,
        client: redis.Redis,
        what: str,
        on_failure: Callable[[Exception], None] | None = None,
        stats: TransportStats | None = None,
    ) -> None:
        self.client = client
        self.reconnect = Reconnect(what)
        self.errors = 0
        self._on_failure = on_failure
        self._stats = stats  # counts out-of-memory replies

    def backing_off(self) -> bool:
        """Whether the next request must wait for the backoff."""
        return self.reconnect.wait_s() > 0

    def failed(self, error: Exception) -> None:
        self.errors += 1
        if self._stats is not None and isinstance(error, redis.exceptions.OutOfMemoryError):
            self._stats.out_of_memory += 1
        if self._on_failure is not None:
            self._on_failure(error)
        self.reconnect.failed(error)

    def succeeded(self) -> None:
        self.reconnect.succeeded()

    def call(self, action: Callable[[], T]) -> T | Failed:
        """``action()`` now (backoff or not), recorded: a transient error starts
        (or extends) the backoff and comes back as :class:`Failed`; any other
        error propagates."""
        answer = transient_call(action)
        if isinstance(answer, Failed):
            self.failed(answer.error)
        else:
            self.succeeded()
        return answer

    def attempt(self, action: Callable[[], object]) -> bool:
        """Run ``action`` unless we are backing off from redis; True if it ran.
        A transient error starts (or extends) the backoff instead of escaping."""
        if self.backing_off():
            return False
        return not isinstance(self.call(action), Failed)

    def retry(
        self,
        deadline: float,
        attempt: Callable[[float], list[T]],
        *,
        before: Callable[[], None] | None = None,
        on_error: Callable[[Exception], bool] | None = None,
    ) -> list[T]:
        """Call ``attempt(deadline)`` whenever the backoff allows until it finds
        something or ``deadline`` passes; what it found, or [] at the deadline.

        A transient error is recorded (:meth:`failed`), and the next attempt
        waits for the backoff. Any error goes to ``on_error`` first: True means
        it handled it, and the loop goes on without recording a failure or a
        success. Other errors propagate. ``before`` runs ahead of each attempt
        the backoff allows; it handles its own errors, and when it started a
        backoff the attempt waits for that too.
        """

        def attempt_once() -> list[T] | None:
            try:
                return attempt(deadline)
            except Exception as e:
                if on_error is not None and on_error(e):
                    return None  # handled: neither a failure nor a success
                raise

        while True:
            if before is not None and not self.reconnect.wait_s():
                before()
            if not self.reconnect.wait_s():
                found = transient_call(attempt_once)
                if isinstance(found, Failed):
                    self.failed(found.error)
                elif found is not None:
                    self.succeeded()
                    if found or time.monotonic() >= deadline:
                        return found
                    # A read came back empty before the deadline: read again at once.
                    continue
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return []
            time.sleep(min(remaining_s, self.reconnect.wait_s()))

    def call_within(self, timeout_s: float, action: Callable[[], T], what: str) -> T:
        """``action()``, tried again after transient errors (with backoff) until it
        answers; raises :class:`TransportError` ("no {what} within ...") when the
        last try that failed ended after ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), self.reconnect.wait_s()))
            answer = self.call(action)
            if not isinstance(answer, Failed):
                return answer
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"no {what} within {timeout_s}s: {answer.error}"
                ) from answer.error

    def close(self) -> None:
        self.client.close()
