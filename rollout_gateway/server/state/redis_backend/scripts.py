"""The Lua scripts of the Redis backend: each is one atomic step of the gateways' protocol.

Redis runs a script alone (no other client's command in between), so a claim cannot race
another claim, nor a commit a removal. Every script takes the rollout's keys in ``KEYS``
(see :class:`~.keys.RolloutKeys`) and answers a flat array whose first element says what
happened. Times come from Redis's own clock (``TIME``), the one clock every gateway shares.
"""

from __future__ import annotations

#: Shared by the scripts: Redis's clock in milliseconds.
_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

#: Whether a request (fingerprint ``fp``, Idempotency-Key ``idem``, "" for none) repeats a
#: turn: the same key when both carry one, else the same body (the dedupe rules of
#: ``state/dedupe.py``).
_SAME_TURN = """
local function same_turn(fp, idem, turn_fp, turn_idem)
  if idem ~= '' and turn_idem ~= '' then return idem == turn_idem end
  return fp == turn_fp
end
"""

#: KEYS: rollout hash, lease, events list.
#: ARGV: owner, fingerprint, idempotency key, lease ms, events held, window ms, is retry
#: ("1"/"0"), ttl ms.
#: Answers: {"gone"} | {"running"} (the same turn runs elsewhere) | {"busy"} (another turn
#: runs) | {"answered", body} | {"claimed", ver, counters, cancelled, event...}.
CLAIM = (
    _NOW
    + _SAME_TURN
    + """
local r, lease, events = KEYS[1], KEYS[2], KEYS[3]
local owner, fp, idem = ARGV[1], ARGV[2], ARGV[3]
local lease_ms, held, window_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local is_retry, ttl_ms = ARGV[7] == '1', tonumber(ARGV[8])
if redis.call('EXISTS', r) == 0 then return {'gone'} end
local running = redis.call('HMGET', lease, 'owner', 'fp', 'idem')
if running[1] then
  if same_turn(fp, idem, running[2], running[3]) then return {'running'} end
  return {'busy'}
end
local a = redis.call('HMGET', r, 'a_fp', 'a_idem', 'a_at', 'a_delivered', 'a_body')
if a[1] and a[5] and same_turn(fp, idem, a[1], a[2]) then
  local keyed = idem ~= '' and a[2] ~= ''
  local recent = now_ms() - tonumber(a[3]) <= window_ms
  if keyed or (recent and (is_retry or a[4] ~= '1')) then return {'answered', a[5]} end
end
redis.call('HSET', lease, 'owner', owner, 'fp', fp, 'idem', idem)
redis.call('PEXPIRE', lease, lease_ms)
redis.call('PEXPIRE', r, ttl_ms)
redis.call('PEXPIRE', events, ttl_ms)
local f = redis.call('HMGET', r, 'ver', 'counters', 'cancelled')
local out = {'claimed', f[1] or '0', f[2] or '', f[3] or ''}
if held < tonumber(f[1] or '0') then
  for _, e in ipairs(redis.call('LRANGE', events, held, -1)) do out[#out + 1] = e end
end
return out
"""
)

#: KEYS: lease. ARGV: owner, lease ms. Answers 1 when the lease is still the owner's.
RENEW = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

#: KEYS: lease. ARGV: owner. Drops the lease if it is the owner's; publishes on the
#: channel ARGV[2] the rollout id ARGV[3].
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
"""

#: KEYS: rollout hash, lease, events list.
#: ARGV: owner, expected ver, counters JSON, answer body ("" for none), fingerprint,
#: idempotency key, delivered ("1"/"0"), ttl ms, channel, rollout id, then the events.
#: Answers {"ok", ver} | {"gone"} | {"lost"} (the lease is not ours any more) |
#: {"stale", ver} (someone else committed since the claim).
COMMIT = (
    _NOW
    + """
local r, lease, events = KEYS[1], KEYS[2], KEYS[3]
local owner, expected = ARGV[1], ARGV[2]
if redis.call('EXISTS', r) == 0 then
  redis.call('DEL', lease)
  return {'gone'}
