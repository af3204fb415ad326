-- Releases concurrency leases. KEYS[i]: the limit's key; ARGV[i]: the lease member.
for i = 1, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[i])
end
return #KEYS
