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
--          number of limits and its number of arguments after these two (so that a decision
--          the script cannot read is skipped exactly).
-- Then per limit: its spec, "<algorithm> <a> <b>" with the two numbers the algorithm uses (see
-- common.lua; one argument, parsed once per library load), its cost, and for the algorithms
-- that take one (`sliding_window_log`, `concurrency`) a token: the random id of the lease or
-- log entry to take ('check'), or what to give back ('refund').
-- KEYS: one per limit, in order (in a Redis Cluster all on one slot).
--
-- Reply: { now, then per decision: ... }. A limit's outcome is three values: remaining,
-- reset_after, and retry: -1 allowed, -2 denied for good (the cost exceeds what it can ever
-- hold), else denied and the wait in microseconds; then its delay for `leaky_bucket`, and the
-- lease or log entry written ('' if none) for the algorithms that take a token. A limit's
-- state, for the algorithms that export one: present (0/1) and three fields.
--   'check', 'batch' and 'peek' (never admitted): admitted (0/1), each limit's outcome, and
--     when not admitted each limit's state as it was decided on (so that a node can deny
--     again locally). In 'batch', a decision that failed (an unknown spec, corrupted stored
--     state) is its error message alone, a string where admitted goes.
--   'refund' and 'charge': 0, each limit's outcome evaluated after the change without charging,
--     then each limit's state after it.
--   'sync' (cost: the units to add): each limit's state.
--   'lease': the time its grants were made, then per limit the units granted and its state
--     after the grant (see `lease` below: the last KEY is the node's trade record).

-- Specs parsed so far: { algorithm table, a, b }. Bounded like NUMBERS.
local SPECS, specs_kept = {}, 0

local function parse_spec(text)
  local name, a, b = match(text, '^(%S+) (%d+) (%d+)$')
  if name then
    b = tonumber(b)
  else
    -- A calendar period (a fixed window on the calendar): its limit, then the four
    -- boundaries around the caller's clock (window_bounds picks the server's period).
    local b0, b1, b2, b3
    name, a, b0, b1, b2, b3 = match(text, '^(calendar_window) (%d+) (%d+),(%d+),(%d+),(%d+)$')
    b = name and { tonumber(b0), tonumber(b1), tonumber(b2), tonumber(b3) }
  end
  local algorithm = name and ALGORITHMS[name]
  if not algorithm then
    return nil
  end
  if specs_kept >= 4096 then
    SPECS, specs_kept = {}, 0
  end
  -- [5] to [7]: fixed_windows_at_once's note of the window it last met: its start, the start's
  -- text and its end (none yet: every instant is outside [0, 0)).
  local spec = { algorithm, tonumber(a), b, name, 0, false, 0 }
  SPECS[text] = spec
  specs_kept = specs_kept + 1
  return spec
end

local function unknown(text)
  return 'floodgate: unknown limit spec ' .. tostring(text)
end

-- Appends an outcome: remaining, reset, retry (-1 allowed, -2 never), and delay or token
-- where the algorithm has them.
local function append_outcome(reply, r, algorithm, ok, remaining, reset, retry, delay, written)
  if ok == 1 then
    retry = -1
  elseif retry == -1 then
    retry = -2
  end
  reply[r + 1], reply[r + 2], reply[r + 3] = remaining, reset, retry
  r = r + 3
  if algorithm.delays then
    r = r + 1
    reply[r] = delay
  end
  if algorithm.takes_token then
    r = r + 1
    reply[r] = written or ''
  end
  return r
end

local function append_state(reply, r, algorithm, s1, s2, s3)
  if not algorithm.export then
    return r
  end
  if s1 ~= nil then
    local f1, f2, f3 = algorithm.export(s1, s2, s3)
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 1, f1, f2, f3
  else
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = 0, 0, 0, 0
  end
  return r + 4
end

-- Scratch space of decisions with several limits, reused from call to call (a function
-- library stays loaded): each call writes every index it reads.
local S_ALGORITHM, S_A, S_B, S_COST, S_TOKEN = {}, {}, {}, {}, {}
local S1, S2, S3 = {}, {}, {}
local S_OK, S_REMAINING, S_RESET, S_RETRY, S_DELAY = {}, {}, {}, {}, {}
-- fixed_windows_at_once's: each limit's spec, its cost as its argument's text, and whether its
-- window begins with this decision (its key holds nothing).
local S_SPEC, S_COST_TEXT, S_BEGINS = {}, {}, {}

