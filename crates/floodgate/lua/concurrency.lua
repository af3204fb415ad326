-- concurrency: at most `limit` units in flight. Sorted set of leases: score = expiry,
-- member = "<lease id>:<cost>". Released by ZREM when the response ends; expired otherwise.

-- nil for a member of another shape (a log entry is "<at>:<cost>:<sequence>").
local function parse_lease(member, expires_at)
  local cost = match(member, '^%d+:(%d+)$')
  if not cost then
    return nil
  end
  return { expires_at = tonumber(expires_at), cost = tonumber(cost) }
end

ALGORITHMS.concurrency = {
  takes_token = true,

  -- Only the live leases, earliest expiry first. Another algorithm's state reads as no
  -- leases, marked `foreign` (older members of any shape are trimmed by the next admission).
  load = function(key, now)
    local flat = read_own('ZRANGEBYSCORE', key, '(' .. format_int(now), '+inf', 'WITHSCORES')
    if not flat then
      return { foreign = true }
    end
    local leases = {}
    for i = 1, #flat, 2 do
      local lease = parse_lease(flat[i], flat[i + 1])
      if not lease then
        return { foreign = true }
      end
      leases[#leases + 1] = lease
    end
    return leases
  end,

  evaluate = function(leases, _, _, limit, window, now, cost)
    local in_flight = 0
    local until_all_expired = 0
    for i = 1, #leases do
      in_flight = in_flight + leases[i].cost
      until_all_expired = max(until_all_expired, leases[i].expires_at - now)
    end
    local remaining = max(0, limit - in_flight)
    if cost > limit then
      return 0, remaining, until_all_expired, -1, 0
    end
    if cost <= remaining then
      return 1, remaining - cost, window, -1, 0
    end
    local freed = 0
    for i = 1, #leases do
      freed = freed + leases[i].cost
      if in_flight - freed + cost <= limit then
        return 0, remaining, until_all_expired, leases[i].expires_at - now, 0
      end
    end
    return 0, remaining, until_all_expired, until_all_expired, 0
  end,

  consume = function(key, leases, _, _, _, window, now, cost, token)
    if leases.foreign then
      clear_foreign(key)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', format_int(now))
    local member = token .. ':' .. format_int(cost)
    redis.call('ZADD', key, format_int(now + window), member)
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    expire_after(key, tonumber(newest[2]) - now)
    return member
  end,

  refund = function(key, _, _, _, _, token)
    redis.pcall('ZREM', key, token)
  end,
}
