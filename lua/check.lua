-- The entry point: checks, and consumes from, every limit of one call atomically.
--
-- KEYS: one per limit (all on one hash slot in Redis Cluster).
-- ARGV[1]: mode: 'check' (all-or-nothing) or 'refund' (give back what a 'check' took).
-- ARGV[2]: now in microseconds, or '' to use the server's clock (TIME), so that gateways with
--          skewed clocks agree.
-- Then 7 values per limit: algorithm, limit, window, burst, emission, cost, and a token: the
-- lease id to take ('check' of concurrency) or what to give back ('refund' of the logs).
--
-- Reply to 'check': { now, admitted, then per limit: allowed, remaining, reset_after,
-- retry_after (-1: none), delay, token }. Reply to 'refund': { now, then per limit the same
-- five outcome fields as evaluated after the refund, without charge, and '' }.

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
