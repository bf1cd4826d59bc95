"""The fleet tier's server-side steps: Lua scripts, each one atomic on the server.

Times are the server's own clock (``TIME``, in ms), so nodes with skewed clocks agree.
The invariants the scripts keep together:

1. A manifest is written (``commit``) only if every chunk it names exists and was touched
   (its entry in the touched set) within the grace period, in the same atomic step.
2. A chunk touched at t is not deleted (``collect``) by a collection whose cutoff is at or
   below t; the touch time is checked again inside the deleting step.
3. A chunk outlives every manifest that names it by at least the grace period: a commit or a
   hold extends the chunks it names to the capsule's end of life plus the grace (or makes them
   persist), and never shortens an expiry.
4. A capsule's keys (manifest, holders, the names pointing at it) live exactly as long as its
   longest lease (``holders``: node -> end of lease, +inf until dropped); the last drop
   deletes them.

Each script declares itself (``#!lua``, Redis 7 or Valkey): the server refuses a script that
may write while it is over maxmemory before the script starts, never half-way through its
writes; collection and drop, which free memory, are allowed then (``allow-oom``). A script
checks the types of the keys it writes before its first write, for the same reason: a key of
another type (another application on the prefix) makes it refuse, not stop half-way.

Scripts reach the name keys of a capsule through its names set, building their key names
from the prefix: fine on one server (Valkey or Redis, with or without replicas); a cluster
would need every key of a capsule in one hash slot (docs/fleet.md).
"""
from __future__ import annotations

from typing import Sequence

import redis

_WRITES = "#!lua\n"
_FREES = "#!lua flags=allow-oom\n"

_COMMON = """
-- The first key of pairs {key, type, ...} that holds another type than its own, or nil.
local function wrong_type(pairs)
  for i = 1, #pairs, 2 do
    local kind = redis.call('TYPE', pairs[i])['ok']
    if kind ~= 'none' and kind ~= pairs[i + 1] then return pairs[i] end
  end
  return nil
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The end of the capsule's life: its latest lease (nil: none left; math.huge: until dropped).
local function lifetime(holders, now)
  redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
  local top = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  if #top == 0 then return nil end
  return tonumber(top[2])
end

local function live_until(key, until_ms)
  if until_ms == math.huge then redis.call('PERSIST', key) else redis.call('PEXPIREAT', key, until_ms) end
end

-- Never shortens: a chunk may be named by other manifests that live longer.
local function extend(key, until_ms, now)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 then return end
  if until_ms == math.huge then redis.call('PERSIST', key)
  elseif ttl >= 0 and now + ttl < until_ms then redis.call('PEXPIREAT', key, until_ms) end
end

local function points_here(value, id)
  return value and string.sub(value, 1, 16) == id and string.sub(value, 17, 17) == ' '
end

-- The capsule's keys live until until_ms; names moved to other capsules leave its names set.
local function settle(manifest, holders, names, name_prefix, id, until_ms)
  live_until(manifest, until_ms)
  live_until(holders, until_ms)
  for _, name in ipairs(redis.call('SMEMBERS', names)) do
    local key = name_prefix .. name
    if points_here(redis.call('GET', key), id) then live_until(key, until_ms)
    else redis.call('SREM', names, name) end
  end
  if redis.call('EXISTS', names) == 1 then live_until(names, until_ms) end
end

local function remove(manifest, holders, names, name_prefix, id)
  for _, name in ipairs(redis.call('SMEMBERS', names)) do
    local key = name_prefix .. name
    if points_here(redis.call('GET', key), id) then redis.call('DEL', key) end
  end
  redis.call('DEL', manifest, holders, names)
end

local function lease_end(lease, now)
  if lease == 'inf' then return '+inf' end
  return now + tonumber(lease)
end
"""

# KEYS: touched set, chunk keys...   ARGV: least ttl (ms), chunk digests...
# Marks each chunk touched now (never earlier than it was), keeps an existing one for at least
# the least ttl, and answers {'ok', 0} then 1 where the chunk exists, 0 where it must be sent.
TOUCH = _WRITES + _COMMON + """
if wrong_type({KEYS[1], 'zset'}) then return {'wrongtype', 0} end
local now = now_ms()
local least = tonumber(ARGV[1])
local present = {}
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[1], 'GT', now, ARGV[i])
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl == -2 then
    present[i + 1] = 0
  else
    present[i + 1] = 1
    if ttl >= 0 and ttl < least then redis.call('PEXPIRE', KEYS[i], least) end
  end
end
present[1], present[2] = 'ok', 0
return present
"""

