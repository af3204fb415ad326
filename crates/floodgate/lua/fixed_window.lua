-- fixed_window: at most `limit` per window, windows aligned to multiples of `window` since the
-- epoch, or the periods of a calendar (`calendar_window`: `window` is then a table of
-- boundaries; see window_bounds). Hash: w (window start), c (count), and f (the window start
-- again, under a name no other algorithm writes: check.lua's fixed_windows_at_once reads it
-- alone to know a hash as the current window's, where `w` would need `p` read too). Where f is
-- not w (a hash of a version before f, or whose window such a version began), the next count
-- written by a decision here sets it (a refund writes `c` alone): until then every node counts
-- on `w` and `c` alike.

local function fixed_window_load(key)
  -- A sliding window counter's hash has 'p' as well: not this algorithm's state.
  local values = read_own('HMGET', key, 'w', 'c', 'p', 'f')
  if not values or not values[1] or not values[2] or values[3] then
    return nil
  end
  -- The third value: whether `f` holds the window `w` does (both are written as one text), to
  -- be kept as it is; the state exported is w and c alone.
  return stored_number(values[1]), stored_number(values[2]), values[4] == values[1]
end

-- The current window's start and end, and its count so far.
local function fixed_window_current(state_start, count, window, now)
  local window_start, window_end = window_bounds(window, now)
  if state_start ~= window_start then
    count = 0
  end
  return window_start, count, window_end
end

ALGORITHMS.fixed_window = {
  load = fixed_window_load,

  evaluate = function(state_start, count, _, limit, window, now, cost)
    local _, current, window_end = fixed_window_current(state_start, count, window, now)
    count = current
    local until_next_window = window_end - now
    local remaining = limit - min(count, limit)
    if cost > limit then
      return 0, remaining, until_next_window, -1, 0
    end
    if cost <= remaining then
      return 1, remaining - cost, until_next_window, -1, 0
    end
    return 0, remaining, until_next_window, until_next_window, 0
  end,

  consume = function(key, state_start, count, f_is_w, _, window, now, cost)
    if not state_start then
      clear_foreign(key)
    end
    local window_start, window_end
    window_start, count, window_end = fixed_window_current(state_start, count, window, now)
    if state_start == window_start and f_is_w then
      -- Within the stored window, 'w' and 'f' already hold its start: the count alone changes
      -- (two fields less, and no window start to format).
      redis.call('HSET', key, 'c', count + cost)
    else
      local start_text = format_int(window_start)
      redis.call('HSET', key, 'w', start_text, 'f', start_text, 'c', count + cost)
    end
    -- The key expires with its window: by the server's clock, set when the window begins.
    if state_start ~= window_start or not SERVER_CLOCK then
      expire_after(key, window_end - now)
    end
  end,

  refund = function(key, _, window, now, cost)
    local state_start, count = fixed_window_load(key)
    if state_start and state_start == (window_bounds(window, now)) then
      redis.call('HSET', key, 'c', max(0, count - cost))
    end
  end,

  export = function(state_start, count)
    return state_start, count, 0
  end,
}

-- A fixed window on the calendar: the same counting, over the periods its spec's boundaries
-- delimit.
ALGORITHMS.calendar_window = ALGORITHMS.fixed_window
