-- floodgate: helpers shared by every algorithm. The scripts in this folder are concatenated,
-- in the order of crates/floodgate/src/store/redis/script.rs, into one script loaded once and
-- called with EVALSHA. Each algorithm mirrors crates/floodgate/src/algorithm/<name>.rs
-- operation for operation; a differential test holds them to identical outcomes.
--
-- All times are whole microseconds. Lua numbers are doubles: exact for integers below 2^53,
-- which limit validation guarantees for every value computed here. Numbers that go into
-- strings are formatted with %d, never tostring (which keeps only 14 digits).

local ALGORITHMS = {}

-- An outcome: allowed (0/1), remaining, reset_after, retry_after (-1: none), delay.
local function allowed(remaining, reset_after)
  return { 1, remaining, reset_after, -1, 0 }
end

local function denied(remaining, reset_after, retry_after)
  return { 0, remaining, reset_after, retry_after, 0 }
end

-- Denied for good: the cost exceeds what the limit can ever hold.
local function never(remaining, reset_after)
  return { 0, remaining, reset_after, -1, 0 }
end

local floor = math.floor
local max = math.max
local min = math.min

-- Keys live until their state equals a fresh key's; a relative TTL keeps this right even when
-- tests pass an explicit `now` far from the server's clock.
local function expire_after(key, micros)
  redis.call('PEXPIRE', key, max(1, math.ceil(micros / 1000)))
end

local function format_int(value)
  return string.format('%d', value)
end

-- SPEC §3: state that another algorithm left under a key (a limit reconfigured under the same
-- rule and name) is a fresh key, as in the memory store, and never a script error. Reads go
-- through redis.pcall, so that a key of another Redis type reads as absent (false) instead of
-- failing with WRONGTYPE; each algorithm then accepts only the fields or format its own state
-- has. Values of the right shape that are no numbers are corrupted data: those still fail.
local function read_own(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    return false
  end
  return reply
end

-- Before a hash or sorted set is written where no state of this algorithm was found, whatever
-- another algorithm left goes (strings need not: SET replaces a key of any type).
local function clear_foreign(key)
  redis.call('DEL', key)
end
