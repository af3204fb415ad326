-- A minimal all-or-nothing decision over three keys with the server's clock, as
-- bench/redis_cost.sh's `per_ip` + two plan limits: two GCRA keys and one fixed-window count
-- (a string that expires with its window); its reply carries each limit's remaining and reset,
-- as the headers need. ARGV: emission, burst (both GCRA), then the window's
-- limit and length (µs).
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local emission, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tolerance = burst * emission
local limit, window = tonumber(ARGV[3]), tonumber(ARGV[4])
local tats = {}
for i = 1, 2 do
  local tat = tonumber(redis.call('GET', KEYS[i])) or now
  if tat < now then tat = now end
  tats[i] = tat + emission
  if tats[i] - now > tolerance then return { 0 } end
end
local count = tonumber(redis.call('GET', KEYS[3])) or 0
if count + 1 > limit then return { 0 } end
local reply = { 1 }
for i = 1, 2 do
  redis.call('SET', KEYS[i], tats[i], 'PX', math.ceil((tats[i] - now) / 1000))
  reply[#reply + 1] = math.floor((tolerance - (tats[i] - now)) / emission)
  reply[#reply + 1] = tats[i] - now
end
local until_end = window - now % window
redis.call('SET', KEYS[3], count + 1, 'PX', math.ceil(until_end / 1000))
reply[#reply + 1] = limit - count - 1
reply[#reply + 1] = until_end
return reply
