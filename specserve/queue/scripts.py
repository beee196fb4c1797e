"""Lua scripts for the state changes that must be atomic.

The lean client (queue/resp.py) sends a script's text the first time on each connection and EVALSHA after
that, sending it whole again on NOSCRIPT (a restarted or failed-over server has an empty script cache);
redis-py's calls send EVAL. Timestamps come from the server clock (ms) so that every process agrees on them.

Atomic, except on a cluster slot being migrated: Valkey stops a script at the first key that is not on the
source node (moved already, or not made yet), keeping the writes before it, and both clients run the script
again from the start (resp.ScriptKeyMoved). So every script here must be safe to run again after stopping at
any command: a move of an entry's ownership (XCLAIM) comes after the writes that record where it waits, a
count may be counted twice (a tenant's tokens), no state is left that names a holder that does not hold the
entry, and a take that has moved entries to its worker returns them rather than stop (ready.TAKE). The lean
client does not follow an ASK with a script (resp.py `_is_script`); redis-py's does, for the few scripts
sent through it (cancel, hand-back, heartbeat, the tenants' limits).
"""

from __future__ import annotations

_NOW = """
local _t = redis.call('TIME')
local now_ms = string.format('%d', tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000))
"""

_TERMINAL = """
local function terminal(s)
  return s == 'finished' or s == 'failed' or s == 'cancelled' or s == 'expired'
end
"""

# The pseudo-consumer that holds sorted-in entries while they wait in the ready queue (queue/ready.py).
READY_CONSUMER = "~ready"

# Admission limits: a global backlog cap and, per tenant, a cap on queued requests and on tokens
# asked for per minute. A tenant's queued requests are a sorted set (id -> enqueue time), not a counter:
# members older than the request TTL fall out by themselves, so a request whose status expired while queued
# cannot hold its tenant's quota forever. `admit` takes a table: stream, group, prefix (the quota key
# prefix; '' where the tenant counters are kept apart from the shard, queue/tenants.py), backlog, max_queued,
# tpm, asked (this request's tokens), ttl (ms), new (1: the request is not in
# the stream yet, so the backlog it would join is the one counted), count (requests admitted together, all or
# none: default 1); a limit of 0 is off. A request that asks
# for more tokens than a minute allows is refused in every minute, the first included: letting the first of
# each minute through whatever its size made the cap a rate of requests, not of tokens.
_QUOTA = (
    """
local function queued_key(prefix, tenant) return prefix .. 'queued:' .. tenant end
local function queued(prefix, tenant, id, now, ttl)
  local key = queued_key(prefix, tenant)
  redis.call('ZADD', key, now, id)
  redis.call('PEXPIRE', key, ttl)
end
-- Requests waiting for a worker: never delivered (the group's lag) plus sorted into the ready queue.
local function backlog(stream, group)
  local n = 0
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local t = {}
    for i = 1, #g, 2 do t[g[i]] = g[i + 1] end
    if t['name'] == group then n = n + tonumber(t['lag'] or 0) end
  end
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
    local t = {}
    for i = 1, #c, 2 do t[c[i]] = c[i + 1] end
    if t['name'] == '"""
    + READY_CONSUMER
    + """' then n = n + tonumber(t['pending']) end
  end
  return n
end
local function admit(tenant, q)
  local adding = q.count or 1
  local cap = tonumber(q.backlog or '0')
  if cap > 0 and backlog(q.stream, q.group) + adding * q.new > cap then return {-1, 'max_backlog', 1} end
  if tenant == '' then return nil end
  local max_queued = tonumber(q.max_queued or '0')
  if max_queued > 0 then
    local key = queued_key(q.prefix, tenant)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', tonumber(now_ms) - tonumber(q.ttl))
    if redis.call('ZCARD', key) + adding > max_queued then return {-1, 'tenant_max_queued', 1} end
  end
  local tpm = tonumber(q.tpm or '0')
  if tpm > 0 then
    local minute = math.floor(tonumber(now_ms) / 60000)
    local key = q.prefix .. 'tpm:' .. tenant .. ':' .. minute
    local used = tonumber(redis.call('GET', key) or '0')
    local asked = tonumber(q.asked) * adding
    if used + asked > tpm then
      return {-1, 'tenant_tokens_per_minute', 60 - math.floor(tonumber(now_ms) / 1000) % 60}
    end
    redis.call('INCRBY', key, asked)
    redis.call('EXPIRE', key, 120)
  end
  return nil
end
"""
)

