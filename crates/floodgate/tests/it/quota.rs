//! The quota board (`floodgate::store::quota`): the same claims through the memory board and
//! through `lua/quota_share.lua` on a real `redis-server` get the same grants, and the shares
//! recorded in Redis never exceed the limit together, whatever the holders want.
//!
//! Lifetimes and settle times are a minute, far longer than the test: no record ends while it
//! runs, so both boards see the same records whatever their clocks read.

use floodgate_test_support as support;

use std::collections::HashMap;
use std::time::Duration;

use floodgate::store::quota::{Claim, Grant, Held, QuotaBoard};
use support::RedisServer;

const LIMIT: u64 = 100_000;
const MINUTE: Duration = Duration::from_secs(60);

fn claim<'a>(key: &'a str, holder: &'a str, want: u64, in_force: u64) -> Claim<'a> {
    Claim {
        key,
        holder,
        limit: LIMIT,
        floor: LIMIT / 25,
        want,
        in_force,
        lifetime: MINUTE,
        settle: MINUTE,
    }
}

/// What every holder of `key` may enforce together, read from Redis' record.
fn recorded_total(redis: &RedisServer, key: &str) -> u64 {
    let fields: HashMap<String, String> = redis.command(&["HGETALL", key]);
    fields
        .values()
        .map(|record| {
            let parts: Vec<u64> = record
                .split(',')
                .map(|part| part.parse().unwrap())
                .collect();
            parts[0].max(parts[3])
        })
        .sum()
}

#[tokio::test]
async fn memory_and_redis_grant_the_same_and_never_above_the_limit() {
    let redis = RedisServer::start();
    let remote = QuotaBoard::redis(&redis.url(), Duration::from_secs(2)).unwrap();
    let local = QuotaBoard::memory();
    let mut rng = fastrand::Rng::with_seed(0x51A7E);
    let mut in_force: HashMap<String, u64> = HashMap::new();
    for step in 0..400 {
        let holder = format!("h{}", rng.u32(0..6));
        // Most wants are modest; some ask for more than the whole limit.
        let want = match rng.u32(0..4) {
            0 => rng.u64(0..LIMIT * 2),
            _ => rng.u64(0..LIMIT / 4),
        };
        let current = in_force.get(&holder).copied().unwrap_or(0);
        let asked = claim("q", &holder, want, current);
        let from_memory: Grant = local.claim(&asked).await.unwrap();
        let from_redis: Grant = remote.claim(&asked).await.unwrap();
        assert_eq!(from_memory, from_redis, "step {step}: {asked:?}");
        in_force.insert(holder, from_redis.share);
        let total = recorded_total(&redis, "q");
        assert!(total <= LIMIT, "step {step}: {total} held of {LIMIT}");
    }
}

/// A report's claims go to the board together: more than are ever under way at once
/// (`CLAIMS_UNDER_WAY`), several holders of each limit, so that a grant out of order, or lost
/// in the window's refill, gives some holder another's grant.
#[tokio::test]
async fn claims_made_together_are_granted_as_one_after_another() {
    let redis = RedisServer::start();
    let remote = QuotaBoard::redis(&redis.url(), Duration::from_secs(2)).unwrap();
    let local = QuotaBoard::memory();
    let count = floodgate::store::quota::CLAIMS_UNDER_WAY * 2 + 7;
    let mut rng = fastrand::Rng::with_seed(0xC1A1);
    let asked: Vec<(String, String, u64)> = (0..count)
        .map(|index| {
            let key = format!("limit{}", index % 97);
            let holder = format!("holder{index}");
            (key, holder, rng.u64(1..LIMIT / 3))
        })
        .collect();
    let claims: Vec<Claim<'_>> = asked
        .iter()
        .map(|(key, holder, want)| claim(key, holder, *want, 0))
        .collect();
    let together = remote.claim_all(&claims).await;
    assert_eq!(together.len(), count);
    for (index, (claim, grant)) in claims.iter().zip(together).enumerate() {
        let one_by_one = local.claim(claim).await.unwrap();
        assert_eq!(grant.unwrap(), one_by_one, "claim {index}: {claim:?}");
    }
    for limit in 0..97 {
        let total = recorded_total(&redis, &format!("limit{limit}"));
        assert!(total <= LIMIT, "limit{limit}: {total} held of {LIMIT}");
    }
}

#[tokio::test]
async fn a_held_share_counts_until_released_on_both_boards() {
    let redis = RedisServer::start();
    let boards = [
        QuotaBoard::memory(),
        QuotaBoard::redis(&redis.url(), Duration::from_secs(2)).unwrap(),
    ];
    for board in &boards {
        let held = Held {
            share: 50_000,
            lifetime: MINUTE,
            prior: 60_000,
            prior_lifetime: MINUTE,
        };
        board.hold("k", "gone", held).await.unwrap();
        let squeezed = board.claim(&claim("k", "new", LIMIT, 0)).await.unwrap();
        assert_eq!(
            squeezed.share,
            LIMIT - 60_000 - LIMIT / 25,
            "{}: a departed holder's share (the larger of the two) still counts",
            board.backend()
        );
        board.release("k", "gone").await.unwrap();
        let freed = board
            .claim(&claim("k", "new", LIMIT, squeezed.share))
            .await
            .unwrap();
        assert_eq!(freed.share, LIMIT - LIMIT / 25, "{}", board.backend());
    }
    assert_eq!(boards[0].limits_held(), 1);
    boards[0].release("k", "new").await.unwrap();
    assert_eq!(
        boards[0].limits_held(),
        0,
        "a limit nobody holds is forgotten"
    );
}

#[tokio::test]
async fn an_unreachable_board_fails_the_claim_within_its_timeout() {
    let mut redis = RedisServer::start();
    let board = QuotaBoard::redis(&redis.url(), Duration::from_millis(200)).unwrap();
    board.claim(&claim("k", "a", 10, 0)).await.unwrap();
    redis.freeze();
    let started = std::time::Instant::now();
    assert!(board.claim(&claim("k", "a", 10, 0)).await.is_err());
    // 200 ms deadline; the rest is CI slack.
    assert!(started.elapsed() < Duration::from_secs(2));
    redis.thaw();
}

#[tokio::test]
async fn an_absurd_demand_takes_no_more_than_the_limit_and_breaks_no_record() {
    let redis = RedisServer::start();
    let boards = [
        QuotaBoard::memory(),
        QuotaBoard::redis(&redis.url(), Duration::from_secs(2)).unwrap(),
    ];
    for board in &boards {
        let honest = board
            .claim(&claim("absurd", "honest", LIMIT / 2, 0))
            .await
            .unwrap();
        // The want is the client's report; what is in force is the server's own record.
        let greedy = board
            .claim(&claim("absurd", "greedy", u64::MAX, 0))
            .await
            .unwrap();
        assert!(
            honest.share + greedy.share <= LIMIT,
            "{}: {honest:?} {greedy:?}",
            board.backend()
        );
        // The greedy record is still counted: the honest holder cannot be granted it again.
        let again = board
            .claim(&claim("absurd", "honest", LIMIT, honest.share))
            .await
            .unwrap();
        assert!(
            again.share + greedy.share <= LIMIT,
            "{}: {again:?}",
            board.backend()
        );
    }
    assert!(recorded_total(&redis, "absurd") <= LIMIT);
}
