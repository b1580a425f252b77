"""The Lua scripts of the Redis store: each is one atomic step the gateways share.

Redis runs a script alone (no other client's command in between), so a claim cannot race
another claim, nor a commit a removal. Every script takes one rollout's keys in ``KEYS``
(rollout hash, steps list, lease; see :meth:`~.store.RedisStore._keys`) and answers a
flat array whose first element says what happened (``ok``, ``gone``, ``busy``,
``conflict``, ``lost``).

The rollout hash holds ``reg`` and ``counters`` (JSON), ``rev`` (bumped by every write),
``steps`` (their count), ``chk`` (the last step's check state), ``cancelled``, ``v`` (the
layout), ``waiting`` (a gateway waits for the lease: its release is published), and the
last answer: ``a_key`` (its :class:`~rollout_gateway.server.state.store.AnswerKey`),
``a_body``, and ``a_dlv`` ("1" once the gateway that answered handed it to a connected
client, "0" until then). What the gateways store (``reg``, ``counters``, steps, answers,
``chk``) is opaque here, in the sealed formats of :mod:`rollout_gateway.server.state.codec`.

Messages on the events channel: ``w:{id}`` (the lease of a rollout somebody waits for was
released), ``d:{id}`` (the rollout was removed), ``e`` (an exit report was added to the
stream), ``p`` (a policy version was announced).
"""

from __future__ import annotations

#: KEYS: rollout, steps, lease, key index (the rollout again without a key).
#: ARGV: reg, counters, ttl ms, layout, rollout id. Answers {"ok"} or {"exists"}.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('HSET', KEYS[1], 'reg', ARGV[1], 'counters', ARGV[2], 'rev', 0, 'steps', 0,
           'v', ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
if KEYS[4] ~= KEYS[1] then
  redis.call('HSET', KEYS[1], 'kidx', KEYS[4])
  redis.call('SET', KEYS[4], ARGV[5], 'PX', tonumber(ARGV[3]))
end
return {'ok'}
"""

#: Postpones the expiry of a rollout's keys (KEYS: rollout, steps; its key index is
#: named in the rollout's ``kidx``).
_TOUCH = """
local function touch(ttl)
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  local kidx = redis.call('HGET', KEYS[1], 'kidx')
  if kidx then redis.call('PEXPIRE', kidx, ttl) end
end
"""

#: KEYS: rollout, steps, lease. ARGV: counters, ttl ms, cancel ("1"/"0").
#: Answers {"ok", rev} or {"gone"}.
SAVE = (
    _TOUCH
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
redis.call('HSET', KEYS[1], 'counters', ARGV[1])
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'cancelled', '1') end
local rev = redis.call('HINCRBY', KEYS[1], 'rev', 1)
touch(tonumber(ARGV[2]))
return {'ok', rev}
"""
)

#: KEYS: rollout, steps, lease, policy. ARGV: owner, lease ms, ttl ms, the revision and
#: the step count the caller holds.
#: Answers {"ok", rev, policy version, its time} (the lease is ours; the policy version
#: in effect comes along, so a turn is stamped with the latest one whichever gateway it
#: was announced at) and, when the caller's copy is behind, the rollout's fields (as
#: ``store._ROW_FIELDS``: the last step's check state last) and the steps from the
#: caller's count: what it would read next, in the same round trip. Else {"busy", ms
#: left} (the release will be published), or {"gone"}.
CLAIM = (
    _TOUCH
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'waiting', '1')
  return {'busy', redis.call('PTTL', KEYS[3])}
end
redis.call('SET', KEYS[3], ARGV[1], 'PX', tonumber(ARGV[2]))
touch(tonumber(ARGV[3]))
local policy = redis.call('HMGET', KEYS[4], 'version', 'updated_at')
local rev = redis.call('HGET', KEYS[1], 'rev')
local steps = redis.call('HGET', KEYS[1], 'steps')
if rev == ARGV[4] and steps == ARGV[5] then return {'ok', rev, policy[1], policy[2]} end
local row = redis.call('HMGET', KEYS[1], 'v', 'reg', 'counters', 'rev', 'steps', 'cancelled',
                       'a_key', 'a_dlv', 'chk')
local new = redis.call('LRANGE', KEYS[2], tonumber(ARGV[5]), -1)
return {'ok', rev, policy[1], policy[2], row, new}
"""
)

#: KEYS: lease. ARGV: owner, lease ms. Answers 1 while the lease is the owner's.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

#: KEYS: lease, rollout. ARGV: owner, channel, rollout id, delivered ("1": the claim
#: handed the last answer to a connected client). Drops the lease if it is the owner's
#: and, when a gateway waits for it, tells the gateways (no message otherwise: a turn
#: nobody waits for costs no publish).
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[2], 'a_key') == 1 then
  redis.call('HSET', KEYS[2], 'a_dlv', '1')
end
if redis.call('HDEL', KEYS[2], 'waiting') == 1 then
  redis.call('PUBLISH', ARGV[2], 'w:' .. ARGV[3])
end
return 1
"""

