//! One limit shared among holders that each enforce their share locally: the Envoys of the
//! Rate Limit Quota Service, reporting to any of several floodgate servers.
//!
//! A holder claims a share by its demand ([`QuotaBoard::claim`]); the board grants it the
//! max-min fair level of every live holder's want, out of what the others hold, so that the
//! shares in force together never exceed the limit. A share lowered keeps counting at what the
//! holder had for a `settle` time (until the lower assignment has reached it); a share ends
//! with its `lifetime` unless claimed again, so a holder that leaves is reclaimed by then. A
//! fraction of the limit, the `floor`, is kept for a newcomer, which gets it at once.
//!
//! The board lives in memory (one server) or in Redis (`lua/quota_share.lua`, every server
//! sharing it); both run the same arithmetic.

mod fair;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use self::fair::{ClaimArgs, Record};
use super::StoreError;

/// A holder's claim on one limit.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    /// The limit's key: every holder of one limit claims under one key.
    pub key: &'a str,
    /// The holder, unique across servers.
    pub holder: &'a str,
    /// The whole limit, in the caller's units (a rate, say thousandths of a request per second).
    pub limit: u64,
    /// The part of the limit kept for a newcomer.
    pub floor: u64,
    /// What the holder wants.
    pub want: u64,
    /// What the holder enforces now (0 if nothing): a grant lower than this keeps counting
    /// this much for `settle`; a raise by less than a tenth of it is not made.
    pub in_force: u64,
    /// How long the holder may enforce the grant (its assignment's lifetime and a margin).
    pub lifetime: Duration,
    /// How long a lowered holder may still enforce what it had.
    pub settle: Duration,
}

/// What a claim granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The holder's share, in the claim's units.
    pub share: u64,
    /// The fair level: what every holder wanting at least this much should get.
    pub fair: u64,
    /// Some holder has less than min(its want, the fair level): claiming again soon moves
    /// shares to it (the ones above the level go down, the freed part goes to it).
    pub pressed: bool,
}

/// What a holder that no longer claims may still enforce: `share` for `lifetime`, and, while
/// a lower assignment is on its way to it, `prior` for `prior_lifetime`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// What it was last sent.
    pub share: u64,
    /// Until that ends.
    pub lifetime: Duration,
    /// What it had before, if that may still be in force.
    pub prior: u64,
    /// Until the last assignment has surely reached it.
    pub prior_lifetime: Duration,
}

/// Where holders claim their shares: in memory or in Redis.
pub struct QuotaBoard {
    board: Board,
}

enum Board {
    Memory(Mutex<Memory>),
    #[cfg(feature = "redis")]
    Redis(redis::RedisBoard),
}

impl std::fmt::Debug for QuotaBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaBoard")
            .field("backend", &self.backend())
            .finish()
    }
}

/// The most claims of one [`QuotaBoard::claim_all`] under way on Redis at once.
pub const CLAIMS_UNDER_WAY: usize = 64;

/// A board in this process: one server's holders only.
struct Memory {
    started: Instant,
    limits: HashMap<String, HashMap<String, Record>>,
    /// When (its milliseconds) it last dropped the limits nobody holds any more.
    swept_at: u64,
}

/// How often the memory board drops the limits nobody holds any more: once a second, not per
/// so many claims (a sweep visits every record, and a report of thousands of buckets made
/// one every thousand claims, about a twentieth of the server's time per report).
const SWEEP_EVERY_MS: u64 = 1000;

impl Memory {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn sweep(&mut self, now: u64) {
        self.swept_at = now;
        self.limits.retain(|_, records| {
            records.retain(|_, record| record.lives(now));
            !records.is_empty()
        });
    }
}