# Requests added together, all or none (the choices of one n > 1 request). KEYS: requests stream, then each
# request's status hash. ARGV: ttl_ms, traceparent, tracestate, workers' group, tenant ('' for none: recorded
# in the status hash, so that only its own key reads or cancels the request), then the quota arguments: quota
# key prefix, max backlog, tenant max queued, tenant tokens per minute, each request's tokens (see _QUOTA);
# then each request's id and body. The status hash's `admitted` mark tells a worker the limits were checked
# here (a raw XADD's are checked as a worker sorts it in, queue/ready.py). Returns {-1, limit, retry after s}
# when a limit refuses them (nothing added), else one reply per request: {1, entry id} when added, {0,
# current status} when its id is already known (idempotent enqueue). A missing stream means the server lost
# its data (restart without persistence, flush) and with it the group: XADD alone would bring the stream back
# without one, so recreate it here (from id 0, as workers do). Clients cache that the group exists, and XADD
# never reports NOGROUP, so only this check notices.
ENQUEUE = (
    _NOW
    + _QUOTA
    + """
local out, fresh = {}, {}
for i = 2, #KEYS do
  local existing = redis.call('HGET', KEYS[i], 'status')
  if existing then out[i - 1] = {0, existing} else fresh[#fresh + 1] = i end
end
if #fresh == 0 then return out end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[4], '0', 'MKSTREAM')
end
local tenant = ARGV[5]
local q = {stream = KEYS[1], group = ARGV[4], prefix = ARGV[6], backlog = ARGV[7], max_queued = ARGV[8],
  tpm = ARGV[9], asked = ARGV[10], ttl = ARGV[1], new = 1, count = #fresh}
local refused = admit(tenant, q)
if refused then return refused end
for _, i in ipairs(fresh) do
  local id, body = ARGV[7 + 2 * i], ARGV[8 + 2 * i]
  local f = {'id', id, 'body', body}
  if ARGV[2] ~= '' then f[#f + 1] = 'traceparent'; f[#f + 1] = ARGV[2] end
  if ARGV[3] ~= '' then f[#f + 1] = 'tracestate'; f[#f + 1] = ARGV[3] end
  local eid = redis.call('XADD', KEYS[1], '*', unpack(f))
  local h = {'status', 'queued', 'entry', eid, 'created', now_ms, 'admitted', '1'}
  if tenant ~= '' then h[#h + 1] = 'tenant'; h[#h + 1] = tenant end
  redis.call('HSET', KEYS[i], unpack(h))
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
  if tenant ~= '' and ARGV[6] ~= '' then queued(ARGV[6], tenant, id, now_ms, ARGV[1]) end
  out[i - 1] = {1, eid}
end
return out
"""
)

# A worker takes an entry it has read. KEYS: status hash, requests stream.
# ARGV: entry id, group, consumer, ttl_ms, max_deliveries, deadline_ms or '', created_ms (from the entry id),
# the quota key prefix, the request id (it leaves its tenant's queued set).
# Returns {action, detail, now_ms[, tenant counted]}; action is run | duplicate | done | cancel | expire |
# dead | notmine; the tenant (or '') comes with every answer that took the request out of its tenant's
# queued set.
CLAIM = (
    _NOW
    + _TERMINAL
    + """
local p = redis.call('XPENDING', KEYS[2], ARGV[2], ARGV[1], ARGV[1], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return {'notmine', '', now_ms} end
local deliveries = tonumber(p[1][4])
local h = redis.call('HMGET', KEYS[1], 'entry', 'status', 'cancel', 'handoffs', 'tenant', 'quota')
if h[1] and h[1] ~= ARGV[1] then return {'duplicate', h[2] or '', now_ms} end
local counted = h[5] or h[6]  -- its tenant, or the default tenant a raw entry without one counts under
if counted and (ARGV[8] or '') ~= '' then  -- not queued any more
  redis.call('ZREM', ARGV[8] .. 'queued:' .. counted, ARGV[9])
end
if h[2] and terminal(h[2]) then return {'done', h[2], now_ms, counted or ''} end
if not h[1] then redis.call('HSET', KEYS[1], 'entry', ARGV[1], 'created', ARGV[7]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if h[3] == '1' then return {'cancel', '', now_ms, counted or ''} end
if ARGV[6] ~= '' and tonumber(now_ms) > tonumber(ARGV[6]) then
  return {'expire', '', now_ms, counted or ''}
end
if deliveries - tonumber(h[4] or '0') > tonumber(ARGV[5]) then
  return {'dead', tostring(deliveries), now_ms, counted or ''}
end
local run = redis.call('HINCRBY', KEYS[1], 'run', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[3], 'started', now_ms)
return {'run', tostring(run), now_ms, counted or ''}
"""
)

