-- Shared by the scripts that split a limit max-min fairly (`region_global.lua`,
-- `quota_share.lua`): each is run with this file before it.

-- The level of a max-min fair split of `limit` among `wants`: every want at or under it is
-- met, the others get it. Sorts `wants` in place (the callers only sum them afterwards).
local function fair_level(wants, limit)
  table.sort(wants)
  local left = limit
  for i, want in ipairs(wants) do
    local even = math.floor(left / (#wants - i + 1))
    if want > even then
      return even
    end
    left = left - want
  end
  return limit
end