# KEYS: manifest, holders, names set, touched set, name key (the manifest key when no name), chunk keys...
# ARGV: manifest, node, lease (ms or 'inf'), grace (ms), name ('' for none), name value, name key prefix,
#       capsule id, chunk digests...
# Answers {'ok', 0}, {'missing', i}, {'stale', i} (chunk i, from 1), {'conflict', 0} or {'wrongtype', 0}.
COMMIT = _WRITES + _COMMON + """
if wrong_type({KEYS[1], 'string', KEYS[2], 'zset', KEYS[3], 'set', KEYS[4], 'zset', KEYS[5], 'string'}) then
  return {'wrongtype', 0}
end
local now = now_ms()
local grace = tonumber(ARGV[4])
for i = 6, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {'missing', i - 5} end
  local touched = redis.call('ZSCORE', KEYS[4], ARGV[i + 3])
  if (not touched) or tonumber(touched) < now - grace then return {'stale', i - 5} end
end
local old = redis.call('GET', KEYS[1])
if old and old ~= ARGV[1] then return {'conflict', 0} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], lease_end(ARGV[3], now), ARGV[2])
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[5], ARGV[6])
  redis.call('SADD', KEYS[3], ARGV[5])
end
local until_ms = lifetime(KEYS[2], now)
settle(KEYS[1], KEYS[2], KEYS[3], ARGV[7], ARGV[8], until_ms)
for i = 6, #KEYS do extend(KEYS[i], until_ms + grace, now) end
return {'ok', 0}
"""

# KEYS: manifest, holders, names set, chunk keys...   ARGV: node, lease (ms or 'inf'), grace (ms),
# name key prefix, capsule id.   Answers {'ok', 0}, {'unknown', 0}, {'missing', i} or {'wrongtype', 0}.
HOLD = _WRITES + _COMMON + """
if wrong_type({KEYS[1], 'string', KEYS[2], 'zset', KEYS[3], 'set'}) then return {'wrongtype', 0} end
local now = now_ms()
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown', 0} end
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {'missing', i - 3} end
end
redis.call('ZADD', KEYS[2], lease_end(ARGV[2], now), ARGV[1])
local until_ms = lifetime(KEYS[2], now)
settle(KEYS[1], KEYS[2], KEYS[3], ARGV[4], ARGV[5], until_ms)
for i = 4, #KEYS do extend(KEYS[i], until_ms + tonumber(ARGV[3]), now) end
return {'ok', 0}
"""

# KEYS: manifest, holders, names set   ARGV: node, name key prefix, capsule id.
# Answers {'gone', 0} (the last reference: the capsule's keys are deleted, its chunks are left
# for collection), {'held', n} (n other holders keep it), {'not_held', 0}, {'unknown', 0} or {'wrongtype', 0}.
DROP = _FREES + _COMMON + """
if wrong_type({KEYS[1], 'string', KEYS[2], 'zset', KEYS[3], 'set'}) then return {'wrongtype', 0} end
local now = now_ms()
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown', 0} end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return {'not_held', 0} end
local until_ms = lifetime(KEYS[2], now)
if not until_ms then
  remove(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3])
  return {'gone', 0}
end
settle(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], until_ms)
return {'held', redis.call('ZCARD', KEYS[2])}
"""

# KEYS: touched set, chunk keys...   ARGV: cutoff (server ms), chunk digests...
# Deletes each chunk whose touch is still older than the cutoff (checked here, atomically with
# the delete); a chunk with no touch entry was not written by a publisher of this tier: left.
# Answers {chunks deleted, bytes freed}.
COLLECT = _FREES + """
local cutoff = tonumber(ARGV[1])
local removed, freed = 0, 0
for i = 2, #KEYS do
  local touched = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if touched and tonumber(touched) < cutoff then
    if redis.call('TYPE', KEYS[i])['ok'] == 'string' then freed = freed + redis.call('STRLEN', KEYS[i]) end
    removed = removed + redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return {removed, freed}
"""


class Scripts:
    """The scripts registered on one client; each call runs one of them (loaded again by
    redis-py if the server lost its script cache, as a restarted server has)."""

    def __init__(self, client: redis.Redis) -> None:
        self.touch = client.register_script(TOUCH)
        self.commit = client.register_script(COMMIT)
        self.hold = client.register_script(HOLD)
        self.drop = client.register_script(DROP)
        self.collect = client.register_script(COLLECT)


def outcome(answer: Sequence) -> tuple[str, int]:
    """A script's {word, number} answer as (str, int)."""
    word, number = answer
    return (word.decode() if isinstance(word, bytes) else str(word)), int(number)