# Whether a reply stream can take entries: a key someone made of another type would fail its XADD halfway
# through a script, after the writes before it (Redis does not roll a script back).
_REPLY_WRITABLE = """
local function reply_writable(key)
  local t = redis.call('TYPE', key).ok
  return t == 'stream' or t == 'none'
end
"""

# Final output entry, terminal status and XACK in one step, only while this consumer still owns the entry
# (a worker that lost it to XAUTOCLAIM must not finish it). KEYS: output stream, status hash, requests stream,
# and the request's reply stream if it has one. ARGV: group, consumer, entry id, ttl_ms, status, n, then n
# output field/value pairs, m, then m reply field/value pairs, the reply stream's maxlen, then hash pairs.
# Returns 1 when written, 0 when the entry is not this consumer's, and REPLY_NOT_A_STREAM, having written
# nothing, when the reply stream's key holds another type.
# Safe to run again: a publisher resends its finals when a reply was lost (a failover mid-call), and a run
# that already landed answers 1 again, writing nothing twice (the status hash names this entry, this worker
# and a terminal status). On a promoted replica that missed the first run the entry is still pending with this
# worker (its claim was replicated before the tokens it made), so the final is written there once.
REPLY_NOT_A_STREAM = -1
FINISH = (
    _NOW
    + _TERMINAL
    + _REPLY_WRITABLE
    + """
local p = redis.call('XPENDING', KEYS[3], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  local st, entry, worker = unpack(redis.call('HMGET', KEYS[2], 'status', 'entry', 'worker'))
  if st and terminal(st) and entry == ARGV[3] and worker == ARGV[2] then return 1 end
  return 0
end
local n = tonumber(ARGV[6])
local at = 7 + 2 * n
local m = tonumber(ARGV[at])
if m > 0 and not reply_writable(KEYS[4]) then return -1 end
local out = {}
for i = 7, 6 + 2 * n do out[#out + 1] = ARGV[i] end
redis.call('XADD', KEYS[1], '*', unpack(out))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if m > 0 then
  local reply = {}
  for i = at + 1, at + 2 * m do reply[#reply + 1] = ARGV[i] end
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[at + 2 * m + 1], '*', unpack(reply))
  redis.call('PEXPIRE', KEYS[4], ARGV[4])
end
local h = {'status', ARGV[5], 'finished', now_ms}
for i = at + 2 * m + 2, #ARGV do h[#h + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(h))
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('XACK', KEYS[3], ARGV[1], ARGV[3])
return 1
"""
)

# A run's output entries, written only while that run still owns the request: a worker that lost the request
# to another (a reclaim after its heartbeats stopped) keeps producing tokens until its next heartbeat, and
# those must not land between the new run's entries (a sampled rerun draws other tokens from the resume
# point, so readers would see a sequence no run made). KEYS: output stream, status hash. ARGV: run, ttl_ms
# (0: the stream's TTL is already set), reply stream key or '', reply maxlen, request id, then one entry after
# another as a field count and that many field/value pairs. Returns how many entries were written. A reply
# stream whose key holds another type gets nothing (FINISH then fails the request naming reply_to).
APPEND = (
    _REPLY_WRITABLE
    + """
if redis.call('HGET', KEYS[2], 'run') ~= ARGV[1] then return 0 end
local reply = ARGV[3]
if reply ~= '' and not reply_writable(reply) then reply = '' end
local i, written = 6, 0
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local f = {}
  for j = i + 1, i + 2 * n do f[#f + 1] = ARGV[j] end
  redis.call('XADD', KEYS[1], '*', unpack(f))
  if reply ~= '' then
    redis.call('XADD', reply, 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[5], unpack(f))
  end
  written = written + 1
  i = i + 1 + 2 * n
end
if ARGV[2] ~= '0' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if reply ~= '' then redis.call('PEXPIRE', reply, ARGV[2]) end
end
return written
"""
)

