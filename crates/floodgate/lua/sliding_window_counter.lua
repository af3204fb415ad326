-- sliding_window_counter: previous window's count weighted by its overlap with the trailing
-- window, plus the current count. The estimate is a double, computed with the same operations
-- in the same order as the Rust code. Hash: w (current window start), c (current), p (previous).

local function counter_load(key)
  local values = read_own('HMGET', key, 'w', 'c', 'p')
  if not values or not values[1] or not values[2] or not values[3] then
    return nil
  end
  return stored_number(values[1]), stored_number(values[2]), stored_number(values[3])
end

-- The counters as of `now`: window start, current and previous counts.
local function counter_rotate(state_start, current, previous, window, now)
  local window_start = now - now % window
  if state_start == window_start then
    return window_start, current, previous
  elseif state_start and state_start + window == window_start then
    return window_start, 0, current
  end
  return window_start, 0, 0
end

local function counter_estimate(window_start, current, previous, window, now)
  local elapsed = now - window_start
  return previous * ((window - elapsed) / window) + current
end

local function counter_remaining(limit, estimate)
  return max(floor(limit - estimate), 0)
end

local function counter_until_empty(window_start, current, previous, window, now)
  local elapsed = now - window_start
  if current > 0 then
    return 2 * window - elapsed
  elseif previous > 0 then
    return window - elapsed
  end
  return 0
end

local function counter_retry_after(window_start, current, previous, limit, window, now, cost)
  local elapsed = now - window_start
  local wait
  if current + cost <= limit then
    local spare = limit - current - cost
    local needed = (window - elapsed) - (spare * window) / previous
    wait = max(ceil(needed), 0)
  else
    local spare = limit - cost
    local needed = window - (spare * window) / current
    wait = (window - elapsed) + max(ceil(needed), 0)
  end
  for candidate = wait, wait + 15 do
    local later = now + candidate
    local s, c, p = counter_rotate(window_start, current, previous, window, later)
    if counter_estimate(s, c, p, window, later) + cost <= limit then
      return candidate
    end
  end
  return 2 * window - elapsed
end

ALGORITHMS.sliding_window_counter = {
  load = counter_load,

  evaluate = function(state_start, current, previous, limit, window, now, cost)
    local window_start
    window_start, current, previous = counter_rotate(state_start, current, previous, window, now)
    local estimate = counter_estimate(window_start, current, previous, window, now)
    if cost > limit then
      return 0,
        counter_remaining(limit, estimate),
        counter_until_empty(window_start, current, previous, window, now),
        -1,
        0
    end
    if estimate + cost <= limit then
      return 1,
        counter_remaining(limit, estimate + cost),
        counter_until_empty(window_start, current + cost, previous, window, now),
        -1,
        0
    end
    return 0,
      counter_remaining(limit, estimate),
      counter_until_empty(window_start, current, previous, window, now),
      counter_retry_after(window_start, current, previous, limit, window, now, cost),
      0
  end,

  consume = function(key, state_start, current, previous, _, window, now, cost)
    if not state_start then
      clear_foreign(key)
    end
    local window_start
    window_start, current, previous = counter_rotate(state_start, current, previous, window, now)
    redis.call('HSET', key, 'w', window_start, 'c', current + cost, 'p', previous)
    -- The key expires a window after its current one: by the server's clock, set when the
    -- current window begins.
    if state_start ~= window_start or not SERVER_CLOCK then
      expire_after(key, window_start + 2 * window - now)
    end
  end,

  refund = function(key, _, window, now, cost)
    local state_start, current = counter_load(key)
    if state_start and state_start == now - now % window then
      redis.call('HSET', key, 'c', max(0, current - cost))
    end
  end,

  export = function(state_start, current, previous)
    return state_start, current, previous
  end,
}