-- One decision of n limits (keys after `key_at`, arguments after `arg_at`): evaluates every
-- limit, consumes from all if all admit and `consume` is set, and appends the reply. Returns
-- the reply's new length and the argument position after the decision, or nil and an error.
local function decide(keys, args, key_at, arg_at, n, now, consume, reply, r)
  if n == 1 then
    -- The common case, without scratch tables.
    local text = args[arg_at + 1]
    local spec = SPECS[text] or parse_spec(text)
    if not spec then
      return nil, unknown(text)
    end
    local algorithm, a, b = spec[1], spec[2], spec[3]
    local cost = NUMBERS[args[arg_at + 2]] or parse_number(args[arg_at + 2])
    local token = ''
    local next_at = arg_at + 2
    if algorithm.takes_token then
      next_at = next_at + 1
      token = args[next_at]
    end
    local key = keys[key_at + 1]
    local s1, s2, s3 = algorithm.load(key, now, b)
    local ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, cost)
    if ok == 1 and consume then
      local written = algorithm.consume(key, s1, s2, s3, a, b, now, cost, token)
      reply[r + 1] = 1
      return append_outcome(reply, r + 1, algorithm, 1, remaining, reset, retry, delay, written),
        next_at
    end
    if ok == 1 then
      -- Not charged: report it as it stands.
      ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, 0)
    end
    reply[r + 1] = 0
    r = append_outcome(reply, r + 1, algorithm, ok, remaining, reset, retry, delay, '')
    return append_state(reply, r, algorithm, s1, s2, s3), next_at
  end

  local admitted = consume
  local at = arg_at
  for i = 1, n do
    local text = args[at + 1]
    local spec = SPECS[text] or parse_spec(text)
    if not spec then
      return nil, unknown(text)
    end
    local algorithm, a, b = spec[1], spec[2], spec[3]
    local cost = NUMBERS[args[at + 2]] or parse_number(args[at + 2])
    at = at + 2
    if algorithm.takes_token then
      at = at + 1
      S_TOKEN[i] = args[at]
    end
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
        algorithm.takes_token and S_TOKEN[i] or ''
      )
    elseif ok == 1 then
      -- Not charged, since another limit denied: report it as it stands.
      ok, remaining, reset, retry, delay =
        algorithm.evaluate(S1[i], S2[i], S3[i], S_A[i], S_B[i], now, 0)
    end
    r = append_outcome(reply, r, algorithm, ok, remaining, reset, retry, delay, written)
  end
  if not admitted then
    for i = 1, n do
      r = append_state(reply, r, S_ALGORITHM[i], S1[i], S2[i], S3[i])
    end
  end
  return r, at
end

-- The specs of the n limits after `arg_at`, and the position after them; nil and an error for
-- an unknown one (or, with `batchable`, one that cannot run batched), found before a call that
-- writes as it goes changes anything.
local function specs_of(args, arg_at, n, batchable)
  local at = arg_at
  for _ = 1, n do
    local text = args[at + 1]
    local spec = SPECS[text] or parse_spec(text)
    if not spec then
      return nil, unknown(text)
    end
    if batchable and not spec[1].export then
      return nil, 'floodgate: ' .. spec[4] .. ' cannot run batched'
    end
    at = at + 2
    if spec[1].takes_token then
      at = at + 1
    end
  end
  return at
end

-- 'refund' and 'charge' of one decision: changes each limit, then reports it as it stands,
-- and its state.
local function adjust(keys, args, n, now, mode, reply, r)
  local valid, failure = specs_of(args, 2, n, false)
  if not valid then
    return nil, failure
  end
  reply[r + 1] = 0
  r = r + 1
  local at = 2
  for i = 1, n do
    local spec = SPECS[args[at + 1]] or parse_spec(args[at + 1])
    local algorithm, a, b = spec[1], spec[2], spec[3]
    local cost = NUMBERS[args[at + 2]] or parse_number(args[at + 2])
    local token = ''
    at = at + 2
    if algorithm.takes_token then
      at = at + 1
      token = args[at]
    end
    local key = keys[i]
    if mode == 'refund' then
      algorithm.refund(key, a, b, now, cost, token)
    elseif cost > 0 and spec[4] ~= 'concurrency' then
      local s1, s2, s3 = algorithm.load(key, now, b)
      algorithm.consume(key, s1, s2, s3, a, b, now, cost, token)
    end
    local s1, s2, s3 = algorithm.load(key, now, b)
    S_ALGORITHM[i], S1[i], S2[i], S3[i] = algorithm, s1, s2, s3
    local ok, remaining, reset, retry, delay = algorithm.evaluate(s1, s2, s3, a, b, now, 0)
    r = append_outcome(reply, r, algorithm, ok, remaining, reset, retry, delay, '')
  end
  for i = 1, n do
    r = append_state(reply, r, S_ALGORITHM[i], S1[i], S2[i], S3[i])
  end
  return r
