-- leaky_bucket: requests leave at `limit / window`; a request waits for those ahead of it and is
-- rejected if that wait exceeds `burst` emission intervals. String: 'L' and the next free
-- departure (the prefix tells it from a GCRA's TAT, which is digits only).

local function leaky_value(next_free)
  return 'L' .. format_int(next_free)
end

local function leaky_admissible(p, backlog)
  local max_wait = p.burst * p.emission
  if backlog > max_wait then
    return 0
  end
  return floor((max_wait - backlog) / p.emission) + 1
end

ALGORITHMS.leaky_bucket = {
  load = function(key)
    local value = read_own('GET', key)
    local next_free = value and string.match(value, '^L(%-?%d+)$')
    if not next_free then
      return nil
    end
    return { next_free = tonumber(next_free) }
  end,

  evaluate = function(state, p, now, cost)
    local departure = now
    if state then
      departure = max(state.next_free, now)
    end
    local wait = departure - now
    if cost > p.burst then
      return never(leaky_admissible(p, wait), wait)
    end
    local max_wait = p.burst * p.emission
    if wait <= max_wait then
      local backlog_after = wait + cost * p.emission
      local outcome = allowed(leaky_admissible(p, backlog_after), backlog_after)
      outcome[5] = wait
      return outcome
    end
    return denied(0, wait, wait - max_wait)
  end,

  consume = function(key, state, p, now, cost)
    local departure = now
    if state then
      departure = max(state.next_free, now)
    end
    local next_free = departure + cost * p.emission
    redis.call('SET', key, leaky_value(next_free))
    expire_after(key, next_free - now)
  end,

  refund = function(key, p, now, cost)
    local state = ALGORITHMS.leaky_bucket.load(key)
    if state then
      redis.call('SET', key, leaky_value(state.next_free - cost * p.emission), 'KEEPTTL')
    end
  end,
}