end
if redis.call('HGET', lease, 'owner') ~= owner then return {'lost'} end
local ver = redis.call('HGET', r, 'ver') or '0'
if ver ~= expected then return {'stale', ver} end
local n = tonumber(ver)
for i = 11, #ARGV do
  redis.call('RPUSH', events, ARGV[i])
  n = n + 1
end
redis.call('HSET', r, 'ver', n, 'counters', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', r, 'a_body', ARGV[4], 'a_fp', ARGV[5], 'a_idem', ARGV[6],
             'a_delivered', ARGV[7], 'a_at', now_ms())
end
redis.call('DEL', lease)
redis.call('PEXPIRE', r, tonumber(ARGV[8]))
redis.call('PEXPIRE', events, tonumber(ARGV[8]))
redis.call('PUBLISH', ARGV[9], ARGV[10])
return {'ok', tostring(n)}
"""
)

#: KEYS: rollout hash. ARGV: fingerprint, idempotency key. Marks the last answer handed to
#: a connected client (when it is still that turn's).
DELIVERED = """
local a = redis.call('HMGET', KEYS[1], 'a_fp', 'a_idem')
if a[1] == ARGV[1] and a[2] == ARGV[2] then redis.call('HSET', KEYS[1], 'a_delivered', '1') end
return 1
"""

#: KEYS: rollout hash, key index (or the hash again when there is no key).
#: ARGV: registration JSON, counters JSON, ttl ms, schema, rollout id.
#: Answers 1, or 0 when the rollout exists.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'reg', ARGV[1], 'counters', ARGV[2], 'ver', '0', 'v', ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
if KEYS[2] ~= KEYS[1] then
  redis.call('SET', KEYS[2], ARGV[5], 'PX', tonumber(ARGV[3]))
end
return 1
"""

#: KEYS: rollout hash, events list, lease, key index (or the hash again).
#: ARGV: channel, rollout id. Answers the counters JSON of the removed rollout, or false.
DELETE = """
local counters = redis.call('HGET', KEYS[1], 'counters')
if not counters then return false end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
if KEYS[4] ~= KEYS[1] then redis.call('DEL', KEYS[4]) end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return counters
"""

#: KEYS: rollout hash. ARGV: channel, rollout id. Marks the rollout cancelled; 0 when unknown.
CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'cancelled', '1')
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""

#: KEYS: rollout hash, events list. ARGV: ttl ms. Postpones the rollout's expiry.
TOUCH = """
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]))
return 1
"""

#: KEYS: exits stream, its sequence counter. ARGV: rollout id, exit code ("" for none),
#: kind ("exit" / "forget"), max length. Answers the report's number.
EXIT = """
local seq = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], seq .. '-1',
           'rid', ARGV[1], 'code', ARGV[2], 'kind', ARGV[3])
return seq
"""

#: KEYS: policy hash. ARGV: version, channel. Forward-only: answers {"ok", version,
#: updated_at ms, epoch} or {"stale", current version}.
ANNOUNCE = (
    _NOW
    + """
local p = redis.call('HMGET', KEYS[1], 'version', 'updated_at', 'epoch')
local version = tonumber(ARGV[1])
if p[1] and version < tonumber(p[1]) then return {'stale', p[1]} end
if p[1] and version == tonumber(p[1]) then return {'ok', p[1], p[2], p[3]} end
local epoch = tonumber(p[3] or '0') + 1
local at = now_ms()
redis.call('HSET', KEYS[1], 'version', version, 'updated_at', at, 'epoch', epoch)
redis.call('PUBLISH', ARGV[2], 'policy')
return {'ok', tostring(version), tostring(at), tostring(epoch)}
"""
)

__all__ = [
    "ANNOUNCE",
    "CANCEL",
    "CLAIM",
    "COMMIT",
    "CREATE",
    "DELETE",
    "DELIVERED",
    "EXIT",
    "RELEASE",
    "RENEW",
    "TOUCH",
]
