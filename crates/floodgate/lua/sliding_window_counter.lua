-- sliding_window_counter: previous window's count weighted by its overlap with the trailing
-- window, plus the current count. The estimate is a double, computed with the same operations
-- in the same order as the Rust code. Hash: w (current window start), c (current), p (previous).

local function counter_rotate(state, p, now)
  local window = p.window
  local window_start = now - now % window
  local current, previous = 0, 0
  if state then
    if state.window_start == window_start then
      current, previous = state.current, state.previous
    elseif state.window_start + window == window_start then
      current, previous = 0, state.current
    end
  end
  return { window_start = window_start, current = current, previous = previous }
end

local function counter_estimate(counters, p, now)
  local window = p.window
  local elapsed = now - counters.window_start
  return counters.previous * ((window - elapsed) / window) + counters.current
end

local function counter_admits(counters, p, now, cost)
  return counter_estimate(counters, p, now) + cost <= p.limit
end

local function counter_remaining(p, estimate)
  return max(floor(p.limit - estimate), 0)
end

local function counter_until_empty(counters, p, now)
  local window = p.window
  local elapsed = now - counters.window_start
  if counters.current > 0 then
    return 2 * window - elapsed
  elseif counters.previous > 0 then
    return window - elapsed
  end
  return 0
end

local function counter_retry_after(counters, p, now, cost)
  local window = p.window
  local elapsed = now - counters.window_start
  local wait
  if counters.current + cost <= p.limit then
    local spare = p.limit - counters.current - cost
    local needed = (window - elapsed) - (spare * window) / counters.previous
    wait = max(math.ceil(needed), 0)
  else
    local spare = p.limit - cost
    local needed = window - (spare * window) / counters.current
    wait = (window - elapsed) + max(math.ceil(needed), 0)
  end
  for candidate = wait, wait + 15 do
    local later = now + candidate
    if counter_admits(counter_rotate(counters, p, later), p, later, cost) then
      return candidate
    end
  end
  return 2 * window - elapsed
end

ALGORITHMS.sliding_window_counter = {
  load = function(key)
    local values = read_own('HMGET', key, 'w', 'c', 'p')
    if not values or not values[1] or not values[2] or not values[3] then
      return nil
    end
    return {
      window_start = tonumber(values[1]),
      current = tonumber(values[2]),
      previous = tonumber(values[3]),
    }
  end,

  evaluate = function(state, p, now, cost)
    local counters = counter_rotate(state, p, now)
    local estimate = counter_estimate(counters, p, now)
    if cost > p.limit then
      return never(counter_remaining(p, estimate), counter_until_empty(counters, p, now))
    end
    if counter_admits(counters, p, now, cost) then
      local after = {
        window_start = counters.window_start,
        current = counters.current + cost,
        previous = counters.previous,
      }
      return allowed(counter_remaining(p, estimate + cost), counter_until_empty(after, p, now))
    end
    return denied(
      counter_remaining(p, estimate),
      counter_until_empty(counters, p, now),
      counter_retry_after(counters, p, now, cost)
    )
  end,

  consume = function(key, state, p, now, cost)
    local counters = counter_rotate(state, p, now)
    if not state then
      clear_foreign(key)
    end
    redis.call('HSET', key, 'w', counters.window_start, 'c', counters.current + cost, 'p', counters.previous)
    expire_after(key, counters.window_start + 2 * p.window - now)
  end,

  refund = function(key, p, now, cost)
    local state = ALGORITHMS.sliding_window_counter.load(key)
    if state and state.window_start == now - now % p.window then
      redis.call('HSET', key, 'c', max(0, state.current - cost))
    end
  end,

  export = function(state)
    return { state.window_start, state.current, state.previous }
  end,
}
