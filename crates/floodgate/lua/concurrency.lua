-- concurrency: at most `limit` units in flight. Sorted set of leases: score = expiry,
-- member = "<lease id>:<cost>". Released by ZREM when the response ends; expired otherwise.

-- nil for a member of another shape (a log entry is "<at>:<cost>:<sequence>").
local function parse_lease(member, expires_at)
  local cost = string.match(member, '^%d+:(%d+)$')
  if not cost then
    return nil
  end
  return { expires_at = tonumber(expires_at), cost = tonumber(cost) }
end

ALGORITHMS.concurrency = {
  -- Only the live leases, earliest expiry first. Another algorithm's state reads as no
  -- leases, marked `foreign` (older members of any shape are trimmed by the next admission).
  load = function(key, p, now)
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

  evaluate = function(leases, p, now, cost)
    local in_flight = 0
    local until_all_expired = 0
    for i = 1, #leases do
      in_flight = in_flight + leases[i].cost
      until_all_expired = max(until_all_expired, leases[i].expires_at - now)
    end
    local remaining = max(0, p.limit - in_flight)
    if cost > p.limit then
      return never(remaining, until_all_expired)
    end
    if cost <= remaining then
      return allowed(remaining - cost, p.window)
    end
    local freed = 0
    for i = 1, #leases do
      freed = freed + leases[i].cost
      if in_flight - freed + cost <= p.limit then
        return denied(remaining, until_all_expired, leases[i].expires_at - now)
      end
    end
    return denied(remaining, until_all_expired, until_all_expired)
  end,

  consume = function(key, leases, p, now, cost)
    if leases.foreign then
      clear_foreign(key)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', format_int(now))
    local member = p.lease .. ':' .. format_int(cost)
    redis.call('ZADD', key, format_int(now + p.window), member)
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    expire_after(key, tonumber(newest[2]) - now)
    return member
  end,

  refund = function(key, p, now, cost, token)
    redis.pcall('ZREM', key, token)
  end,
}
