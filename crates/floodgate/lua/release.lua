-- Releases concurrency leases. KEYS[i]: the limit's key; ARGV[i]: the lease member. A key that
-- another algorithm took over meanwhile holds no lease: nothing to release, and no error.
for i = 1, #KEYS do
  redis.pcall('ZREM', KEYS[i], ARGV[i])
end
return #KEYS