# Keep in-flight entries fresh so no other worker's XAUTOCLAIM takes them; report those we no longer own.
# KEYS: requests stream. ARGV: group, consumer, entry ids...
HEARTBEAT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    lost[#lost + 1] = ARGV[i]
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
"""

# KEYS: status hashes of the requests a worker runs. Returns the 1-based positions of those asked to cancel.
# One command instead of one HGET each: the worker asks every 0.1 s, and with a full batch the per-command
# Python of a pipeline was a third of its event loop's time.
CANCELLED = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'cancel') == '1' then out[#out + 1] = i end
end
return out
"""

# A draining worker hands an entry back: it looks idle at once so a live worker's XAUTOCLAIM takes it, and
# the hand-off does not count as a failed delivery. KEYS: requests stream, status hash.
# ARGV: group, consumer, entry id, idle_ms, the quota key prefix, the request id.
HANDBACK = (
    _TERMINAL
    + """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
local h = redis.call('HMGET', KEYS[2], 'entry', 'status', 'tenant', 'quota')
h[3] = h[3] or h[4]  -- the default tenant a raw entry without one counts under
if h[1] == ARGV[3] and not terminal(h[2]) then
  -- the tenant's set first: a stop there (queue/scripts.py) must not count the hand-off again on each rerun
  if h[3] and (ARGV[5] or '') ~= '' then  -- queued again: it counts against its tenant again
    local t = redis.call('TIME')
    redis.call('ZADD', ARGV[5] .. 'queued:' .. h[3], tonumber(t[1]) * 1000, ARGV[6])
  end
  redis.call('HINCRBY', KEYS[2], 'handoffs', 1)
  redis.call('HSET', KEYS[2], 'status', 'queued')
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
return 1
"""
)

# API / client cancellation. KEYS: status hash, output stream. ARGV: ttl_ms, tenant ('' or absent: any),
# the quota key prefix, the request id. Returns {outcome, status[, the tenant whose queued set it left]}.
# A queued request is cancelled here and now (with its final entry); a running one is flagged for its worker.
# Another tenant's request is 'missing': a key learns nothing about requests it does not own.
CANCEL = (
    _NOW
    + _TERMINAL
    + """
local st, owner, counted = unpack(redis.call('HMGET', KEYS[1], 'status', 'tenant', 'quota'))
if not st then return {'missing', ''} end
if ARGV[2] and ARGV[2] ~= '' and owner ~= ARGV[2] then return {'missing', ''} end
if terminal(st) then return {'terminal', st} end
redis.call('HSET', KEYS[1], 'cancel', '1')
if st == 'queued' then
  counted = owner or counted
  if counted and (ARGV[3] or '') ~= '' then redis.call('ZREM', ARGV[3] .. 'queued:' .. counted, ARGV[4]) end
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'abort', 'finished', now_ms)
  redis.call('XADD', KEYS[2], '*', 'run', '0', 'offset', '0', 'text_offset', '0', 'ids', '[]', 'text', '',
    'finish_reason', 'abort', 'status', 'cancelled')
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  return {'cancelled', 'cancelled', counted or ''}
end
return {'cancelling', st}
"""
)

# Trim the request stream without dropping anything a group still needs: keep every entry at or after the
# oldest pending entry and after the last delivered one, over all groups. KEYS: requests stream.
TRIM = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end
local keep = nil
for _, g in ipairs(groups) do
  local t = {}
  for i = 1, #g, 2 do t[g[i]] = g[i + 1] end
  local cand = t['last-delivered-id']
  if tonumber(t['pending']) > 0 then
    local s = redis.call('XPENDING', KEYS[1], t['name'])
    if less(s[2], cand) then cand = s[2] end
  end
  if keep == nil or less(cand, keep) then keep = cand end
end
return redis.call('XTRIM', KEYS[1], 'MINID', keep)
"""

# Acknowledge an entry only while this consumer still owns it (an entry another worker has taken over is
# that worker's to acknowledge). KEYS: requests stream. ARGV: group, consumer, entry id. Returns 1 if acked.
ACK_MINE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
"""
