-- token_bucket: capacity `burst`, refilled continuously at `limit / window`. The level is credit
-- time (tokens x emission interval), so refill is plain elapsed time. Hash: l (level), u (updated).

local function token_bucket_load(key)
  local values = read_own('HMGET', key, 'l', 'u')
  if not values or not values[1] or not values[2] then
    return nil
  end
  return stored_number(values[1]), stored_number(values[2])
end

-- The level now: full for a fresh key, else refilled since `updated`.
local function token_bucket_level(level, updated, full, now)
  if not level then
    return full
  end
  return min(full, level + max(0, now - updated))
end

ALGORITHMS.token_bucket = {
  load = token_bucket_load,

  evaluate = function(level, updated, _, burst, emission, now, cost)
    local full = burst * emission
    -- Refill starts again only at `updated`: a batched debt (or a clock that stepped back) puts
    -- it in the future, and every wait starts with it.
    local debt = 0
    if level then
      debt = max(0, updated - now)
    end
    level = token_bucket_level(level, updated, full, now)
    if cost > burst then
      return 0, floor(level / emission), debt + full - level, -1, 0
    end
    local needed = cost * emission
    if needed <= level then
      local after = level - needed
      return 1, floor(after / emission), debt + full - after, -1, 0
    end
    return 0, floor(level / emission), debt + full - level, debt + needed - level, 0
  end,

  consume = function(key, level, updated, _, burst, emission, now, cost)
    local full = burst * emission
    local after = token_bucket_level(level, updated, full, now) - cost * emission
    if level then
      updated = max(updated, now)
    else
      updated = now
      clear_foreign(key)
    end
    level = after
    if level < 0 then
      -- Only a batched sync charges more than the level (units other nodes already admitted):
      -- the debt is kept as refill time still to come, so the bucket stays empty until paid.
      updated = updated - level
      level = 0
    end
    redis.call('HSET', key, 'l', level, 'u', updated)
    expire_after(key, updated + (full - level) - now)
  end,

  -- As Rust's `unconsume`: a debt (refill still to come, `updated` in the future) is paid back
  -- first, by moving `updated` back toward now, and only the rest refills the level. Added to
  -- the level alone, a give-back into a bucket in debt would be spendable at once here, while
  -- every batched node's copy still waits for the debt, and the two would disagree. (Where
  -- there is no debt the two are the same; the key's TTL, set for the later `updated`, may
  -- outlive its state's return to full, which reads as full all the same.)
  refund = function(key, burst, emission, now, cost)
    local level, updated = token_bucket_load(key)
    if level then
      local credit = cost * emission
      local debt = min(max(0, updated - now), credit)
      redis.call('HSET', key, 'l', min(burst * emission, level + credit - debt), 'u', updated - debt)
    end
  end,

  export = function(level, updated)
    return level, updated, 0
  end,
}
