//! The two scripts a region runs besides its decisions: on its own store, where its gateways
//! share the table (`lua/region_local.lua`), and on the global store, where regions trade
//! (`lua/region_global.lua`).

use std::sync::LazyLock;

use deadpool_redis::redis::Script;

/// `lua/region_local.lua`: a gateway's sync with its region's table.
pub(super) static REGIONAL: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/region_local.lua")));

/// `lua/region_global.lua`: a region's trade with the global store (after `lua/max_min.lua`,
/// whose max-min split it uses).
pub(super) static GLOBAL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../../../lua/max_min.lua"),
        "\n",
        include_str!("../../../lua/region_global.lua")
    ))
});
