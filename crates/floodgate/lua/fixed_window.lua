-- fixed_window: at most `limit` per window, windows aligned to multiples of `window` since the
-- epoch. Hash: w (window start), c (count).

local function fixed_window_current(state, p, now)
  local window_start = now - now % p.window
  local count = 0
  if state and state.window_start == window_start then
    count = state.count
  end
  return window_start, count
end

ALGORITHMS.fixed_window = {
  load = function(key)
    -- A sliding window counter's hash has 'p' as well: not this algorithm's state.
    local values = read_own('HMGET', key, 'w', 'c', 'p')
    if not values or not values[1] or not values[2] or values[3] then
      return nil
    end
    return { window_start = tonumber(values[1]), count = tonumber(values[2]) }
  end,

  evaluate = function(state, p, now, cost)
    local window_start, count = fixed_window_current(state, p, now)
    local until_next_window = window_start + p.window - now
    local remaining = p.limit - min(count, p.limit)
    if cost > p.limit then
      return never(remaining, until_next_window)
    end
    if cost <= remaining then
      return allowed(remaining - cost, until_next_window)
    end
    return denied(remaining, until_next_window, until_next_window)
  end,

  consume = function(key, state, p, now, cost)
    local window_start, count = fixed_window_current(state, p, now)
    if not state then
      clear_foreign(key)
    end
    redis.call('HSET', key, 'w', window_start, 'c', count + cost)
    expire_after(key, window_start + p.window - now)
  end,

  refund = function(key, p, now, cost)
    local state = ALGORITHMS.fixed_window.load(key)
    if state and state.window_start == now - now % p.window then
      redis.call('HSET', key, 'c', max(0, state.count - cost))
    end
  end,

  export = function(state)
    return { state.window_start, state.count, 0 }
  end,
}
