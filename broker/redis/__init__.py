"""Redis Streams backend of the transport (docs/transports.md).

The learner side is :mod:`broker.redis.learner`, the syncer side
:mod:`broker.redis.syncer`. They are built of the parts that write and read the
delta streams (:mod:`broker.redis.delta_queue` on the learner,
:mod:`broker.redis.delta_reader` and :mod:`broker.redis.delta_trimmer` on the
syncer) and the globals (:mod:`broker.redis.globals_publisher` on the syncer,
:mod:`broker.redis.globals_reader` on the learner, :mod:`broker.redis.snapshot_keys`
on both). What both sides share: the keys (:mod:`broker.redis.names`), the Lua
scripts (:mod:`broker.redis.scripts`), the frame checks
(:mod:`broker.redis.frames`) and the connection handling with the one retry
loop both sides wait in (:mod:`broker.redis.link`).

Every stream entry holds one :mod:`broker.wire.messages` frame: deltas in the three
fields ``h``, ``p``, ``c`` (the parts of :func:`broker.wire.messages.encode_parts`, so a
learner sends its payload without copying it into a frame first), everything
else whole in the field ``m``. A reader takes either form.

Delivery
--------
* A learner's delta is delivered when Redis replied to its XADD (the server runs
  with AOF ``appendfsync always``, so the reply comes after the fsync). Until
  then it stays queued in the learner and is resent by ``poll``; a resend after
  a lost reply may duplicate an entry, which the syncer de-duplicates by
  (learner, incarnation, seq).
* The syncer reads with XREADGROUP and acks (XACK) only what the caller acks.
  A restarted consumer first re-reads its own pending entries, then new ones.
  Entries left pending by a dead consumer are taken over with XAUTOCLAIM once
  they are idle for ``claim_idle_s``: that must be longer than the longest time
  a live syncer holds a delta before acking it.
* Delta streams are trimmed with XTRIM MINID below the oldest entry that is
  pending or not yet delivered to the group, so trimming never eats an entry
  the syncer still needs. The learner's ``delta_stream_maxlen`` is a hard bound
  for a syncer that is down for long: its XADD (one script,
  :data:`broker.redis.scripts.BOUNDED_XADD`) first drops what the group is done
  with, and only then the oldest entries the syncer never acked, which it
  counts in ``trimmed:{p}``. The learner logs every such loss, and the syncer
  reports the count (``transport_trimmed_unread``) and logs it loudly. Size
  ``delta_stream_maxlen`` (a URL option) for the longest syncer outage you want
  to survive without loss.
* A delta the syncer refuses is XACKed and answered on the learner's notices
  stream, which the learner reads in the same blocking XREAD as the globals.
* Globals reach learners in version order per fragment. A learner that sees a
  gap, a fragment it has no base for, or the globals stream trimmed past its
  read position fetches the latest-snapshot keys instead.

Connection errors (and other transient server errors: loading, OOM, MISCONF;
:func:`broker.redis.link.is_transient`) never escape: both sides back off
exponentially (with jitter), reconnect and carry on; deltas and globals not yet
written stay queued in the process. The few exceptions are documented with each
side. Invalid messages of our own (wrong run, fragment out of range, frame over
``max_message_bytes``) raise :class:`~broker.errors.ConfigError` or
:class:`~broker.errors.WireError` at once: they are bugs, not network weather.
"""