/// The memory board, whatever a panic left it in (each use changes it in one step).
fn lock(memory: &Mutex<Memory>) -> std::sync::MutexGuard<'_, Memory> {
    memory.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl QuotaBoard {
    /// A board in this process (one server).
    pub fn memory() -> QuotaBoard {
        QuotaBoard {
            board: Board::Memory(Mutex::new(Memory {
                started: Instant::now(),
                limits: HashMap::new(),
                swept_at: 0,
            })),
        }
    }

    /// A board on the Redis at `url`, shared by every server that uses it; calls give up after
    /// `timeout` (at least 100 ms) and are never sent twice.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a URL Redis' client cannot read.
    #[cfg(feature = "redis")]
    pub fn redis(url: &str, timeout: Duration) -> Result<QuotaBoard, StoreError> {
        let store = crate::store::RedisStore::builder(url)
            .timeout(timeout)
            .build()?;
        Ok(QuotaBoard::on_redis(store))
    }

    /// A board on `store`'s Redis in its deployment (one server, a cluster, a Sentinel's
    /// master), shared by every server that uses it: each limit's record is one key, on the
    /// node of its slot. Calls give up after the store's `timeout` (at least 100 ms), go
    /// outside its breaker, and are never sent twice.
    #[cfg(feature = "redis")]
    pub fn on_redis(store: crate::store::RedisStore) -> QuotaBoard {
        QuotaBoard {
            board: Board::Redis(redis::RedisBoard::One(store)),
        }
    }

    /// A board on sharded Redis: each limit's record on the node its key is placed on, as
    /// the store places decisions' keys.
    #[cfg(feature = "redis")]
    pub fn on_shards(store: crate::store::ShardedRedisStore) -> QuotaBoard {
        QuotaBoard {
            board: Board::Redis(redis::RedisBoard::Sharded(store)),
        }
    }

    /// `memory` or `redis`.
    pub fn backend(&self) -> &'static str {
        match self.board {
            Board::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Board::Redis(_) => "redis",
        }
    }

    /// Claims a share for `claim.holder` (see [`Claim`]).
    ///
    /// # Errors
    ///
    /// The Redis board's failures (unreachable, timed out, a malformed reply).
    pub async fn claim(&self, claim: &Claim<'_>) -> Result<Grant, StoreError> {
        // A want or a share above the whole limit means no more than the limit: clamped, no
        // client-reported count can overflow the board's sums.
        let args = ClaimArgs {
            limit: claim.limit,
            floor: claim.floor.min(claim.limit),
            want: claim.want.min(claim.limit),
            in_force: claim.in_force.min(claim.limit),
            lifetime_ms: millis(claim.lifetime),
            settle_ms: millis(claim.settle),
        };
        match &self.board {
            Board::Memory(memory) => {
                let mut memory = lock(memory);
                let now = memory.now_ms();
                if now >= memory.swept_at + SWEEP_EVERY_MS {
                    memory.sweep(now);
                }
                let records = memory.limits.entry(claim.key.to_owned()).or_default();
                let claimed = fair::claim(records, claim.holder, args, now);
                Ok(Grant {
                    share: claimed.grant,
                    fair: claimed.fair,
                    pressed: claimed.pressed,
                })
            }
            #[cfg(feature = "redis")]
            Board::Redis(board) => board.claim(claim.key, claim.holder, args).await,
        }
    }

    /// Claims every one of `claims` ([`QuotaBoard::claim`]), their grants in the same order.
    /// On Redis they are under way together (up to [`CLAIMS_UNDER_WAY`] at once, pipelined on
    /// the connection), not one round trip after another: a report of thousands of buckets is
    /// answered in a few round trips.
    pub async fn claim_all(&self, claims: &[Claim<'_>]) -> Vec<Result<Grant, StoreError>> {
        match &self.board {
            Board::Memory(_) => {
                let mut grants = Vec::with_capacity(claims.len());
                for claim in claims {
                    grants.push(self.claim(claim).await);
                }
                grants
            }
            #[cfg(feature = "redis")]
            Board::Redis(_) => {
                use futures_util::StreamExt as _;
                // By hand, not `stream::iter(..).map(..).buffered(..)`: the closure's
                // borrowed claim made the callers' futures not `Send` for every lifetime.
                let mut waiting = claims.iter();
                let mut under_way = futures_util::stream::FuturesOrdered::new();
                for claim in waiting.by_ref().take(CLAIMS_UNDER_WAY) {
                    under_way.push_back(self.claim(claim));
                }
                let mut grants = Vec::with_capacity(claims.len());
                while let Some(grant) = under_way.next().await {
                    grants.push(grant);
                    if let Some(claim) = waiting.next() {
                        under_way.push_back(self.claim(claim));
                    }
                }
                grants
            }
        }
    }

    /// Records what `holder` may still enforce, whatever it wants: a holder whose stream ended
    /// keeps what it was last sent until that expires. Never shortens what the record counts.
    ///
    /// # Errors
    ///
    /// The Redis board's failures.
    pub async fn hold(&self, key: &str, holder: &str, held: Held) -> Result<(), StoreError> {
        match &self.board {
            Board::Memory(memory) => {
                let mut memory = lock(memory);
                let now = memory.now_ms();
                let held = [
                    held.share,
                    millis(held.lifetime),
                    held.prior,
                    millis(held.prior_lifetime),
                ];
                let records = memory.limits.entry(key.to_owned()).or_default();
                fair::hold(records, holder, held, now);
                Ok(())
            }
            #[cfg(feature = "redis")]
            Board::Redis(board) => board.hold(key, holder, held).await,
        }
    }

    /// Counts `holder`'s lowered share at what it had for `settle` from now at least: the
    /// lower assignment has just been sent (a claim's own settle runs from the claim, which
    /// may be a while before the answer leaves).
    ///
    /// # Errors
    ///
    /// The Redis board's failures.
    pub async fn settle(
        &self,
        key: &str,
        holder: &str,
        settle: Duration,
    ) -> Result<(), StoreError> {
        match &self.board {
            Board::Memory(memory) => {
                let mut memory = lock(memory);
                let now = memory.now_ms();
                if let Some(records) = memory.limits.get_mut(key) {
                    fair::settle(records, holder, millis(settle), now);
                }
                Ok(())
            }
            #[cfg(feature = "redis")]
            Board::Redis(board) => board.settle(key, holder, millis(settle)).await,
        }
    }

    /// Records that `holder` enforces nothing any more (its assignment was withdrawn).
    ///
    /// # Errors
    ///
    /// The Redis board's failures.
    pub async fn release(&self, key: &str, holder: &str) -> Result<(), StoreError> {
        match &self.board {
            Board::Memory(memory) => {
                let mut memory = lock(memory);
                if let Some(records) = memory.limits.get_mut(key) {
                    records.remove(holder);
                    if records.is_empty() {
                        memory.limits.remove(key);
                    }
                }
                Ok(())
            }
            #[cfg(feature = "redis")]
            Board::Redis(board) => board.release(key, holder).await,
        }
    }

    /// How many limits the memory board keeps records for (0 for Redis, which expires its own).
    pub fn limits_held(&self) -> usize {
        match &self.board {
            Board::Memory(memory) => {
                let mut memory = lock(memory);
                let now = memory.now_ms();
                memory.sweep(now);
                memory.limits.len()
            }
            #[cfg(feature = "redis")]
            Board::Redis(_) => 0,
        }
    }
}