end

-- 'sync' of one decision's limits: adds each cost, then reads the state back.
local function sync(keys, args, n, now, reply, r)
  local valid, failure = specs_of(args, 2, n, true)
  if not valid then
    return nil, failure
  end
  local at = 2
  for i = 1, n do
    local spec = SPECS[args[at + 1]] or parse_spec(args[at + 1])
    local algorithm, a, b = spec[1], spec[2], spec[3]
    local cost = NUMBERS[args[at + 2]] or parse_number(args[at + 2])
    at = at + 2
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

-- How long a node's trade record is kept (every trade renews it), and how many of its trades
-- it keeps: far longer than a call's answer can be late or its node take to ask again, and
-- more than one node's trades on one hash tag can be under way at once.
local TRADE_RECORD_MS = 60000
local TRADES_KEPT = 8

-- The states of the n limits after `at` as they stand, each after its grant from `grants`
-- (the units the first run of a trade granted, or none).
local function lease_states(keys, args, n, now, grants, reply, r)
  local at = 3
  for i = 1, n do
    local spec = SPECS[args[at + 1]]
    at = at + 5
    local s1, s2, s3 = spec[1].load(keys[i], now, spec[3])
    reply[r + 1] = grants and tonumber(grants[i]) or 0
    r = append_state(reply, r + 1, spec[1], s1, s2, s3)
  end
  return r
end

