-- A region's gateways sharing one share table in the region's own store
-- (floodgate_region_local).
--
-- KEYS (one hash tag, so one slot): the table (limit key -> "units,ends_ms,version,previous,
-- spec"), its version, the gateways' acknowledgements (gateway -> "version,at_ms"), the demand
-- gathered since the trader last took it (limit key -> units), the specs of those keys, the
-- trader's lock, and the highest generation of the global store that any of the region's
-- gateways has seen (so that a gateway started later, a restart, still finds a global store that
-- lost acknowledged writes behind it).
-- ARGV[1]: 'sync', 'write' or 'release'; ARGV[2]: this gateway's id; ARGV[3]: how long a gateway stays
-- live (and the lock held) without syncing (ms).
--   'sync': ARGV[4]: the table version this gateway has in force; ARGV[5]: the number of
--   demands, then per demand its limit key, units and spec, then (optional) the highest global
--   generation this gateway has seen. Adds the demands, records the acknowledgement and the
--   generation, takes or keeps the trader's lock. Reply: { now_ms, version, trader (0/1), the
--   table as pairs, and for the trader: the oldest version a live gateway has in force, the
--   demand taken as triples (key, units, spec), the highest generation recorded }.
--   'release': gives the lock up if this gateway holds it, and its acknowledgement (a gateway
--   shutting down: another takes over at its next sync). Reply: { now_ms, version }.
--   'write' (the trader only): ARGV[4]: the number of changes, then per change a limit key and
--   its value ('' removes it; its first '#' stands for the version written). Bumps the version
--   (the writer acknowledges it at its next sync, once no decision it cut under an older
--   version is still under way). Reply: { now_ms, version }, or an error when this
--   gateway no longer holds the lock.

local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

local function floodgate_region_local(keys, args)
  local table_key, version_key, acks_key, demand_key, specs_key, lock_key, generation_key =
    keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[7]
  local mode, me, live = args[1], args[2], tonumber(args[3])
  local now = now_ms()
  local version = tonumber(redis.call('GET', version_key) or '0')
  if mode == 'release' then
    if redis.call('GET', lock_key) == me then
      redis.call('DEL', lock_key)
    end
    redis.call('HDEL', acks_key, me)
    return { now, version }
  end
  if mode == 'write' then
    if redis.call('GET', lock_key) ~= me then
      return redis.error_reply('floodgate: not the region trader')
    end
    version = redis.call('INCR', version_key)
    local n = tonumber(args[4])
    for i = 1, n do
      local key, value = args[3 + 2 * i], args[4 + 2 * i]
      if value == '' then
        redis.call('HDEL', table_key, key)
      else
        redis.call('HSET', table_key, key, (string.gsub(value, '#', version, 1)))
      end
    end
    return { now, version }
  end
  local n = tonumber(args[5])
  for i = 1, n do
    local at = 3 + 3 * i
    redis.call('HINCRBY', demand_key, args[at], args[at + 1])
    redis.call('HSET', specs_key, args[at], args[at + 2])
  end
  redis.call('HSET', acks_key, me, args[4] .. ',' .. now)
  local generation = tonumber(redis.call('GET', generation_key) or '0')
  local seen = tonumber(args[6 + 3 * n] or '0') or 0
  if seen > generation then
    generation = seen
    redis.call('SET', generation_key, generation)
  end
  local trader = 0
  if redis.call('SET', lock_key, me, 'NX', 'PX', live) then
    trader = 1
  elseif redis.call('GET', lock_key) == me then
    redis.call('PEXPIRE', lock_key, live)
    trader = 1
  end
  local reply = { now, version, trader, redis.call('HGETALL', table_key) }
  if trader == 1 then
    local oldest = version
    local acks = redis.call('HGETALL', acks_key)
    for i = 1, #acks, 2 do
      local acked, at = string.match(acks[i + 1], '^(%d+),(%d+)$')
      if not at or tonumber(at) < now - live then
        redis.call('HDEL', acks_key, acks[i])
      else
        -- A version beyond the table's was acknowledged before the store lost its table: it
        -- says nothing of this table's versions.
        acked = tonumber(acked)
        if acked > version then
          acked = 0
        end
        oldest = math.min(oldest, acked)
      end
    end
    local demand = redis.call('HGETALL', demand_key)
    local taken = {}
    for i = 1, #demand, 2 do
      taken[#taken + 1] = demand[i]
      taken[#taken + 1] = demand[i + 1]
      taken[#taken + 1] = redis.call('HGET', specs_key, demand[i]) or ''
    end
    redis.call('DEL', demand_key, specs_key)
    reply[5] = oldest
    reply[6] = taken
    reply[7] = generation
  end
  return reply
end

return floodgate_region_local(KEYS, ARGV)
