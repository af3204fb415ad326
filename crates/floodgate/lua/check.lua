-- The entry point: checks, and consumes from, every limit of one call atomically.
--
-- KEYS: one per limit (all on one hash slot in Redis Cluster).
-- ARGV[1]: mode: 'check' (all-or-nothing), 'refund' (give back what a 'check' took), 'peek'
--          (evaluate at the request's cost and consume nothing: limits on slots after one that
--          denied, and operators inspecting a client), 'charge' (add each cost
--          unconditionally: a post-charge once the response told the request's real cost; never
--          denies, may leave debt; concurrency limits are skipped), or 'sync' (batched mode:
--          add what a node admitted locally, unconditionally, and read back the state every
--          node contributed to).
-- ARGV[2]: now in microseconds, or '' to use the server's clock (TIME), so that gateways with
--          skewed clocks agree.
-- Then 7 values per limit: algorithm, limit, window, burst, emission, cost, and a token: the
-- random id of the lease or log entry to take ('check' of concurrency and of the logs), or
-- what to give back ('refund' of both).
--
-- Reply to 'check' (and 'peek', never admitted): { now, admitted, then per limit: allowed,
-- remaining, reset_after, retry_after (-1: none), delay, token }. Reply to 'refund': { now,
-- then per limit the same five outcome fields as evaluated after the refund, without charge,
-- and '' }. Reply to 'charge': the same as to 'refund', evaluated after the charge. Reply to
-- 'sync' (cost: the units to add): { now, then per limit: present (0/1) and
-- three state fields }.

local PER_LIMIT = 7
local mode = ARGV[1]
local now = tonumber(ARGV[2])
if not now then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end

local params = {}
for i = 1, #KEYS do
  local base = 2 + (i - 1) * PER_LIMIT
  local p = {
    algorithm = ARGV[base + 1],
    limit = tonumber(ARGV[base + 2]),
    window = tonumber(ARGV[base + 3]),
    burst = tonumber(ARGV[base + 4]),
    emission = tonumber(ARGV[base + 5]),
    cost = tonumber(ARGV[base + 6]),
    token = ARGV[base + 7],
    lease = ARGV[base + 7],
  }
  if not ALGORITHMS[p.algorithm] then
    return redis.error_reply('floodgate: unknown algorithm ' .. tostring(p.algorithm))
  end
  params[i] = p
end

local function append(reply, outcome, token)
  for j = 1, 5 do
    reply[#reply + 1] = outcome[j]
  end
  reply[#reply + 1] = token
end

if mode == 'sync' then
  local reply = { now }
  for i = 1, #KEYS do
    local p = params[i]
    local algorithm = ALGORITHMS[p.algorithm]
    if not algorithm.export then
      return redis.error_reply('floodgate: ' .. p.algorithm .. ' cannot run batched')
    end
    local state = algorithm.load(KEYS[i], p, now)
    if p.cost > 0 then
      algorithm.consume(KEYS[i], state, p, now, p.cost)
      state = algorithm.load(KEYS[i], p, now)
    end
    if state then
      local fields = algorithm.export(state)
      reply[#reply + 1] = 1
      for j = 1, 3 do
        reply[#reply + 1] = fields[j]
      end
    else
      for _ = 1, 4 do
        reply[#reply + 1] = 0
      end
    end
  end
  return reply
end

if mode == 'charge' then
  local reply = { now, 0 }
  for i = 1, #KEYS do
    local p = params[i]
    local algorithm = ALGORITHMS[p.algorithm]
    if p.cost > 0 and p.algorithm ~= 'concurrency' then
      algorithm.consume(KEYS[i], algorithm.load(KEYS[i], p, now), p, now, p.cost)
    end
    append(reply, algorithm.evaluate(algorithm.load(KEYS[i], p, now), p, now, 0), '')
  end
  return reply
end

if mode == 'refund' then
  local reply = { now, 0 }
  for i = 1, #KEYS do
    local p = params[i]
    local algorithm = ALGORITHMS[p.algorithm]
    algorithm.refund(KEYS[i], p, now, p.cost, p.token)
    append(reply, algorithm.evaluate(algorithm.load(KEYS[i], p, now), p, now, 0), '')
  end
  return reply
end

local states, outcomes = {}, {}
local admitted = true
for i = 1, #KEYS do
  local p = params[i]
  local algorithm = ALGORITHMS[p.algorithm]
  states[i] = algorithm.load(KEYS[i], p, now)
  outcomes[i] = algorithm.evaluate(states[i], p, now, p.cost)
  if outcomes[i][1] == 0 then
    admitted = false
  end
end

if mode == 'peek' then
  admitted = false
end

local reply = { now, admitted and 1 or 0 }
for i = 1, #KEYS do
  local p = params[i]
  local algorithm = ALGORITHMS[p.algorithm]
  local token = ''
  if admitted then
    token = algorithm.consume(KEYS[i], states[i], p, now, p.cost) or ''
  elseif outcomes[i][1] == 1 then
    -- Not charged, since another limit denied: report it as it stands.
    outcomes[i] = algorithm.evaluate(states[i], p, now, 0)
  end
  append(reply, outcomes[i], token)
end
return reply
