-- leaky_bucket: requests leave at `limit / window`; a request waits for those ahead of it and is
-- rejected if that wait exceeds `burst` emission intervals. String: 'L' and the next free
-- departure (the prefix tells it from a GCRA's TAT, which is digits only).

local function leaky_value(next_free)
  return 'L' .. format_int(next_free)
end

local function leaky_admissible(burst, emission, backlog)
  local max_wait = burst * emission
  if backlog > max_wait then
    return 0
  end
  return floor((max_wait - backlog) / emission) + 1
end

local function leaky_load(key)
  local value = read_own('GET', key)
  local next_free = value and match(value, '^L(%-?%d+)$')
  if not next_free then
    return nil
  end
  return tonumber(next_free)
end

ALGORITHMS.leaky_bucket = {
  delays = true,

  load = leaky_load,

  evaluate = function(next_free, _, _, burst, emission, now, cost)
    local departure = now
    if next_free then
      departure = max(next_free, now)
    end
    local wait = departure - now
    if cost > burst then
      return 0, leaky_admissible(burst, emission, wait), wait, -1, 0
    end
    local max_wait = burst * emission
    if wait <= max_wait then
      local backlog_after = wait + cost * emission
      return 1, leaky_admissible(burst, emission, backlog_after), backlog_after, -1, wait
    end
    return 0, 0, wait, wait - max_wait, 0
  end,

  consume = function(key, next_free, _, _, _, emission, now, cost)
    local departure = now
    if next_free then
      departure = max(next_free, now)
    end
    next_free = departure + cost * emission
    redis.call('SET', key, leaky_value(next_free), 'PX', ttl_ms(next_free - now))
  end,

  refund = function(key, _, emission, _, cost)
    local next_free = leaky_load(key)
    if next_free then
      redis.call('SET', key, leaky_value(next_free - cost * emission), 'KEEPTTL')
    end
  end,
}
