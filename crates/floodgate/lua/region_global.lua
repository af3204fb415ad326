-- Regions trading their shares of each limit in the global store (floodgate_region_trade).
--
-- A region may use its fixed share of a limit (`limit / regions`, at least 1) without asking.
-- A record (one hash per limit key, one field per region: "share,ends_ms,want") says otherwise
-- until it ends: a share below the fixed one is a region's promise to stay under it (it
-- lends), one above is a grant (it borrows). A grant never makes the shares of all regions
-- exceed the limit (every region without a live record counted at its fixed share) and ends
-- no later than the promises it borrows from; when regions want more than the limit holds,
-- each gets a max-min fair part of it (its `cap`), and a region holding more than its part
-- lowers itself before saying so.
--
-- KEYS: the record of each item, then the pressure set (a sorted set of "<limit key> <spec>"
-- for the keys some region wanted more of than it got, scored by when).
-- ARGV: this region, the regions (comma-separated), the lifetime of a record (ms), the
-- trade's deadline by this server's clock (ms; 0: none; a trade that arrives later is stale
-- and changes nothing), the number of items; then per item its limit key, its spec (to tell
-- lending regions what the limit is), the limit, the most this region may have in force now
-- (`report`) and the share it wants.
-- Reply: { now_ms, 'ok' | 'stale', per item: grant, ms until a grant above the fixed share
-- ends (0 if none), cap; then the pressured keys and their specs, in pairs }.

local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- The level of a max-min fair split of `limit` among `wants`: every want at or under it is
-- met, the others get it.
local function fair_level(wants, limit)
  table.sort(wants)
  local left = limit
  for i, want in ipairs(wants) do
    local even = math.floor(left / (#wants - i + 1))
    if want > even then
      return even
    end
    left = left - want
  end
  return limit
end

local function floodgate_region_trade(keys, args)
  local now = now_ms()
  local me, lifetime, deadline, n = args[1], tonumber(args[3]), tonumber(args[4]), tonumber(args[5])
  local regions = {}
  for name in string.gmatch(args[2], '[^,]+') do
    regions[#regions + 1] = name
  end
  if deadline > 0 and now > deadline then
    return { now, 'stale' }
  end
  local reply = { now, 'ok' }
  local pressure = keys[n + 1]
  for i = 1, n do
    local at = 6 + (i - 1) * 5
    local key, spec = keys[i], args[at + 1]
    local limit, report, want = tonumber(args[at + 2]), tonumber(args[at + 3]), tonumber(args[at + 4])
    local fixed = math.max(1, math.floor(limit / #regions))
    local others, promises_end, wants = 0, now + lifetime, {}
    for _, region in ipairs(regions) do
      if region ~= me then
        local share, wanted = fixed, fixed
        local value = redis.call('HGET', key, region)
        if value then
          local s, e, w = string.match(value, '^(%d+),(%d+),(%d+)$')
          if s and tonumber(e) > now then
            share, wanted = tonumber(s), tonumber(w)
            if share < fixed then
              promises_end = math.min(promises_end, tonumber(e))
            end
          end
        end
        others = others + share
        wants[#wants + 1] = wanted
      end
    end
    wants[#wants + 1] = want
    local cap = math.min(want, fair_level(wants, limit))
    local grant = math.max(report, math.min(want, cap, limit - others))
    local ends = now + lifetime
    if grant > fixed then
      ends = promises_end
    end
    if grant == fixed and want <= fixed then
      redis.call('HDEL', key, me)
    else
      redis.call('HSET', key, me, grant .. ',' .. ends .. ',' .. want)
      redis.call('PEXPIRE', key, lifetime * 4)
    end
    if want > grant then
      redis.call('ZADD', pressure, now, args[at] .. ' ' .. spec)
    end
    local left = 0
    if grant > fixed then
      left = ends - now
    end
    reply[#reply + 1] = grant
    reply[#reply + 1] = left
    reply[#reply + 1] = cap
  end
  redis.call('ZREMRANGEBYSCORE', pressure, '-inf', now - lifetime)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', pressure, now - lifetime, '+inf', 'LIMIT', 0, 1024)) do
    local key, spec = string.match(member, '^(%S+) (.+)$')
    if key then
      reply[#reply + 1] = key
      reply[#reply + 1] = spec
    end
  end
  return reply
end

return floodgate_region_trade(KEYS, ARGV)
