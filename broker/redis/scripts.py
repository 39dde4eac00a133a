"""The Lua scripts of the Redis Streams transport, and :class:`ReadScript`, which
runs one that only reads.

Each keeps what a member could do on its own from happening in pieces: a
reader never sees entries larger than the run's bound (``TAKE_BOUNDED``,
``READ_BOUNDED``, ``CLAIM_BOUNDED``), a learner's stream stays bounded
(``BOUNDED_XADD``), and a joiner reads a consistent snapshot
(``SNAPSHOTS_UNLESS_HELD``, ``STREAM_TRIMMED_PAST``). The scripts members run
are loaded by the admitting syncer (:data:`broker.redis.admission.MEMBER_SCRIPTS`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis

# Whether stream KEYS[1] lost entries past the id ARGV[1] that a reader read
# last ('0-0': none yet) to trimming, which drops the oldest entries first: 1 if
# that entry is gone (or, for '0-0', if the stream holds any), else 0. Only the
# reader's own last entry is looked at: the stream's first one is often a
# fragment's whole fp32 weights, which Lua would copy on every check (at 100M
# parameters 16 MB a call, most of Redis's time under 16 learners).
STREAM_TRIMMED_PAST = """#!lua flags=no-writes
if ARGV[1] == '0-0' then
  return #redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1) > 0 and 1 or 0
