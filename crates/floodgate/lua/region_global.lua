-- Regions trading their shares of each limit in the global store (floodgate_region_trade).
--
-- A region may use its fixed share of a limit (`limit / regions`, at least 1) without asking.
-- A record (one hash per limit key, one field per region: "share,ends_ms,want,counts_ms")
-- says otherwise: a share below the fixed one is a region's promise to stay under it until
-- `ends` (it lends); one above is a grant it may use until `ends` (it borrows), and whose
-- units count until `counts` (a window's count outlives the grant: to the end of its window,
-- and of the next for a sliding window counter, with a margin for the servers' clocks). Every
-- region without a record that counts is counted at its fixed share, so a grant never makes
-- the shares of all regions exceed the limit; a grant ends no later than the promises it
-- borrows from and is not renewed while the region holds more than the others now leave it;
-- when regions want more than the limit holds, each gets a max-min fair part of it (its
-- `cap`), and a region holding more than its part lowers itself before saying so.
--
-- A store that starts empty (its `born` key missing: a new deployment, or a restart without
-- its data) only records for a lifetime: every region that can reach it reports what it holds
-- at its next trade, promises included, before anything is granted again (one that cannot is
-- counted at its fixed share, which it returns to on its own).
--
-- A store that lost only some of what it acknowledged keeps `born`: a restart from an older
-- snapshot, an append-only file missing its last second, a failover to a replica behind, an
-- evicted record. Every trade therefore advances a generation (a counter no other write
-- touches) and replies with it; each region sends back the highest it has seen. A store whose
-- generation is behind what a region saw has lost acknowledged writes, and settles for a
-- lifetime as an empty one does (`born` set anew), its generation moved past the region's.
--
-- A lifetime is enough for a bucket (a grant lasts one), not for a window: a region that held
-- a window's count above its fixed share before the loss holds it until that window ends, and
-- the store, which lost its record, would count it at its fixed share. So until every region
-- has reported (a trade by its trader) since `born`, a window's spec keeps settling for a window
-- after `born` (two for a sliding window counter), and a margin.
--
-- `fair_level` is `lua/max_min.lua`'s, which precedes this file in the script.
--
-- KEYS: the record of each item, then the pressure set (a sorted set of "<limit key>\n<spec>"
-- for the keys some region wants more of than its fixed share or than it got, scored by
-- when), then the `born` key, then the generation key, then the set of regions that reported
-- since `born`.
-- ARGV: this region, the regions (comma-separated), the lifetime of a record (ms), the
-- trade's deadline by this server's clock (ms; 0: none; a trade that arrives later is stale
-- and changes nothing), the margin for clocks (ms), the number of items; then per item its
-- limit key, its spec ("<algorithm> <limit> <window us> <burst>"), the limit, the most this
-- region may have in force now (`report`) and the share it wants; then the highest generation
-- this region has seen (0: none yet), and whether this call reports what the region holds ('1':
-- its trader's trade; '0': a gateway reading the clock).
-- Reply: { now_ms, 'ok' | 'stale', then for 'ok': the generation after this trade, per item:
-- grant, ms until a grant above the fixed share ends (0 if none), cap; then the pressured keys
-- and their specs, in pairs }.

local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- How long a window's count may outlive a loss of the store's records: a window (two for a
-- sliding window counter), 0 for a bucket.
local function count_outlives(spec)
  local algorithm, window = string.match(spec, '^(%S+) %d+ (%d+) ')
  window = math.floor(tonumber(window or '0') / 1000)
  if algorithm == 'fixed_window' then
    return window
  elseif algorithm == 'sliding_window_counter' then
    return 2 * window
  end
  return 0
end

-- Until when a region's units of a limit count, from when its share ends: windows keep their
-- count to the end of the window (and of the next for a sliding window counter). Measured as
-- durations (a window, two, and the margin) rather than from this server's idea of where the
-- regions' windows end: their stores cut windows by their own clocks.
local function counts_until(spec, ends, margin)
  local algorithm, window = string.match(spec, '^(%S+) %d+ (%d+) ')
  window = math.floor(tonumber(window or '0') / 1000)
  if window <= 0 then
    return ends
  end
  if algorithm == 'fixed_window' then
    return ends + window + margin
  elseif algorithm == 'sliding_window_counter' then
    return ends + 2 * window + margin
  end
  return ends
end

local function floodgate_region_trade(keys, args)
  local now = now_ms()
  local me, lifetime, deadline = args[1], tonumber(args[3]), tonumber(args[4])
  local margin, n = tonumber(args[5]), tonumber(args[6])
  local regions = {}
  for name in string.gmatch(args[2], '[^,]+') do
    regions[#regions + 1] = name
  end
  if deadline > 0 and now > deadline then
    return { now, 'stale' }
  end
  local pressure, born_key, generation_key = keys[n + 1], keys[n + 2], keys[n + 3]
  local reported_key = keys[n + 4]
  local seen = tonumber(args[7 + n * 5]) or 0
  local generation = tonumber(redis.call('GET', generation_key)) or 0
  local reborn
  if generation < seen then
    -- Behind what a region saw: this store lost writes it had acknowledged.
    redis.call('SET', born_key, now)
    generation = seen
    reborn = true
  else
    reborn = redis.call('SET', born_key, now, 'NX')
  end
  if reborn then
    redis.call('DEL', reported_key)
  end
  generation = generation + 1
  redis.call('SET', generation_key, generation)
  if args[8 + n * 5] == '1' then
    redis.call('HSET', reported_key, me, now)
  end
  local since_born = now - tonumber(redis.call('GET', born_key))
  local settling = since_born < lifetime
  local all_reported = true
  for _, region in ipairs(regions) do
    if redis.call('HEXISTS', reported_key, region) == 0 then
      all_reported = false
    end
  end
  local reply = { now, 'ok', generation }
  for i = 1, n do
    local at = 7 + (i - 1) * 5
    local key, spec = keys[i], args[at + 1]
    local limit, report, want = tonumber(args[at + 2]), tonumber(args[at + 3]), tonumber(args[at + 4])
    local fixed = math.max(1, math.floor(limit / #regions))
    -- This key settles longer while a region that may hold a window's count has not reported.
    local settling = settling
      or (not all_reported and since_born < count_outlives(spec) + lifetime + margin)
    local others, promises_end, wants = 0, now + lifetime, {}
    local previous_ends = now
    for _, region in ipairs(regions) do
      local value = redis.call('HGET', key, region)
      local s, e, w, c
      if value then
        s, e, w, c = string.match(value, '^(%d+),(%d+),(%d+),(%d+)$')
      end
      if region == me then
        if s and tonumber(e) > now then
          previous_ends = tonumber(e)
        end
      else
        local share, wanted = fixed, fixed
        if s and tonumber(c) > now then
          share, wanted = tonumber(s), tonumber(w)
          if share < fixed then
            promises_end = math.min(promises_end, tonumber(e))
          end
        end
        others = others + share
        wants[#wants + 1] = wanted
      end
    end
    wants[#wants + 1] = want
    local cap = math.min(want, fair_level(wants, limit))
    local grant, ends
    if settling then
      grant, cap = report, report
    else
      grant = math.max(report, math.min(want, cap, limit - others))
    end
    if grant > fixed then
      if settling or report > math.max(fixed, limit - others) then
        -- Not renewed: the others came back, or the store lost what it granted.
        ends = math.min(previous_ends, promises_end)
      else
        ends = promises_end
      end
    else
      ends = now + lifetime
    end
    local counts = ends
    if grant > fixed then
      counts = counts_until(spec, ends, margin)
    end
    if grant == fixed and want <= fixed and not settling then
      redis.call('HDEL', key, me)
    else
      redis.call('HSET', key, me, grant .. ',' .. ends .. ',' .. want .. ',' .. counts)
      -- Only ever later: another region's trade must not cut a long count short.
      local ttl = math.max(lifetime * 4, counts - now + lifetime)
      if redis.call('PTTL', key) < ttl then
        redis.call('PEXPIRE', key, ttl)
      end
    end
    if want > fixed or want > grant then
      redis.call('ZADD', pressure, now, args[at] .. '\n' .. spec)
    end
    local left = 0
    if grant > fixed then
      left = math.max(0, ends - now)
    end
    reply[#reply + 1] = grant
    reply[#reply + 1] = left
    reply[#reply + 1] = cap
  end
  redis.call('ZREMRANGEBYSCORE', pressure, '-inf', now - lifetime)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', pressure, now - lifetime, '+inf', 'LIMIT', 0, 1024)) do
    local key, spec = string.match(member, '^([^\n]+)\n(.+)$')
    if key then
      reply[#reply + 1] = key
      reply[#reply + 1] = spec
    end
  end
  return reply
end

return floodgate_region_trade(KEYS, ARGV)