-- 'lease' (batched mode) of one call's limits: per limit its spec and four numbers: units
-- to give back (a lease's unused part), units wanted, units to charge unconditionally (a
-- node's post-charges beyond its lease), and for a window algorithm the start of the window the
-- given-back units were leased in (0: none, a bucket's). Given-back units are credited only to
-- the window they were leased in: a trade that reaches Redis after that window ended gives
-- nothing back (they were counted in a window that no longer counts). Grants at most what the
-- limit has left, consuming it (a lease is counted as used from the moment it is granted).
--
-- Applied at most once per trade: ARGV[3] is the trade's number on its node (increasing), and
-- the last KEY the node's trade record on the call's hash tag, a hash of the last
-- TRADES_KEPT trades applied through it: number -> "<time> <grant>...". A trade whose answer
-- was lost is asked again with its number: if the record holds it, the first run's grants are
-- answered (with its time, the window they belong to) and nothing is applied again. A number
-- the record does not hold, below every number of a full record, may have been applied and
-- dropped from it: it is not applied, and its grants are answered as none with time 0. Reply:
-- { now, granted at (now, the first run's, or 0), per limit: the units granted and its state }.
local function lease(keys, args, n, now, reply, r)
  n = n - 1
  local record_key = keys[n + 1]
  local trade_text = args[3]
  local trade = tonumber(trade_text)
  local at = 3
  for _ = 1, n do
    local text = args[at + 1]
    local spec = SPECS[text] or parse_spec(text)
    if not spec then
      return nil, unknown(text)
    end
    if not spec[1].export then
      return nil, 'floodgate: ' .. spec[4] .. ' cannot run batched'
    end
    at = at + 5
  end
  if not trade then
    return nil, 'floodgate: a lease trade without its number'
  end
  local recorded = redis.call('HGET', record_key, trade_text)
  if recorded then
    local recorded_at, recorded_grants = match(recorded, '^(%d+)(.*)$')
    local grants = {}
    for grant in string.gmatch(recorded_grants, '%d+') do
      grants[#grants + 1] = grant
    end
    if #grants ~= n then
      return nil, 'floodgate: a lease trade asked again with other limits'
    end
    reply[r + 1] = tonumber(recorded_at)
    return lease_states(keys, args, n, now, grants, reply, r + 1)
  end
  -- The lowest number a full record holds: it goes to make room for this trade.
  local lowest
  if redis.call('HLEN', record_key) >= TRADES_KEPT then
    for _, number in ipairs(redis.call('HKEYS', record_key)) do
      number = tonumber(number)
      if number and (not lowest or number < lowest) then
        lowest = number
      end
    end
    if lowest and trade < lowest then
      reply[r + 1] = 0
      return lease_states(keys, args, n, now, nil, reply, r + 1)
    end
  end
  reply[r + 1] = now
  r = r + 1
  local written = { format_int(now) }
  at = 3
  for i = 1, n do
    local spec = SPECS[args[at + 1]]
    local algorithm, a, b = spec[1], spec[2], spec[3]
    local give_back = NUMBERS[args[at + 2]] or parse_number(args[at + 2])
    local want = NUMBERS[args[at + 3]] or parse_number(args[at + 3])
    local charge = NUMBERS[args[at + 4]] or parse_number(args[at + 4])
    local leased_in = NUMBERS[args[at + 5]] or parse_number(args[at + 5])
    at = at + 5
    local key = keys[i]
    if charge > 0 then
      local s1, s2, s3 = algorithm.load(key, now, b)
      algorithm.consume(key, s1, s2, s3, a, b, now, charge, '')
    end
    if give_back > 0 and (leased_in == 0 or leased_in == (window_bounds(b, now))) then
      algorithm.refund(key, a, b, now, give_back, '')
    end
    local s1, s2, s3 = algorithm.load(key, now, b)
    local grant = 0
    if want > 0 then
      local _, remaining = algorithm.evaluate(s1, s2, s3, a, b, now, 0)
      grant = min(want, remaining)
      if grant > 0 then
        algorithm.consume(key, s1, s2, s3, a, b, now, grant, '')
        s1, s2, s3 = algorithm.load(key, now, b)
      end
    end
    written[#written + 1] = ' ' .. format_int(grant)
    reply[r + 1] = grant
    r = append_state(reply, r + 1, algorithm, s1, s2, s3)
  end
  redis.call('HSET', record_key, trade_text, table.concat(written))
  if lowest then
    redis.call('HDEL', record_key, format_int(lowest))
  end
  redis.call('PEXPIRE', record_key, TRADE_RECORD_MS)
  return r
end

-- Takes back a cost fixed_windows_at_once counted, by the text HINCRBY took (an integer's own
-- digits, so its opposite is '-' and them: exact at any size, where a Lua number is exact
-- below 2^53 only). A cost of 0 changed nothing, and '-0' is no integer to HINCRBY.
local function uncount(key, text)
  if text ~= '0' then
    redis.call('HINCRBY', key, 'c', '-' .. text)
  end
end

-- A decision of fixed windows only, decided without the general machinery of `decide` where
-- every limit admits. Each hash's window is read (`HGET f`: only a fixed window's hash has
-- it); a key without it whose window begins now must hold nothing at all (`HLEN` 0: no other
-- algorithm's state, no hash of a version before `f`). If every key is the current window's
-- or empty, each count is incremented (`HINCRBY`, which replies the count: it is never read or
-- parsed before). If a count then exceeds its limit, or `HINCRBY` refuses one (a count this
-- library did not write), every count this call incremented is decremented again, back to the
-- digits it had (Redis takes an integer only in its own digits). Last, each empty key begins
-- its window with the cost (`HSET`, then its expiry, as `fixed_window` writes it: a cost at
-- most the limit always fits). nil, with nothing changed, where a cost exceeds a limit, a
-- limit would deny, a key holds anything else, or a key comes twice: `decide` then decides it
-- in full (and replies with the states the deny cache needs), reading each hash again.
local function fixed_windows_at_once(keys, args, key_at, arg_at, n, now, reply, r)
  -- Every spec first: a decision that is not all fixed windows reads nothing here.
  local at = arg_at
  local fixed_window = ALGORITHMS.fixed_window
  for i = 1, n do
    local text = args[at + 1]
    local spec = SPECS[text] or parse_spec(text)
    if not spec or spec[1] ~= fixed_window then
      return nil
    end
    local key = keys[key_at + i]
    for j = 1, i - 1 do
      if keys[key_at + j] == key then
        return nil
      end
    end
    -- A cost above the limit is denied for good whatever the count: the general decision's
    -- (this also keeps every cost counted here below 2^53, as the limits are).
    local cost_text = args[at + 2]
    local cost = NUMBERS[cost_text] or parse_number(cost_text)
    if not cost or cost > spec[2] then
      return nil
    end
    -- The cost goes to HINCRBY as the caller wrote it: Redis formats a Lua number argument with
    -- printf, and takes a text as it is (refusing one that is no integer: then `decide`).
    S_SPEC[i], S_COST_TEXT[i], S_COST[i] = spec, cost_text, cost
    at = at + 2
  end
  for i = 1, n do
    local spec = S_SPEC[i]
    if now < spec[5] or now >= spec[7] then
      -- Not in the window this spec last met: the window `now` is in, and its start's text.
      local window_start, window_end = window_bounds(spec[3], now)
      spec[5], spec[6], spec[7] = window_start, format_int(window_start), window_end
    end
    -- `f`: the window a fixed window's hash counts, in the digits of format_int (see
    -- fixed_window.lua). A key of another type replies an error (a table), a hash without it
    -- false: neither is the window's text, nor a number.
    local key = keys[key_at + i]
    local stored = redis.pcall('HGET', key, 'f')
    local begins = false
    if stored ~= spec[6] and tonumber(stored) ~= spec[5] then
      -- `false`: a hash without `f`, or no key (HLEN tells which, and a hash cannot be
      -- another type's); an error: another type.
      if stored ~= false or redis.call('HLEN', key) ~= 0 then
        return nil
      end
      begins = true
    end
    S_BEGINS[i] = begins
    S_RESET[i] = spec[7] - now
  end
  for i = 1, n do
    if not S_BEGINS[i] then
      local key = keys[key_at + i]
      local count = redis.pcall('HINCRBY', key, 'c', S_COST_TEXT[i])
      local counted = type(count) == 'number'
      if not counted or count > S_SPEC[i][2] then
        if counted then
          uncount(key, S_COST_TEXT[i])
        end
        for j = 1, i - 1 do
          if not S_BEGINS[j] then
            uncount(keys[key_at + j], S_COST_TEXT[j])
          end
        end
        return nil
      end
      S_REMAINING[i] = S_SPEC[i][2] - count
    end
  end
  for i = 1, n do
    if S_BEGINS[i] then
      local spec, key = S_SPEC[i], keys[key_at + i]
      redis.call('HSET', key, 'w', spec[6], 'f', spec[6], 'c', S_COST[i])
      expire_after(key, spec[7] - now)
      S_REMAINING[i] = spec[2] - S_COST[i]
    end
  end
  reply[r + 1] = 1
  r = r + 1
  for i = 1, n do
    reply[r + 1], reply[r + 2], reply[r + 3] = S_REMAINING[i], S_RESET[i], -1
    r = r + 3
  end
  return r, at
end

-- A 'check' of one decision: by fixed_windows_at_once where it can, else in full.
local function check_one(keys, args, key_at, arg_at, n, now, reply, r)
  if SERVER_CLOCK then
    local fast_r, fast_at = fixed_windows_at_once(keys, args, key_at, arg_at, n, now, reply, r)
    if fast_r then
      return fast_r, fast_at
    end
  end
  return decide(keys, args, key_at, arg_at, n, now, true, reply, r)
end

-- The server clock's last whole second, as TIME gave it and in microseconds: most calls fall in
-- the second of the call before, and the text compares for less than it parses.
local clock_seconds_text, clock_seconds

local function floodgate_check(keys, args)
  if not floor then
    bind_globals()
  end
  local mode = args[1]
  local now
  SERVER_CLOCK = args[2] == ''
  if SERVER_CLOCK then
    local time = redis.call('TIME')
    local seconds = time[1]
    if seconds ~= clock_seconds_text then
      clock_seconds_text, clock_seconds = seconds, tonumber(seconds) * 1000000
    end
    now = clock_seconds + tonumber(time[2])
  else
    now = tonumber(args[2])
  end
  -- Sized for the common reply (one limit, admitted) at once.
  local reply = { now, 0, 0, 0, 0 }
  local r, failure = 1, nil
  local n = #keys
  if mode == 'check' or mode == 'peek' then
    if mode == 'check' then
      r, failure = check_one(keys, args, 0, 2, n, now, reply, r)
    else
      r, failure = decide(keys, args, 0, 2, n, now, false, reply, r)
    end
    if r then
      failure = nil
    end
  elseif mode == 'batch' then
    -- Each decision answers for itself, as if it had come alone: one that fails gets its error
    -- and the others are decided, the earlier ones keeping what they took (their callers are
    -- told). `decide` reads every limit's state before it writes any, so a decision that fails
    -- on a spec or a stored state has written nothing (only a write that Redis itself refuses,
    -- such as one beyond maxmemory, could fail halfway, as it would alone).
    local decisions = tonumber(args[3])
    local key_at, at = 0, 3
    for _ = 1, decisions do
      local limits, arguments = tonumber(args[at + 1]), tonumber(args[at + 2])
      local ran, decided, refusal =
        pcall(check_one, keys, args, key_at, at + 2, limits, now, reply, r)
      if ran and decided then
        r = decided
      else
        if not ran then
          -- What was raised: a message, or (from redis.call) a table with the message in `err`.
          refusal = type(decided) == 'table' and decided.err or decided
        end
        r = r + 1
        reply[r] = tostring(refusal)
      end
      key_at = key_at + limits
      at = at + 2 + arguments
    end
  elseif mode == 'sync' then
    r, failure = sync(keys, args, n, now, reply, r)
  elseif mode == 'lease' then
    r, failure = lease(keys, args, n, now, reply, r)
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