#[cfg(feature = "redis")]
mod redis {
    use std::sync::LazyLock;

    use deadpool_redis::redis::{Script, Value};

    use super::fair::ClaimArgs;
    use super::{Grant, Held};
    use crate::store::link::reply;
    use crate::store::{RedisStore, ShardedRedisStore, StoreError};

    /// `lua/quota_share.lua`, after `lua/max_min.lua` (whose max-min split it uses): its
    /// source and SHA-1.
    static SHARE: LazyLock<(String, String)> = LazyLock::new(|| {
        let source = concat!(
            include_str!("../../../lua/max_min.lua"),
            "\n",
            include_str!("../../../lua/quota_share.lua")
        );
        (source.to_owned(), Script::new(source).get_hash().to_owned())
    });

    /// The board in Redis: one hash per limit, one field per holder.
    pub(super) enum RedisBoard {
        /// On one deployment's Redis (a server, a cluster, a Sentinel's master).
        One(RedisStore),
        /// On the node of sharded Redis that the limit's key is placed on.
        Sharded(ShardedRedisStore),
    }

    impl RedisBoard {
        /// Runs the share script on `key`'s node with `arguments`.
        async fn run(&self, key: &str, arguments: &[String]) -> Result<Value, StoreError> {
            let store = match self {
                RedisBoard::One(store) => store,
                RedisBoard::Sharded(shards) => shards.node(shards.node_of(key)),
            };
            let (source, hash) = &*SHARE;
            store.run_keyed_script((source, hash), key, arguments).await
        }

        pub(super) async fn claim(
            &self,
            key: &str,
            holder: &str,
            args: ClaimArgs,
        ) -> Result<Grant, StoreError> {
            let arguments = [
                "claim".to_owned(),
                holder.to_owned(),
                args.limit.to_string(),
                args.floor.to_string(),
                args.want.to_string(),
                args.in_force.to_string(),
                args.lifetime_ms.to_string(),
                args.settle_ms.to_string(),
            ];
            let reply = self.run(key, &arguments).await?;
            let parts = reply::array(reply, "quota claim")?;
            let [share, fair, pressed] = parts.as_slice() else {
                return Err(StoreError::Protocol(
                    "malformed reply: quota claim".to_owned(),
                ));
            };
            let whole = |value, what| reply::int(value, what).map(|n| n.max(0) as u64);
            Ok(Grant {
                share: whole(share, "quota share")?,
                fair: whole(fair, "quota fair level")?,
                pressed: whole(pressed, "quota pressure")? == 1,
            })
        }

        pub(super) async fn hold(
            &self,
            key: &str,
            holder: &str,
            held: Held,
        ) -> Result<(), StoreError> {
            let arguments = [
                "hold".to_owned(),
                holder.to_owned(),
                held.share.to_string(),
                super::millis(held.lifetime).to_string(),
                held.prior.to_string(),
                super::millis(held.prior_lifetime).to_string(),
            ];
            self.run(key, &arguments).await.map(drop)
        }

        pub(super) async fn settle(
            &self,
            key: &str,
            holder: &str,
            settle_ms: u64,
        ) -> Result<(), StoreError> {
            let arguments = [
                "settle".to_owned(),
                holder.to_owned(),
                settle_ms.to_string(),
            ];
            self.run(key, &arguments).await.map(drop)
        }

        pub(super) async fn release(&self, key: &str, holder: &str) -> Result<(), StoreError> {
            let arguments = ["release".to_owned(), holder.to_owned()];
            self.run(key, &arguments).await.map(drop)
        }
    }
}