#: KEYS: rollout, steps, lease.
#: ARGV: owner ("" when the store has no leases), index, step, counters, ttl ms,
#: answer key ("" for none), answer, release ("1": the commit ends the owner's claim: the
#: lease is dropped, a waiting gateway told), delivered ("1": the answer goes to a client
#: still connected), channel, rollout id, the step's check state ("" for none: what the
#: next turn is checked against, see ``copies.encode_check``).
#: Answers {"ok", rev}, {"gone"}, {"lost"} (the lease is not the owner's) or
#: {"conflict", steps}.
COMMIT = (
    _TOUCH
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'gone'} end
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return {'lost'} end
local steps = redis.call('HGET', KEYS[1], 'steps')
if steps ~= ARGV[2] then return {'conflict', steps} end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'counters', ARGV[4], 'steps', tonumber(steps) + 1, 'chk', ARGV[12])
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'a_key', ARGV[6], 'a_body', ARGV[7], 'a_dlv', '0')
end
local rev = redis.call('HINCRBY', KEYS[1], 'rev', 1)
touch(tonumber(ARGV[5]))
if ARGV[8] == '1' and ARGV[1] ~= '' then
  redis.call('DEL', KEYS[3])
  if ARGV[9] == '1' and redis.call('HEXISTS', KEYS[1], 'a_key') == 1 then
    redis.call('HSET', KEYS[1], 'a_dlv', '1')
  end
  if redis.call('HDEL', KEYS[1], 'waiting') == 1 then
    redis.call('PUBLISH', ARGV[10], 'w:' .. ARGV[11])
  end
end
return {'ok', rev}
"""
)

#: KEYS: rollout, steps, lease, exits hash. ARGV: channel, rollout id.
#: Answers 1 when the rollout was stored.
DELETE = """
local existed = redis.call('EXISTS', KEYS[1])
local kidx = redis.call('HGET', KEYS[1], 'kidx')
if kidx then redis.call('DEL', kidx) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HDEL', KEYS[4], ARGV[2])
if existed == 1 then redis.call('PUBLISH', ARGV[1], 'd:' .. ARGV[2]) end
return existed
"""

#: KEYS: exits hash, exits stream, seq counter, rollout. ARGV: rollout id, the report
#: (JSON, without its number), max stream length, channel. Merges the report over the
#: rollout's stored one as :func:`rollout_gateway.exits.merged_report` does (a start report
#: after a report is dropped, the first refusal only, a refusal kept on later reports),
#: numbers it once for every gateway, keeps it as the rollout's ("seq JSON"), appends it
#: to the stream (its number is the entry's id) and tells the gateways. Answers {seq,
#: the JSON kept}, {0} (the rollout is not stored) or {-1} (dropped by the merge).
EXIT = """
if redis.call('EXISTS', KEYS[4]) == 0 then return {0} end
local report = ARGV[2]
local stored = redis.call('HGET', KEYS[1], ARGV[1])
if stored then
  local previous = cjson.decode(string.sub(stored, string.find(stored, ' ') + 1))
  local new = cjson.decode(report)
  if new['started'] then return {-1} end
  if new['refused'] then
    if previous['refused'] then return {-1} end
    if new['exit_code'] == cjson.null then new['exit_code'] = previous['exit_code'] end
    report = cjson.encode(new)
  elseif previous['refused'] then
    new['refused'] = previous['refused']
    report = cjson.encode(new)
  end
end
local seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], ARGV[1], seq .. ' ' .. report)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], seq .. '-1', 'r', report)
redis.call('PUBLISH', ARGV[4], 'e')
return {seq, report}
"""

#: KEYS: policy hash. ARGV: version, wall time (s), channel. Forward only; answers
#: {version, updated_at} in effect afterwards.
ANNOUNCE = """
local p = redis.call('HMGET', KEYS[1], 'version', 'updated_at')
if p[1] and tonumber(ARGV[1]) <= tonumber(p[1]) then return p end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'updated_at', ARGV[2])
redis.call('PUBLISH', ARGV[3], 'p')
return {ARGV[1], ARGV[2]}
"""

#: KEYS: exits hash, seq counter. ARGV: rollout id, seq, the report (JSON, without its
#: number). Keeps a report numbered already (numbers on from it).
KEEP_EXIT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
"""

__all__ = [
    "ANNOUNCE",
    "KEEP_EXIT",
    "CLAIM",
    "COMMIT",
    "CREATE",
    "DELETE",
    "EXIT",
    "RELEASE",
    "RENEW",
    "SAVE",
]
