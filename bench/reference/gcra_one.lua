-- A minimal GCRA decision for one key, with the server's clock: the reference floodgate's
-- Redis cost is measured against (bench/redis_cost.sh). ARGV: emission (µs), burst.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local emission = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2]) * emission
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local after = tat + emission
if after - now <= tolerance then
  redis.call('SET', KEYS[1], after, 'PX', math.ceil((after - now) / 1000))
  return { 1, math.floor((tolerance - (after - now)) / emission), after - now }
end
return { 0, math.floor((tolerance - (tat - now)) / emission), tat - now, after - now - tolerance }
