-- gcra: one theoretical arrival time (TAT) per key; admitted if the TAT it leaves behind is
-- within `burst` emission intervals of now. String: the TAT, digits only (a leaky bucket's
-- departure time is prefixed, so the two never read each other's state).

ALGORITHMS.gcra = {
  load = function(key)
    local tat = read_own('GET', key)
    if not tat or not string.match(tat, '^%-?%d+$') then
      return nil
    end
    return { tat = tonumber(tat) }
  end,

  evaluate = function(state, p, now, cost)
    local emission = p.emission
    local tolerance = p.burst * emission
    local tat = now
    if state then
      tat = max(state.tat, now)
    end
    local backlog = tat - now
    -- A batched sync can leave the TAT beyond the tolerance (a debt): nothing remains then.
    local spare = max(0, tolerance - backlog)
    if cost > p.burst then
      return never(floor(spare / emission), backlog)
    end
    local backlog_after = backlog + cost * emission
    if backlog_after <= tolerance then
      return allowed(floor((tolerance - backlog_after) / emission), backlog_after)
    end
    return denied(floor(spare / emission), backlog, backlog_after - tolerance)
  end,

  consume = function(key, state, p, now, cost)
    local tat = now
    if state then
      tat = max(state.tat, now)
    end
    tat = tat + cost * p.emission
    redis.call('SET', key, format_int(tat))
    expire_after(key, tat - now)
  end,

  refund = function(key, p, now, cost)
    local state = ALGORITHMS.gcra.load(key)
    if state then
      redis.call('SET', key, format_int(state.tat - cost * p.emission), 'KEEPTTL')
    end
  end,

  export = function(state)
    return { state.tat, 0, 0 }
  end,
}
