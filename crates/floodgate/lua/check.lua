-- The entry point that decides: floodgate_check.
--
-- ARGV[1]: mode, for one decision over all KEYS: 'check' (all-or-nothing), 'refund' (give back
--          what a 'check' took), 'peek' (evaluate at the request's cost and consume nothing:
--          limits on slots after one that denied, and operators inspecting a client), 'charge'
--          (add each cost unconditionally: a post-charge once the response told the request's
--          real cost; never denies, may leave debt; concurrency limits are skipped), 'sync'
--          (batched mode: add what a node admitted locally, unconditionally, and read back the
--          state every node contributed to); or 'batch': several 'check' decisions (decisions
--          that waited while the node had a call in flight, coalesced into one), decided one
--          after the other in order, each all-or-nothing, at one instant.
-- ARGV[2]: now in microseconds, or '' to use the server's clock (TIME), so that gateways with
--          skewed clocks agree.
-- 'batch' only: ARGV[3]: the number of decisions; then before each decision's limits, its
--          number of limits.
-- Then 5 values per limit: algorithm, the two numbers `a` and `b` it uses (see common.lua),
-- cost, and a token: the random id of the lease or log entry to take ('check' of concurrency
-- and of the logs), or what to give back ('refund' of both).
-- KEYS: one per limit, in order (in a Redis Cluster all on one slot).
--
-- Reply: { now, then per decision: ... }.
--   'check', 'batch' and 'peek' (never admitted): admitted (0/1), then per limit: allowed,
--     remaining, reset_after, retry_after (-1: none), delay, token; and when the decision was
--     not admitted, then per limit the state it was decided on: present (0/1) and three
--     fields (0 0 0 0 for an algorithm without export), so that a node can deny again locally.
--   'refund' and 'charge': 0, then per limit the same six fields, evaluated after the refund
--     or charge without charging, and ''; then per limit the state after it, as above.
--   'sync' (cost: the units to add): per limit: present (0/1) and three state fields.

local PER_LIMIT = 5

local function append_state(reply, r, algorithm, s1, s2, s3)
  if algorithm.export and s1 ~= nil then
    local f1, f2, f3 = algorithm.export(s1, s2, s3)
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 1, f1, f2, f3
  else
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 0, 0, 0, 0
  end
  return r + 4
end

-- Scratch space of decisions with several limits, reused from call to call (a function
-- library stays loaded): each call writes every index it reads.
local S_ALGORITHM, S_A, S_B, S_COST = {}, {}, {}, {}
local S1, S2, S3 = {}, {}, {}
local S_OK, S_REMAINING, S_RESET, S_RETRY, S_DELAY = {}, {}, {}, {}, {}

-- One decision of n limits (keys after `key_at`, limits after `arg_at`): evaluates every
-- limit, consumes from all if all admit and `consume` is set, and appends the reply. Returns
-- the reply's new length, or nil and an error for an unknown algorithm.
local function decide(keys, args, key_at, arg_at, n, now, consume, reply, r)
  if n == 1 then
    -- The common case, without scratch tables.
    local name = args[arg_at + 1]
    local algorithm = ALGORITHMS[name]
    if not algorithm then
      return nil, 'floodgate: unknown algorithm ' .. tostring(name)
    end
    local a, b, cost = tonumber(args[arg_at + 2]), tonumber(args[arg_at + 3]), tonumber(args[arg_at + 4])
    local key = keys[key_at + 1]
    local s1, s2, s3 = algorithm.load(key, now, b)
    local ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, cost)
    if ok == 1 and consume then
      local written = algorithm.consume(key, s1, s2, s3, a, b, now, cost, args[arg_at + 5]) or ''
      reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 1, 1, remaining, reset
      reply[r + 5], reply[r + 6], reply[r + 7] = retry, delay, written
      return r + 7
    end
    if ok == 1 then
      -- Not charged: report it as it stands.
      ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, 0)
    end
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 0, ok, remaining, reset
    reply[r + 5], reply[r + 6], reply[r + 7] = retry, delay, ''
    return append_state(reply, r + 7, algorithm, s1, s2, s3)
  end

  local admitted = consume
  for i = 1, n do
    local at = arg_at + (i - 1) * PER_LIMIT
    local name = args[at + 1]
    local algorithm = ALGORITHMS[name]
    if not algorithm then
      return nil, 'floodgate: unknown algorithm ' .. tostring(name)
    end
    local a, b, cost = tonumber(args[at + 2]), tonumber(args[at + 3]), tonumber(args[at + 4])
    S_ALGORITHM[i], S_A[i], S_B[i], S_COST[i] = algorithm, a, b, cost
    local s1, s2, s3 = algorithm.load(keys[key_at + i], now, b)
    S1[i], S2[i], S3[i] = s1, s2, s3
    local ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, cost)
    S_OK[i], S_REMAINING[i], S_RESET[i], S_RETRY[i], S_DELAY[i] = ok, remaining, reset, retry, delay
    if ok == 0 then
      admitted = false
    end
  end
  reply[r + 1] = admitted and 1 or 0
  r = r + 1
  for i = 1, n do
    local algorithm = S_ALGORITHM[i]
    local ok, remaining, reset, retry, delay = S_OK[i], S_REMAINING[i], S_RESET[i], S_RETRY[i], S_DELAY[i]
    local written = ''
    if admitted then
      written = algorithm.consume(
        keys[key_at + i], S1[i], S2[i], S3[i], S_A[i], S_B[i], now, S_COST[i],
        args[arg_at + (i - 1) * PER_LIMIT + 5]
      ) or ''
    elseif ok == 1 then
      -- Not charged, since another limit denied: report it as it stands.
      ok, remaining, reset, retry, delay =
        algorithm.evaluate(S1[i], S2[i], S3[i], S_A[i], S_B[i], now, 0)
    end
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = ok, remaining, reset, retry
    reply[r + 5], reply[r + 6] = delay, written
    r = r + 6
  end
  if not admitted then
    for i = 1, n do
      r = append_state(reply, r, S_ALGORITHM[i], S1[i], S2[i], S3[i])
    end
  end
  return r
