-- gcra: one theoretical arrival time (TAT) per key; admitted if the TAT it leaves behind is
-- within `burst` emission intervals of now. String: the TAT, digits only (a leaky bucket's
-- departure time is prefixed with 'L', which no number has, so the two never read each other's
-- state; a hash or a sorted set reads as absent).

local function gcra_load(key)
  local tat = redis.pcall('GET', key)
  if type(tat) ~= 'string' then
    return nil
  end
  return tonumber(tat)
end

ALGORITHMS.gcra = {
  load = gcra_load,

  evaluate = function(tat, _, _, burst, emission, now, cost)
    local tolerance = burst * emission
    if not tat or tat < now then
      tat = now
    end
    local backlog = tat - now
    -- A batched sync can leave the TAT beyond the tolerance (a debt): nothing remains then.
    local spare = max(0, tolerance - backlog)
    if cost > burst then
      return 0, floor(spare / emission), backlog, -1, 0
    end
    local backlog_after = backlog + cost * emission
    if backlog_after <= tolerance then
      return 1, floor((tolerance - backlog_after) / emission), backlog_after, -1, 0
    end
    return 0, floor(spare / emission), backlog, backlog_after - tolerance, 0
  end,

  consume = function(key, tat, _, _, _, emission, now, cost)
    if not tat or tat < now then
      tat = now
    end
    tat = tat + cost * emission
    redis.call('SET', key, tat, 'PX', ttl_ms(tat - now))
  end,

  refund = function(key, _, emission, _, cost)
    local tat = gcra_load(key)
    if tat then
      redis.call('SET', key, tat - cost * emission, 'KEEPTTL')
    end
  end,

  export = function(tat)
    return tat, 0, 0
  end,
}
