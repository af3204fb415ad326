-- Releases concurrency leases. KEYS[i]: the limit's key; ARGV[i]: the lease member. A key that
-- another algorithm took over meanwhile holds no lease: nothing to release, and no error.
local function floodgate_release(keys, args)
  for i = 1, #keys do
    redis.pcall('ZREM', keys[i], args[i])
  end
  return #keys
end