end
return #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 and 1 or 0
"""

# The id of the last entry of the globals stream KEYS[1] (false: empty), and
# per fragment, read at once: its snapshot and the changes published since
# ({model, {change, ...}}: together the latest version), or, when the reader
# holds the latest version's weights, that global without them and no changes
# (SnapshotRequest.held_crcs). KEYS[2..]: n model keys, the n weightless keys,
# then the n changes keys; ARGV: per fragment, the checksum the reader holds
# in decimal, or '' for none.
SNAPSHOTS_UNLESS_HELD = """#!lua flags=no-writes
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local out = {false}
if #last > 0 then out[1] = last[1][1] end
local n = (#KEYS - 1) / 3
for i = 1, n do
    local answer = false
    if ARGV[i] ~= '' then
        local held = redis.call('HMGET', KEYS[1 + n + i], 'crc', 'frame')
        if held[1] == ARGV[i] then answer = {held[2], {}} end
    end
    if not answer then
        answer = {redis.call('GET', KEYS[1 + i]), redis.call('LRANGE', KEYS[1 + 2 * n + i], 0, -1)}
    end
    out[1 + i] = answer
end
return out
"""

# Take up to ARGV[1] entries of stream KEYS[1] and delete them: each whose one
# field ``m`` is at most ARGV[2] bytes is returned, the others only counted, so
# no entry larger than the bound ever leaves the server. Returns
# {dropped, {id1, m1, id2, m2, ...}}.
TAKE_BOUNDED = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', tonumber(ARGV[1]))
local limit, taken, dropped = tonumber(ARGV[2]), {}, 0
for _, entry in ipairs(entries) do
    redis.call('XDEL', KEYS[1], entry[1])
    local f = entry[2]
    if #f == 2 and f[1] == 'm' and #f[2] <= limit then
        taken[#taken + 1] = entry[1]
        taken[#taken + 1] = f[2]
    else
        dropped = dropped + 1
    end
end
return {dropped, taken}
"""

# XREADGROUP GROUP ARGV[1] ARGV[2] COUNT ARGV[3] STREAMS KEYS ARGV[6..] (no
# BLOCK), where every entry whose values hold more than ARGV[4] bytes in all is
# acked and deleted here, counted, and never returned: no entry larger than the
# bound leaves the server. Entries past ARGV[5] bytes in all (after the first)
# are held back: delivered to the consumer but not returned, they are read
# again as its pending entries, so that no reply outgrows what the socket
# moves within its timeout. Returns {dropped, {{stream, kept entries, the last
# id returned or dropped before any held back, whether some were held back},
# ...}}.
READ_BOUNDED = """
local group, consumer, limit = ARGV[1], ARGV[2], tonumber(ARGV[4])
local budget, total, over = tonumber(ARGV[5]), 0, false
local args = {'XREADGROUP', 'GROUP', group, consumer, 'COUNT', ARGV[3], 'STREAMS'}
for i = 1, #KEYS do args[#args + 1] = KEYS[i] end
for i = 6, #ARGV do args[#args + 1] = ARGV[i] end
local reply = redis.call(unpack(args))
local dropped, out = 0, {}
if not reply then return {0, out} end
for _, stream in ipairs(reply) do
    local kept, last, held = {}, false, 0
    for _, entry in ipairs(stream[2]) do
        local size = 0
        if entry[2] then
            for i = 2, #entry[2], 2 do size = size + #entry[2][i] end
        end
        if size > limit then
            redis.call('XACK', stream[1], group, entry[1])
            redis.call('XDEL', stream[1], entry[1])
            dropped = dropped + 1
            if held == 0 then last = entry[1] end
        elseif held == 1 or (total > 0 and total + size > budget) then
            held = 1
        else
            total = total + size
            kept[#kept + 1] = entry
            last = entry[1]
        end
    end
    out[#out + 1] = {stream[1], kept, last, held}
end
return {dropped, out}
"""

# XAUTOCLAIM KEYS[1] ARGV[1] ARGV[2] ARGV[4] ARGV[5] COUNT ARGV[3] (group,
# consumer, count, min idle ms, start), with READ_BOUNDED's bound ARGV[6].
# Returns {dropped, next cursor, claimed entries, ids deleted while pending}.
CLAIM_BOUNDED = """
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[4], ARGV[5],
                         'COUNT', ARGV[3])
local limit, dropped, kept = tonumber(ARGV[6]), 0, {}
for _, entry in ipairs(reply[2]) do
    local size = 0
    if entry[2] then
        for i = 2, #entry[2], 2 do size = size + #entry[2][i] end
    end
    if size > limit then
        redis.call('XACK', KEYS[1], ARGV[1], entry[1])
        redis.call('XDEL', KEYS[1], entry[1])
        dropped = dropped + 1
    else
        kept[#kept + 1] = entry
    end
end
return {dropped, reply[1], kept, reply[3] or {}}
"""

# XADD the field-value pairs ARGV[3..] to delta stream KEYS[1], keeping it at
# most ARGV[1] entries long. Entries group ARGV[2] is done with (delivered and
# acked) go first; if that is not enough, the oldest others are dropped and
# counted in KEYS[2]. Returns how many unread or unacked entries were dropped.
BOUNDED_XADD = """
local maxlen = tonumber(ARGV[1])
local lost = 0
if redis.call('XLEN', KEYS[1]) >= maxlen then
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
    if ok then
        for _, g in ipairs(groups) do
            local info = {}
            for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
            if info['name'] == ARGV[2] then
                local bound = info['last-delivered-id']
                if info['pending'] > 0 then
                    bound = redis.call('XPENDING', KEYS[1], ARGV[2])[2]
                end
                redis.call('XTRIM', KEYS[1], 'MINID', bound)
            end
        end
    end
    local len = redis.call('XLEN', KEYS[1])
    if len >= maxlen then
        lost = len - maxlen + 1
        redis.call('XTRIM', KEYS[1], 'MAXLEN', maxlen - 1)
        redis.call('INCRBY', KEYS[2], lost)
    end
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return lost
"""


class ReadScript:
    """A Lua script that only reads, run with EVALSHA_RO: a member may run it on
    keys it may read but not write. Loaded on first use (or again after a Redis
    restart) where the client may load scripts; a member's syncer loads them."""

    def __init__(self, client: redis.Redis, text: str) -> None:
        self._client = client
        self._text = text
        self._sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys: list[str], args: list[str]) -> Any:
        try:
            return self._client.evalsha_ro(self._sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self._client.script_load(self._text)  # NOPERM for a member: retried later
            return self._client.evalsha_ro(self._sha, len(keys), *keys, *args)
