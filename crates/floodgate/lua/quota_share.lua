-- Holders sharing one limit by their demand (floodgate_quota_share): the Rate Limit Quota
-- Service's Envoys, each enforcing its share locally, through any floodgate server.
--
-- One hash per limit, one field per holder: "share,until_ms,want,prior,prior_until_ms". A
-- holder may enforce `share` until `until` (the assignment's time to live and a margin), and
-- may still be enforcing `prior` (what it was sent before being lowered) until `prior_until`.
-- A holder counts at the larger of the two that have not ended, so a share lowered is free for
-- others only once the lower assignment has reached its holder.
--
-- A claim grants the holder min(its want, the max-min fair level of every live holder's want
-- in the limit less `floor`), and room to grow from what the wants together leave, out of
-- what the others hold; beyond `floor` it takes only what leaves `floor` free for a newcomer,
-- which then gets up to `floor` at once. So the shares together never exceed the
-- limit. A change smaller than a tenth of what the holder has in force is not worth a new
-- assignment (Envoy starts a replaced token bucket full), and is not made: a raise never, a
-- cut while no holder is short.
--
-- The same arithmetic runs in memory (`store/quota/fair.rs`); a differential test holds them
-- together.
--
-- `fair_level` is `lua/max_min.lua`'s, which precedes this file in the script.
--
-- KEYS: the limit's hash.
-- ARGV: 'claim', holder, limit, floor, want, in force (what the holder enforces now), the
--       grant's lifetime (ms), how long a lowered holder may still enforce what it had (ms)
--    or 'hold', holder, share, for (ms), prior, for (ms): the holder may enforce `share` (and
--       `prior`) that long, whatever its want (a holder whose stream ended keeps what it was
--       last sent until it expires)
--    or 'settle', holder, for (ms): a lowered holder's prior share counts that long from now at
--       least (its lower assignment has just been sent)
--    or 'release', holder: the holder enforces nothing any more.
-- Reply (claim): { grant, fair level, 1 if some holder has less than min(want, fair) }; else
-- { 0, 0, 0 }.

local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

local function parse(text)
  local share, until_ms, want, prior, prior_until =
    string.match(text, '^(%d+),(%d+),(%d+),(%d+),(%d+)$')
  if not share then
    return nil
  end
  return {
    share = tonumber(share), until_ms = tonumber(until_ms), want = tonumber(want),
    prior = tonumber(prior), prior_until = tonumber(prior_until),
  }
end

local function format(record)
  return string.format('%d,%d,%d,%d,%d', record.share, record.until_ms, record.want,
    record.prior, record.prior_until)
end

-- What a holder may enforce at `now`.
local function counted(record, now)
  local held = 0
  if record.until_ms > now then
    held = record.share
  end
  if record.prior_until > now and record.prior > held then
    held = record.prior
  end
  return held
end

-- What a holder wanting `want` among `wants` (its own included) of `shared` should have: its
-- max-min fair part, then, of what the wants together leave, a part in proportion to its
-- want, at most a quarter more. Returns it and the fair level.
local function target_of(wants, want, shared)
  local level = fair_level(wants, shared)
  local met, wanted = 0, 0
  for _, other in ipairs(wants) do
    met = met + math.min(other, level)
    wanted = wanted + other
  end
  local room = 0
  if wanted > 0 then
    room = math.floor(math.max(shared - met, 0) * want / wanted)
  end
  return math.min(want, level) + math.min(room, math.floor(want / 4)), level
end

-- Whether a holder with `held` is short of min(`want`, `fair`) by more than the tenth a raise
-- must exceed to be made.
local function short(held, want, fair)
  return held * 11 < math.min(want, fair) * 10
end

-- The live records but `holder`'s, each ended one deleted; and `holder`'s own.
local function load(key, holder, now)
  local flat = redis.call('HGETALL', key)
  local others = {}
  local own = nil
  for i = 1, #flat, 2 do
    local record = parse(flat[i + 1])
    if record == nil or (record.until_ms <= now and record.prior_until <= now) then
      redis.call('HDEL', key, flat[i])
    elseif flat[i] == holder then
      own = record
    else
      others[#others + 1] = record
    end
  end
  return others, own
end

local function store(key, holder, record)
  redis.call('HSET', key, holder, format(record))
  local longest = redis.call('PTTL', key)
  local lives = math.max(record.until_ms, record.prior_until) - now_ms() + 1000
  if longest < lives then
    redis.call('PEXPIRE', key, lives)
  end
end

local function claim(key, holder, limit, floor, want, in_force, lifetime, settle)
  local now = now_ms()
  local others, own = load(key, holder, now)
  local held = 0
  local wants = { want }
  for _, record in ipairs(others) do
    held = held + counted(record, now)
    if record.until_ms > now then
      wants[#wants + 1] = record.want
    end
  end
  -- The floor is kept for newcomers: the holders share the rest.
  local target, fair = target_of(wants, want, math.max(limit - floor, 0))
  local available = math.max(limit - held, 0)
  local grant = math.min(target, math.max(math.min(floor, available), available - floor))
  local others_short = false
  for _, record in ipairs(others) do
    if record.until_ms > now and short(counted(record, now), record.want, fair) then
      others_short = true
    end
  end
  -- A change by less than a tenth of what is in force is not made: not a raise, nor a cut
  -- while nobody is short and what is in force still fits beside the others.
  local small_raise = grant > in_force and grant * 10 < in_force * 11
  local small_cut = grant < in_force and grant * 10 >= in_force * 9 and in_force <= available
    and not others_short
  if small_raise or small_cut then
    grant = in_force
  end
  local prior, prior_until = 0, 0
  if in_force > grant then
    prior, prior_until = in_force, now + settle
  end
  if own ~= nil and own.prior_until > now and own.prior > prior then
    prior, prior_until = own.prior, own.prior_until
  end
  store(key, holder, {
    share = grant, until_ms = now + lifetime, want = want, prior = prior, prior_until = prior_until,
  })
  local pressed = 0
  if short(grant, want, fair) or others_short then
    pressed = 1
  end
  return { grant, fair, pressed }
end

local operation, holder = ARGV[1], ARGV[2]
if operation == 'claim' then
  return claim(KEYS[1], holder, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
    tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
elseif operation == 'hold' then
  local now = now_ms()
  local record = parse(redis.call('HGET', KEYS[1], holder) or '') or {
    share = 0, until_ms = 0, want = 0, prior = 0, prior_until = 0,
  }
  -- Alive, a part is kept whole: the larger share, to the later end.
  local function merge(part, until_ms, new, new_until)
    if until_ms > now then
      return math.max(part, new), math.max(until_ms, new_until)
    end
    return new, new_until
  end
  record.share, record.until_ms =
    merge(record.share, record.until_ms, tonumber(ARGV[3]), now + tonumber(ARGV[4]))
  record.prior, record.prior_until =
    merge(record.prior, record.prior_until, tonumber(ARGV[5]), now + tonumber(ARGV[6]))
  record.want = 0
  store(KEYS[1], holder, record)
elseif operation == 'settle' then
  local now = now_ms()
  local record = parse(redis.call('HGET', KEYS[1], holder) or '')
  if record ~= nil and record.prior > 0 and record.prior_until > now then
    record.prior_until = math.max(record.prior_until, now + tonumber(ARGV[3]))
    store(KEYS[1], holder, record)
  end
elseif operation == 'release' then
  redis.call('HDEL', KEYS[1], holder)
end
return { 0, 0, 0 }
