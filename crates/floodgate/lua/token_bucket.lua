-- token_bucket: capacity `burst`, refilled continuously at `limit / window`. The level is credit
-- time (tokens x emission interval), so refill is plain elapsed time. Hash: l (level), u (updated).

local function token_bucket_level(state, p, now)
  local full = p.burst * p.emission
  if not state then
    return full
  end
  return min(full, state.level + max(0, now - state.updated))
end

ALGORITHMS.token_bucket = {
  load = function(key)
    local values = read_own('HMGET', key, 'l', 'u')
    if not values or not values[1] or not values[2] then
      return nil
    end
    return { level = tonumber(values[1]), updated = tonumber(values[2]) }
  end,

  evaluate = function(state, p, now, cost)
    local emission = p.emission
    local full = p.burst * emission
    local level = token_bucket_level(state, p, now)
    -- Refill starts again only at `updated`: a batched debt (or a clock that stepped back) puts
    -- it in the future, and every wait starts with it.
    local debt = 0
    if state then
      debt = max(0, state.updated - now)
    end
    if cost > p.burst then
      return never(floor(level / emission), debt + full - level)
    end
    local needed = cost * emission
    if needed <= level then
      local after = level - needed
      return allowed(floor(after / emission), debt + full - after)
    end
    return denied(floor(level / emission), debt + full - level, debt + needed - level)
  end,

  consume = function(key, state, p, now, cost)
    local level = token_bucket_level(state, p, now) - cost * p.emission
    local updated = now
    if state then
      updated = max(state.updated, now)
    end
    if not state then
      clear_foreign(key)
    end
    if level < 0 then
      -- Only a batched sync charges more than the level (units other nodes already admitted):
      -- the debt is kept as refill time still to come, so the bucket stays empty until paid.
      updated = updated - level
      level = 0
    end
    redis.call('HSET', key, 'l', level, 'u', updated)
    expire_after(key, updated + (p.burst * p.emission - level) - now)
  end,

  refund = function(key, p, now, cost)
    local state = ALGORITHMS.token_bucket.load(key)
    if state then
      local level = min(p.burst * p.emission, state.level + cost * p.emission)
      redis.call('HSET', key, 'l', level)
    end
  end,

  export = function(state)
    return { state.level, state.updated, 0 }
  end,
}
