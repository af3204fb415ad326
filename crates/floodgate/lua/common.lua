-- floodgate: helpers shared by every algorithm. The files of this folder are concatenated, in
-- the order of crates/floodgate/src/store/redis/script.rs, into one Lua library: loaded once per
-- Redis node as a Redis Function (FUNCTION LOAD, called by FCALL), or, on servers without
-- functions, sent as a script called by EVALSHA. Each algorithm mirrors
-- crates/floodgate/src/algorithm/<name>.rs operation for operation; a differential test holds
-- them to identical outcomes.
--
-- A function library is loaded once and then called many times, so everything a call does not
-- need is done at load time (the algorithm tables below), and each call does only its decision:
-- parameters are passed as positional arguments and outcomes returned as multiple values (no
-- table per limit or per outcome), and the reply is written in place.
--
-- Algorithms, all positional. Each takes the two numbers of its limit that it needs, `a` and
-- `b`: `burst` (capacity) and `emission` (microseconds per unit) for gcra, token_bucket and
-- leaky_bucket; `limit` and `window` (microseconds) for the window counters, the log and the
-- leases.
--   load(key, now, b) -> s1, s2, s3: the key's state (s1 == nil: fresh; the log and the
--     leases return a list, marked `foreign` when another algorithm's state is in the key)
--   evaluate(s1, s2, s3, a, b, now, cost)
--     -> allowed (0/1), remaining, reset_after, retry_after (-1: none), delay
--   consume(key, s1, s2, s3, a, b, now, cost, token) -> the lease or log entry it wrote, if any
--   refund(key, a, b, now, cost, token)
--   export(s1, s2, s3) -> three integers (the counting algorithms only: batched mode and the
--     store's local deny cache import them into the Rust state)
-- and two flags: `takes_token` (the log and the leases: the call carries the entry's id) and
-- `delays` (the leaky bucket: its outcome carries a delay).
--
-- What a call costs in Redis is mostly its commands and, next, `tonumber` and string patterns
-- (about 0.1 and 0.2 µs each here): the arguments carry only what the algorithm uses, numbers
-- are passed to commands as numbers (Redis writes an integer below 2^53 as its digits), and a
-- stored number is read with `tonumber` alone where no other algorithm's state could pass it.
--
-- All times are whole microseconds. Lua numbers are doubles: exact for integers below 2^53,
-- which limit validation guarantees for every value computed here. Numbers that go into
-- strings built here are formatted with %d, never tostring (which keeps only 14 digits).

local ALGORITHMS = {}

-- Bound on each call's first use (bind_globals): a function library is loaded in a sandbox
-- that offers nothing but `redis`, and every call after it runs in one that offers the rest.
local floor, ceil, max, min, match, format

local function bind_globals()
  floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
  match, format = string.match, string.format
end

-- Numbers of the arguments, parsed once: a loaded library keeps them from call to call, and
-- `tonumber` costs about ten table lookups. Bounded: the limits' numbers are few, but sync costs
-- vary, so the table starts over when it grows large.
local NUMBERS, numbers_kept = {}, 0

local function parse_number(text)
  local number = tonumber(text)
  if numbers_kept >= 4096 then
    NUMBERS, numbers_kept = {}, 0
  end
  NUMBERS[text] = number
  numbers_kept = numbers_kept + 1
  return number
end

-- Whether this call decides with the server's clock (not a `now` the caller gave): expiries
-- that depend only on a window's start are then set once per window, not on every write.
local SERVER_CLOCK = true

-- Outcomes: allowed (0/1), remaining, reset_after, retry_after (-1: none), delay.
-- Denied for good (the cost exceeds what the limit can ever hold) is denied with no retry.

local function format_int(value)
  return format('%d', value)
end

-- Milliseconds for PEXPIRE / SET PX: keys live until their state equals a fresh key's; a
-- relative TTL keeps this right even when tests pass an explicit `now` far from the server's
-- clock. With the caller's clock, at least a second: the TTL runs in the server's real time,
-- and the few ms a window's last moments leave ran out, on a loaded machine, between two calls
-- the caller put at the same instant. Every script reads its state by the time it is given (a
-- window's start, a bucket's refill), so a key kept longer decides as a fresh one would.
local function ttl_ms(micros)
  local ms = max(1, ceil(micros / 1000))
  if not SERVER_CLOCK and ms < 1000 then
    return 1000
  end
  return ms
end

-- A window's bounds at `now`: aligned to multiples of `window` since the epoch, or, for a
-- calendar period (a table of four consecutive boundaries around the caller's clock, see
-- `calendar_window` in check.lua), the period the server's `now` falls in among the three they
-- delimit, so that a caller whose clock is a little off still counts in the store's period.
local function window_bounds(window, now)
  if type(window) == 'table' then
    if now < window[1] then
      -- A caller's clock ahead by more than a period: periods as long as the first, back.
      local start, stop = window[1], window[2]
      while now < start do
        start, stop = start - (stop - start), start
      end
      return start, stop
    elseif now < window[2] then
      return window[1], window[2]
    elseif now < window[3] then
      return window[2], window[3]
    elseif now < window[4] then
      return window[3], window[4]
    end
    -- Behind by more than a period: periods as long as the last, on.
    local start, stop = window[3], window[4]
    while now >= stop do
      start, stop = stop, stop + (stop - start)
    end
    return start, stop
  end
  local start = now - now % window
  return start, start + window
end

local function expire_after(key, micros)
  redis.call('PEXPIRE', key, ttl_ms(micros))
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

-- A number stored in a state of this algorithm's shape. One that is no number is corrupted
-- data: the call fails (not transient: it repeats however often it is retried), as arithmetic
-- on it would have.
local function stored_number(value)
  local number = tonumber(value)
  if not number then
    error('floodgate: a stored state holds ' .. tostring(value) .. ' where a number belongs')
  end
  return number
end

-- Before a hash or sorted set is written where no state of this algorithm was found, whatever
-- another algorithm left goes (strings need not: SET replaces a key of any type).
local function clear_foreign(key)
  redis.call('DEL', key)
end
