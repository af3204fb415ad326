-- sliding_window_log: at most `limit` units in any trailing window. Sorted set of admitted
-- requests: score = admission time, member = "<at>:<cost>:<id>". The id is the random token the
-- caller sends ('check' mode), so that two entries at one instant never share a member (the
-- log's size is no id: a refund can remove an entry older than the newest); without one, the
-- log's size. An entry admitted at `at` counts while at + window > now.

-- nil for a member of another shape (a concurrency lease is "<id>:<cost>").
local function parse_log_entry(member)
  local at, cost = match(member, '^(%d+):(%d+):%d+$')
  if not at then
    return nil
  end
  return { at = tonumber(at), cost = tonumber(cost) }
end

ALGORITHMS.sliding_window_log = {
  takes_token = true,

  -- Only the live entries, oldest first. Another algorithm's state reads as an empty log
  -- marked `foreign` (older entries of any shape are trimmed by the next admission).
  load = function(key, now, window)
    local members = read_own('ZRANGEBYSCORE', key, '(' .. format_int(now - window), '+inf')
    if not members then
      return { foreign = true }
    end
    local entries = {}
    for i = 1, #members do
      entries[i] = parse_log_entry(members[i])
      if not entries[i] then
        return { foreign = true }
      end
    end
    return entries
  end,

  evaluate = function(entries, _, _, limit, window, now, cost)
    local used = 0
    for i = 1, #entries do
      used = used + entries[i].cost
    end
    local remaining = max(0, limit - used)
    local until_empty = 0
    if #entries > 0 then
      until_empty = entries[#entries].at + window - now
    end
    if cost > limit then
      return 0, remaining, until_empty, -1, 0
    end
    if cost <= remaining then
      return 1, remaining - cost, window, -1, 0
    end
    local freed = 0
    for i = 1, #entries do
      freed = freed + entries[i].cost
      if used - freed + cost <= limit then
        return 0, remaining, until_empty, entries[i].at + window - now, 0
      end
    end
    return 0, remaining, until_empty, until_empty, 0
  end,

  consume = function(key, entries, _, _, _, window, now, cost, token)
    if entries.foreign then
      clear_foreign(key)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', format_int(now - window))
    -- Keep the log sorted even if the clock stepped back.
    local at = now
    local newest = redis.call('ZRANGE', key, -1, -1)
    if newest[1] then
      at = max(parse_log_entry(newest[1]).at, now)
    end
    local id = token
    if id == '' then
      id = format_int(redis.call('ZCARD', key))
    end
    local member = format_int(at) .. ':' .. format_int(cost) .. ':' .. id
    redis.call('ZADD', key, format_int(at), member)
    expire_after(key, at + window - now)
    return member
  end,

  refund = function(key, _, _, _, _, token)
    redis.pcall('ZREM', key, token)
  end,
}