end

-- The first algorithm of `count` limits after `arg_at` that is unknown (or, with `batchable`,
-- cannot run batched), checked before a call that writes as it goes changes anything.
local function refused(args, arg_at, count, batchable)
  for i = 1, count do
    local name = args[arg_at + (i - 1) * PER_LIMIT + 1]
    local algorithm = ALGORITHMS[name]
    if not algorithm then
      return 'floodgate: unknown algorithm ' .. tostring(name)
    end
    if batchable and not algorithm.export then
      return 'floodgate: ' .. tostring(name) .. ' cannot run batched'
    end
  end
  return nil
end

-- 'refund' and 'charge' of one decision: changes each limit, then reports it as it stands,
-- and its state.
local function adjust(keys, args, n, now, mode, reply, r)
  local failure = refused(args, 2, n, false)
  if failure then
    return nil, failure
  end
  reply[r + 1] = 0
  r = r + 1
  for i = 1, n do
    local at = 2 + (i - 1) * PER_LIMIT
    local name = args[at + 1]
    local algorithm = ALGORITHMS[name]
    local a, b, cost = tonumber(args[at + 2]), tonumber(args[at + 3]), tonumber(args[at + 4])
    local key = keys[i]
    if mode == 'refund' then
      algorithm.refund(key, a, b, now, cost, args[at + 5])
    elseif cost > 0 and name ~= 'concurrency' then
      local s1, s2, s3 = algorithm.load(key, now, b)
      algorithm.consume(key, s1, s2, s3, a, b, now, cost, args[at + 5])
    end
    local s1, s2, s3 = algorithm.load(key, now, b)
    S_ALGORITHM[i], S1[i], S2[i], S3[i] = algorithm, s1, s2, s3
    local ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, 0)
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = ok, remaining, reset, retry
    reply[r + 5], reply[r + 6] = delay, ''
    r = r + 6
  end
  for i = 1, n do
    r = append_state(reply, r, S_ALGORITHM[i], S1[i], S2[i], S3[i])
  end
  return r
end

-- 'sync' of one decision's limits: adds each cost, then reads the state back.
local function sync(keys, args, n, now, reply, r)
  local failure = refused(args, 2, n, true)
  if failure then
    return nil, failure
  end
  for i = 1, n do
    local at = 2 + (i - 1) * PER_LIMIT
    local algorithm = ALGORITHMS[args[at + 1]]
    local a, b, cost = tonumber(args[at + 2]), tonumber(args[at + 3]), tonumber(args[at + 4])
    local key = keys[i]
    local s1, s2, s3 = algorithm.load(key, now, b)
    if cost > 0 then
      algorithm.consume(key, s1, s2, s3, a, b, now, cost, '')
      s1, s2, s3 = algorithm.load(key, now, b)
    end
    r = append_state(reply, r, algorithm, s1, s2, s3)
  end
  return r
end

local function floodgate_check(keys, args)
  if not floor then
    bind_globals()
  end
  local mode = args[1]
  local now
  if args[2] == '' then
    local time = redis.call('TIME')
    now = time[1] * 1000000 + time[2]
  else
    now = tonumber(args[2])
  end
  -- Sized for the common reply (one limit, admitted) at once.
  local reply = { now, 0, 0, 0, 0, 0, 0, 0 }
  local r, failure = 1, nil
  local n = #keys
  if mode == 'check' or mode == 'peek' then
    r, failure = decide(keys, args, 0, 2, n, now, mode == 'check', reply, r)
  elseif mode == 'batch' then
    local decisions = tonumber(args[3])
    -- Every decision's algorithms are known before the first decision writes.
    local arg_at = 3
    for _ = 1, decisions do
      local limits = tonumber(args[arg_at + 1])
      failure = failure or refused(args, arg_at + 1, limits, false)
      arg_at = arg_at + 1 + limits * PER_LIMIT
    end
    local key_at = 0
    arg_at = 3
    for _ = 1, failure and 0 or decisions do
      local limits = tonumber(args[arg_at + 1])
      r, failure = decide(keys, args, key_at, arg_at + 1, limits, now, true, reply, r)
      if not r then
        break
      end
      key_at = key_at + limits
      arg_at = arg_at + 1 + limits * PER_LIMIT
    end
  elseif mode == 'sync' then
    r, failure = sync(keys, args, n, now, reply, r)
  elseif mode == 'refund' or mode == 'charge' then
    r, failure = adjust(keys, args, n, now, mode, reply, r)
  else
    failure = 'floodgate: unknown mode ' .. tostring(mode)
  end
  if failure then
    return redis.error_reply(failure)
  end
  -- A reply shorter than the table made for it ends here: Redis reads an array up to its first
  -- nil.
  reply[r + 1] = nil
  return reply
end
