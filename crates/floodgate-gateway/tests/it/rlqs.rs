//! floodgate as Envoy's Rate Limit Quota Service (SPEC §10a), through the real binary: Envoys
//! emulated by `floodgate_test_support::rlqs` (reports, subscriptions, whole-second TTLs,
//! token buckets enforced locally, fallbacks) stream to one or two servers, sharing through
//! memory or a real `redis-server`.
//!
//! Reports go every second here (Envoy's filter: every 5 s), so an assignment lives 3 s.
//! Traffic is offered in 10 ms steps for a few seconds of real time; the bounds on what is
//! admitted are the protocol's (the limit over the window, its burst, and the 2 % the issue
//! allows), with the room each test states for its first intervals.

use crate::support;
use floodgate_test_support as redis_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use floodgate_test_support::rlqs::{Admission, Bucket, Enforced, Envoy, EnvoySettings, bucket};
use support::{Gateway, TempDir, admin_call, client, distinct_addresses};
use tokio::time::Instant;

/// The quota rules every test serves: a limit shared by every Envoy, one per user, a kill
/// switch.
const RULES: &str = "    report_interval: 1s
    abandon_after: 3
    domains:
      api:
        - name: shared
          bucket: { name: shared }
          limit: { limit: 100, window: 1s, burst: 50 }
        - name: per_user
          bucket: { name: user, user: \"*\" }
          limit: { limit: 10, window: 1s, burst: 10 }
        - name: off
          bucket: { name: off }
          blanket: deny
";

const REPORT: Duration = Duration::from_secs(1);
const TTL: Duration = Duration::from_secs(3);

/// A running `floodgate serve` with `rls.quota`.
struct QuotaServer {
    gateway: Gateway,
    address: SocketAddr,
    directory: TempDir,
}

impl QuotaServer {
    /// Starts floodgate serving the quota rules, `rest` appended to its configuration.
    fn start(rest: &str) -> QuotaServer {
        QuotaServer::start_reporting_every(REPORT, rest)
    }

    /// [`start`](Self::start), with Envoys to report every `report` (whole seconds).
    fn start_reporting_every(report: Duration, rest: &str) -> QuotaServer {
        let rules = RULES.replace(
            "report_interval: 1s",
            &format!("report_interval: {}s", report.as_secs()),
        );
        let directory = TempDir::new("rlqs");
        std::fs::create_dir_all(directory.file("rls")).unwrap();
        let [listen, admin, address] = distinct_addresses();
        let text = format!(
            "listen: \"{listen}\"\nadmin:\n  listen: \"{admin}\"\nrls:\n  listen: \"{address}\"\n  config_dir: rls\n  quota:\n{rules}{rest}"
        );
        let path = directory.file("floodgate.yaml");
        std::fs::write(&path, text).unwrap();
        QuotaServer {
            gateway: Gateway::start(&path, listen, admin),
            address,
            directory,
        }
    }

    async fn admin(&self) -> serde_json::Value {
        let (status, body) = admin_call(
            &client(),
            &self.gateway,
            http::Method::GET,
            "/admin/rlqs",
            None,
            None,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        body
    }

    /// How many limits the server holds shares of (`/admin/rlqs`).
    async fn limits_held(&self) -> usize {
        self.admin().await["limits"].as_array().unwrap().len()
    }
}

async fn envoy(servers: &[&QuotaServer]) -> Arc<Envoy> {
    envoy_reporting_every(servers, REPORT).await
}

async fn envoy_reporting_every(servers: &[&QuotaServer], report: Duration) -> Arc<Envoy> {
    let mut settings =
        EnvoySettings::new("api", servers.iter().map(|server| server.address).collect());
    settings.report_interval = report;
    Arc::new(Envoy::start(settings).await)
}

/// Offers `per_second` requests for `bucket` through `envoy` from `start` for `run`, in 10 ms
/// steps; returns when each admitted one was, from `start`.
async fn offer(
    envoy: Arc<Envoy>,
    bucket: Bucket,
    per_second: f64,
    start: Instant,
    run: Duration,
) -> Vec<Duration> {
    let step = Duration::from_millis(10);
    let mut admitted = offer_each(envoy, vec![bucket], per_second, start, run, step).await;
    admitted
        .pop()
        .map(|admitted| admitted.at)
        .unwrap_or_default()
}

/// The admitted requests of one bucket: when each was, from the start, and those among them
/// that the Envoy allowed on its own (no assignment in force: its no-assignment behaviour
/// allows all in these tests).
#[derive(Clone, Default)]
struct Admitted {
    at: Vec<Duration>,
    on_its_own: Vec<Duration>,
}

/// Offers `per_second` requests for each of `buckets` through `envoy` from `start` for `run`,
/// in steps of `step`; returns, per bucket, the admitted ones.
///
/// A request's time is when it was made, not the step it was owed to: on a loaded machine the
/// steps fall behind and tokio fires the missed ones at once, so a step's time can be a second
/// before the requests it makes (and the Envoy's buckets refill by the real clock). Counted
/// by their steps, one user got 59 in a "4 s" window of 10/s with a burst of 10 in a full CI
/// run: more than 4 s of requests under the window's name.
async fn offer_each(
    envoy: Arc<Envoy>,
    buckets: Vec<Bucket>,
    per_second: f64,
    start: Instant,
    run: Duration,
    step: Duration,
) -> Vec<Admitted> {
    let mut admitted = vec![Admitted::default(); buckets.len()];
    let mut ticks = tokio::time::interval_at(start, step);
    let mut owed = 0.0;
    loop {
        let owed_at = ticks.tick().await;
        if owed_at.duration_since(start) >= run {
            return admitted;
        }
        owed += per_second * step.as_secs_f64();
        while owed >= 1.0 {
            owed -= 1.0;
            for (bucket, admitted) in buckets.iter().zip(&mut admitted) {
                let admission = envoy.request_admission(bucket);
                let at = start.elapsed();
                if admission != Admission::Denied {
                    admitted.at.push(at);
                }
                if admission == Admission::OnItsOwn {
                    admitted.on_its_own.push(at);
                }
            }
        }
    }
}

/// Waits until every Envoy has erased all its buckets (the server abandoned them), failing
/// after `within`.
async fn wait_until_abandoned(envoys: &[Arc<Envoy>], within: Duration) {
    let idle_since = Instant::now();
    for envoy in envoys {
        while !envoy.buckets().is_empty() {
            assert!(
                idle_since.elapsed() < within,
                "{} buckets left",
                envoy.buckets().len()
            );
            tokio::time::sleep(REPORT / 4).await;
        }
    }
}

/// User `user`'s bucket in round `round` of the 10,000-user test.
fn user_bucket(round: usize, user: usize) -> Bucket {
    bucket(&[("name", "user"), ("user", &format!("r{round}u{user}"))])
}

/// Subscribes every Envoy to its buckets and keeps them in use (a request each every 250 ms,
/// below the limit) until each enforces an assignment: the 10,000-user test measures
/// how the server shares, not how long 20,000 first answers take on a loaded machine (under a
/// busy loop, 2 to 3 s; meanwhile the Envoys allow all on their own, as their no-assignment
/// behaviour says). Kept in use so that none is idle for `abandon_after` reports meanwhile
/// (one request each, then a wait, had the server abandon them as it should).
async fn subscribe_all(envoys: &[Arc<Envoy>], buckets: &[Vec<Bucket>], round: usize) {
    let began = Instant::now();
    // Generous: unloaded it takes about a second.
    let within = Duration::from_secs(60);
    loop {
        for (envoy, buckets) in envoys.iter().zip(buckets) {
            for bucket in buckets {
                envoy.request(bucket);
            }
        }
        let unassigned = envoys
            .iter()
            .zip(buckets)
            .flat_map(|(envoy, buckets)| buckets.iter().map(move |bucket| (envoy, bucket)))
            .filter(|(envoy, bucket)| envoy.enforced(bucket) == Enforced::NoAssignment)
            .count();
        if unassigned == 0 {
            break;
        }
        assert!(
            began.elapsed() < within,
            "round {round}: {unassigned} buckets unassigned after {within:?}"
        );
        tokio::time::sleep(REPORT / 4).await;
    }
    eprintln!(
        "round {round}: 20,000 subscriptions assigned in {:?}",
        began.elapsed()
    );
}

/// What user `user` of round `round` of the 10,000-user test was told by each of its two
/// Envoys, and what they allowed on their own: the story of an over-admission.
fn explain(envoys: &[Arc<Envoy>], user: usize, round: usize) -> String {
    let bucket = user_bucket(round, user);
    let mut story = String::new();
    for index in [user % envoys.len(), (user + 1) % envoys.len()] {
        let envoy = &envoys[index];
        let told: Vec<String> = envoy
            .action_log()
            .into_iter()
            .filter(|(of, _)| *of == bucket)
            .map(|(_, action)| action)
            .collect();
        story += &format!(
            "envoy {index}: allowed {} on its own, streams {}, disconnects {:?}, told {told:?}; ",
            envoy.allowed_on_its_own(&bucket),
            envoy.streams_opened(),
            envoy.disconnects(),
        );
    }
    story
}

fn between(times: &[Duration], from: Duration, to: Duration) -> usize {
    times.iter().filter(|at| **at >= from && **at < to).count()
}

fn secs(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds)
}

fn assert_clean(envoys: &[Arc<Envoy>]) {
    for (index, envoy) in envoys.iter().enumerate() {
        assert_eq!(envoy.violations(), Vec::<String>::new(), "envoy {index}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_envoy_alone_gets_nearly_the_whole_limit_within_two_report_intervals() {
    let server = QuotaServer::start("");
    let envoy = envoy(&[&server]).await;
    let start = Instant::now();
    let admitted = offer(
        envoy.clone(),
        bucket(&[("name", "shared")]),
        300.0,
        start,
        secs(5.0),
    )
    .await;
    // After two intervals, three seconds at 100 per second: at least 95 % of it, at most the
    // limit, 2 % and the burst.
    let settled = between(&admitted, secs(2.0), secs(5.0));
    assert!(settled >= 285, "{settled} admitted of 300 in [2 s, 5 s)");
    assert!(settled <= 356, "{settled} admitted of 300 in [2 s, 5 s)");
    assert!(matches!(
        envoy.enforced(&bucket(&[("name", "shared")])),
        Enforced::TokenBucket { .. }
    ));
    assert!(
        envoy.ttls_received().iter().all(|ttl| *ttl == 3),
        "{:?}",
        envoy.ttls_received()
    );
    assert_clean(&[envoy]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_over_two_servers_share_one_limit_by_their_demand() {
    let redis = redis_support::RedisServer::start();
    let store = support::redis_store(&redis.url());
    let servers = [QuotaServer::start(&store), QuotaServer::start(&store)];
    let mut envoys = Vec::new();
    for index in 0..10 {
        envoys.push(envoy(&[&servers[index % 2]]).await);
    }
    let shared = bucket(&[("name", "shared")]);
    // One Envoy at 5× the others, one idle after its first request: 130 per second offered
    // of 100.
    assert!(envoys[9].request(&shared));
    let start = Instant::now();
    let run = secs(12.0);
    let demand = |index: usize| match index {
        0 => 50.0,
        9 => 0.0,
        _ => 10.0,
    };
    let tasks: Vec<_> = (0..10)
        .map(|index| {
            tokio::spawn(offer(
                envoys[index].clone(),
                shared.clone(),
                demand(index),
                start,
                run,
            ))
        })
        .collect();
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.push(task.await.unwrap());
    }
    let (from, to) = (secs(2.0), secs(12.0));
    let total: usize = admitted.iter().map(|times| between(times, from, to)).sum();
    // Ten seconds after the first two intervals: at most the limit, 2 % and the burst.
    assert!(
        total <= 1070,
        "{total} admitted in 10 s of a limit of 100 per second"
    );
    // Max-min fair by demand, of the 96 per second the holders share (the rest is kept for a
    // newcomer): the eight at 10 get their 10, the one at 50 the 15 they leave (the idle one
    // is counted at its 1 per second). 90 % of it from the second interval on.
    let rate = |index: usize| between(&admitted[index], secs(4.0), to) as f64 / 8.0;
    for index in 1..9 {
        assert!(
            rate(index) >= 9.0,
            "envoy {index} at {} of 10/s: {:?}",
            rate(index),
            rates(&admitted)
        );
    }
    assert!(
        rate(0) >= 13.5,
        "the heavy envoy at {}/s: {:?}",
        rate(0),
        rates(&admitted)
    );
    assert_clean(&envoys);
    let views = [servers[0].admin().await, servers[1].admin().await];
    for view in &views {
        assert_eq!(view["board"], "redis");
        assert_eq!(view["streams"], 5, "{view}");
    }
}

fn rates(admitted: &[Vec<Duration>]) -> Vec<f64> {
    admitted
        .iter()
        .map(|times| between(times, secs(4.0), secs(12.0)) as f64 / 8.0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_that_leaves_has_its_share_reclaimed_within_a_ttl_and_a_report() {
    let server = QuotaServer::start("");
    let shared = bucket(&[("name", "shared")]);
    let staying = envoy(&[&server]).await;
    let leaving = envoy(&[&server]).await;
    let start = Instant::now();
    let both = [staying.clone(), leaving.clone()]
        .map(|envoy| tokio::spawn(offer(envoy, shared.clone(), 100.0, start, secs(4.0))));
    for task in both {
        task.await.unwrap();
    }
    let half = |enforced: &Enforced| matches!(enforced, Enforced::TokenBucket { tokens_per_fill, .. } if (40..=60).contains(tokens_per_fill));
    assert!(
        half(&staying.enforced(&shared)),
        "{:?} {:?} {}",
        staying.enforced(&shared),
        staying.action_log(),
        server.admin().await
    );
    leaving.stop();
    let left = Instant::now();
    let keep_asking = tokio::spawn(offer(staying.clone(), shared.clone(), 100.0, left, TTL * 3));
    // What the leaver was last sent lives a TTL; then a second to settle and a report (or
    // the next tick) to raise.
    let reclaimed = staying
        .wait_for(&shared, TTL * 3, |enforced| {
            matches!(enforced, Enforced::TokenBucket { tokens_per_fill, .. } if *tokens_per_fill >= 90)
        })
        .await;
    let took = left.elapsed();
    keep_asking.abort();
    assert!(reclaimed, "{:?}", staying.enforced(&shared));
    assert!(took <= TTL + secs(3.0), "reclaimed after {took:?}");
    assert_clean(&[staying]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_buckets_each_hold_their_own_limit_and_idle_ones_are_abandoned() {
    let server = QuotaServer::start("");
    let envoys = [
        envoy(&[&server]).await,
        envoy(&[&server]).await,
        envoy(&[&server]).await,
    ];
    let users: Vec<Bucket> = (0..60)
        .map(|user| bucket(&[("name", "user"), ("user", &format!("u{user}"))]))
        .collect();
    let start = Instant::now();
    let run = secs(5.0);
    // Every user at 30 per second, spread over three Envoys: 3× its limit of 10.
    let mut tasks = Vec::new();
    for user in &users {
        for envoy in &envoys {
            tasks.push(tokio::spawn(offer(
                envoy.clone(),
                user.clone(),
                10.0,
                start,
                run,
            )));
        }
    }
    let mut per_user = vec![0; users.len()];
    for (index, task) in tasks.into_iter().enumerate() {
        per_user[index / envoys.len()] += between(&task.await.unwrap(), secs(2.0), run);
    }
    for (user, admitted) in per_user.iter().enumerate() {
        // Three seconds at 10 per second: at most the limit, 2 % and the burst of 10; at
        // least 80 % (three holders share it, each with room only from what the others leave).
        assert!(*admitted <= 41, "user {user}: {admitted} in 3 s of 10/s");
        assert!(
            *admitted >= 24,
            "user {user}: {admitted} in 3 s of 10/s {}",
            server.admin().await
        );
    }
    assert_eq!(server.limits_held().await, users.len());
    // Idle for three reports: abandoned by the server, erased by the Envoys.
    wait_until_abandoned(&envoys, REPORT * 8).await;
    let view = server.admin().await;
    assert_eq!(view["limits"].as_array().unwrap().len(), 0, "{view}");
    assert!(envoys.iter().all(|envoy| {
        envoy
            .action_log()
            .iter()
            .any(|(_, action)| action.contains("abandon"))
    }));
    assert_clean(&envoys);
}

/// Per-value buckets at the scale: 10,000 users over 10 Envoys, each user's requests
/// through two of them, each Envoy at the user's limit (together twice it), in two rounds of
/// different users, each counted once every bucket has its first assignment. Each user's
/// limit holds (what the server's assignments admitted: the Envoys' own no-assignment
/// behaviour, allow all, must admit under 1 % beside them, so every assignment was renewed in
/// time), and the users together get at least half of their limits; the server's memory per
/// holding is bounded; once
/// idle every bucket is abandoned and the server forgets its limit, so a second round of as
/// many new users fits in the memory the first round's left (a server that kept them would
/// need as much again). Measured here: 2.9 KiB per holding, the second round's resident
/// memory within 1 % of the first's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_users_over_ten_envoys_each_hold_their_limit_and_are_forgotten_when_idle() {
    const USERS: usize = 10_000;
    const ENVOYS: usize = 10;
    // Reports every 2 s, not 1 (Envoy: 5 s): the server, a debug build here, spent a core on
    // 20,000 reports a second, and under the suite's load fell a TTL behind (assignments ran
    // out, the Envoys allowed all).
    const EVERY: Duration = Duration::from_secs(2);
    let server = QuotaServer::start_reporting_every(EVERY, "");
    let mut envoys = Vec::new();
    for _ in 0..ENVOYS {
        envoys.push(envoy_reporting_every(&[&server], EVERY).await);
    }
    let idle_kib = server.gateway.rss_kib();
    let mut loaded_kib = Vec::new();
    for round in 0..2 {
        // User n goes through Envoys n % 10 and (n + 1) % 10.
        let mut mine: Vec<Vec<Bucket>> = vec![Vec::new(); ENVOYS];
        let mut whose: Vec<Vec<usize>> = vec![Vec::new(); ENVOYS];
        for user in 0..USERS {
            let bucket = user_bucket(round, user);
            for envoy in [user % ENVOYS, (user + 1) % ENVOYS] {
                mine[envoy].push(bucket.clone());
                whose[envoy].push(user);
            }
        }
        subscribe_all(&envoys, &mine, round).await;
        let start = Instant::now();
        let run = secs(7.0);
        // Four seconds, from when the shares have moved from the warm-up's demand.
        let from = secs(3.0);
        let step = Duration::from_millis(50);
        let tasks: Vec<_> = envoys
            .iter()
            .zip(mine)
            .map(|(envoy, buckets)| {
                tokio::spawn(offer_each(envoy.clone(), buckets, 10.0, start, run, step))
            })
            .collect();
        // Per user: admitted by the server's assignments, and by the Envoys on their own.
        let mut per_user = vec![(0, 0); USERS];
        for (task, users) in tasks.into_iter().zip(&whose) {
            for (admitted, user) in task.await.unwrap().iter().zip(users) {
                let on_its_own = between(&admitted.on_its_own, from, run);
                per_user[*user].0 += between(&admitted.at, from, run) - on_its_own;
                per_user[*user].1 += on_its_own;
            }
        }
        for (user, (assigned, _)) in per_user.iter().enumerate() {
            // Four seconds at 10 per second: at most the limit, 2 % and the burst of 10, and
            // what each changed assignment in the window started with (a changed token bucket
            // starts full at the Envoy: SPEC §10a; seen: 51 where its Envoys got three, of 16
            // tokens, as the shares moved from the warm-up's demand to the test's).
            let bucket = user_bucket(round, user);
            let fresh: u64 = [user % ENVOYS, (user + 1) % ENVOYS]
                .iter()
                .map(|index| envoys[*index].fresh_tokens(&bucket, start + from, start + run))
                .sum();
            assert!(
                *assigned as u64 <= 50 + fresh,
                "round {round}, user {user}: {assigned} in 4 s of 10/s, {fresh} fresh; {}",
                explain(&envoys, user, round)
            );
        }
        let assigned: usize = per_user.iter().map(|(assigned, _)| assigned).sum();
        let on_their_own: usize = per_user.iter().map(|(_, on_its_own)| on_its_own).sum();
        eprintln!("round {round}: {assigned} admitted by assignments, {on_their_own} on their own");
        // Every assignment renewed before it ran out: the Envoys (which allow all without
        // one) decided next to nothing on their own.
        let most = (0..USERS).max_by_key(|user| per_user[*user].1).unwrap_or(0);
        assert!(
            on_their_own * 100 <= assigned,
            "round {round}: {on_their_own} allowed by Envoys on their own, {assigned} by \
             assignments; the most, user {most}: {}",
            explain(&envoys, most, round)
        );
        // Served, not starved: at least half the limit over all users (unloaded, every user
        // gets 30 or more of 40). Not per user: on a machine the whole suite loads, the
        // Envoys' own 50 ms ticks bunch, and a bucket refuses a bunched burst (one user got
        // 13 of 40 so in a full run, every user within the bound).
        assert!(
            assigned >= USERS * 20,
            "round {round}: {assigned} admitted of {} in 4 s",
            USERS * 40
        );
        loaded_kib.push(server.gateway.rss_kib());
        assert_eq!(server.limits_held().await, USERS, "round {round}");
        // Idle for three reports: abandoned by the server, erased by the Envoys; the server
        // forgets the limits once their last shares end (a TTL and a step at most after).
        wait_until_abandoned(&envoys, EVERY * 10).await;
        let erased = Instant::now();
        loop {
            let held = server.limits_held().await;
            if held == 0 {
                break;
            }
            assert!(
                erased.elapsed() < EVERY * 6,
                "round {round}: {held} limits held {:?} after the Envoys erased them",
                erased.elapsed()
            );
            tokio::time::sleep(REPORT / 4).await;
        }
    }
    let holdings = (2 * USERS) as u64;
    let per_holding = (loaded_kib[0] - idle_kib) * 1024 / holdings;
    assert!(
        per_holding <= 16 * 1024,
        "{per_holding} bytes per holding (idle {idle_kib} KiB, loaded {} KiB)",
        loaded_kib[0]
    );
    // The second round's users fit in what the first round's left: a server that kept
    // abandoned buckets would need as much again.
    assert!(
        loaded_kib[1].saturating_sub(idle_kib) <= (loaded_kib[0] - idle_kib) * 3 / 2,
        "resident {loaded_kib:?} KiB under each round's load, idle {idle_kib} KiB"
    );
    // Every wire rule holds, actions after an abandon included (see
    // `a_report_sent_before_the_abandon_arrived_is_not_answered`).
    assert_clean(&envoys);
}

/// Two servers on `store` (a cluster, sharded Redis), one Envoy on each, 30 users each
/// requested through both at their limit (together twice it): every user's limit is shared by
/// the two servers, whichever node its record lives on.
async fn per_user_limits_hold_across_two_servers_on(store: &str) {
    let servers = [QuotaServer::start(store), QuotaServer::start(store)];
    let envoys = [envoy(&[&servers[0]]).await, envoy(&[&servers[1]]).await];
    let users: Vec<Bucket> = (0..30)
        .map(|user| bucket(&[("name", "user"), ("user", &format!("u{user}"))]))
        .collect();
    let start = Instant::now();
    let run = secs(5.0);
    let step = Duration::from_millis(10);
    let tasks: Vec<_> = envoys
        .iter()
        .map(|envoy| {
            tokio::spawn(offer_each(
                envoy.clone(),
                users.clone(),
                10.0,
                start,
                run,
                step,
            ))
        })
        .collect();
    let mut per_user = vec![0; users.len()];
    for task in tasks {
        for (user, admitted) in task.await.unwrap().iter().enumerate() {
            per_user[user] += between(&admitted.at, secs(2.0), run);
        }
    }
    for (user, admitted) in per_user.iter().enumerate() {
        // Three seconds at 10 per second: at most the limit, 2 % and the burst of 10 (two
        // servers each granting the whole limit would admit about 57); at least 80 %.
        assert!(*admitted <= 41, "user {user}: {admitted} in 3 s of 10/s");
        assert!(*admitted >= 24, "user {user}: {admitted} in 3 s of 10/s");
    }
    for server in &servers {
        assert_eq!(server.admin().await["board"], "redis");
    }
    assert_clean(&envoys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_limits_hold_across_two_servers_on_a_redis_cluster() {
    let cluster = redis_support::RedisCluster::start(3);
    let store = format!(
        "store: {{ backend: redis_cluster, nodes: [{}], timeout: 2s }}\n",
        redis_support::yaml_items(&cluster.urls())
    );
    per_user_limits_hold_across_two_servers_on(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_limits_hold_across_two_servers_on_sharded_redis() {
    let shards = [
        redis_support::RedisServer::start(),
        redis_support::RedisServer::start(),
    ];
    let store = format!(
        "store: {{ backend: redis_sharded, nodes: [{}], timeout: 2s }}\n",
        redis_support::yaml_items(&[shards[0].url(), shards[1].url()])
    );
    per_user_limits_hold_across_two_servers_on(&store).await;
    // Both shards hold records: the limits are spread as decisions' keys are.
    for shard in &shards {
        assert!(
            shard.command::<i64>(&["DBSIZE"]) > 0,
            "a shard holds no record"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_reports_both_services() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let server = QuotaServer::start("");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in [
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
        "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "no.such.Service".to_owned(),
        })
        .await;
    assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blanket_rule_and_an_unmatched_bucket_are_answered_as_written() {
    let server = QuotaServer::start("");
    let envoy = envoy(&[&server]).await;
    let off = bucket(&[("name", "off")]);
    let other = bucket(&[("name", "video")]);
    assert!(
        envoy.request(&off),
        "no assignment yet: Envoy's no-assignment behaviour"
    );
    envoy.request(&other);
    assert!(
        envoy
            .wait_for(&off, secs(2.0), |enforced| *enforced == Enforced::DenyAll)
            .await
    );
    assert!(
        envoy
            .wait_for(&other, secs(2.0), |enforced| *enforced
                == Enforced::AllowAll)
            .await
    );
    assert!(!envoy.request(&off));
    assert_clean(&[envoy]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_tells_its_envoys_at_once_and_they_move_to_the_other() {
    let redis = redis_support::RedisServer::start();
    let store = support::redis_store(&redis.url());
    let first = QuotaServer::start(&store);
    let second = QuotaServer::start(&store);
    let envoy = envoy(&[&first, &second]).await;
    let shared = bucket(&[("name", "shared")]);
    let traffic = tokio::spawn(offer(
        envoy.clone(),
        shared.clone(),
        50.0,
        Instant::now(),
        secs(10.0),
    ));
    let bucket_assigned = |enforced: &Enforced| matches!(enforced, Enforced::TokenBucket { .. });
    assert!(envoy.wait_for(&shared, secs(3.0), bucket_assigned).await);
    // Still on its first stream: a move before the stop would pass for one it caused (a
    // loaded run once failed below with no TTL 0 and no word of how the stream had ended).
    assert_eq!(envoy.streams_opened(), 1, "{:?}", envoy.disconnects());
    first.gateway.signal("TERM");
    let told = Instant::now();
    let moved = envoy
        .wait_for(&shared, secs(5.0), |_| envoy.streams_opened() >= 2)
        .await;
    assert!(moved, "{:?}", envoy.disconnects());
    assert!(
        envoy.ttls_received().contains(&0),
        "TTL 0 on shutdown: {:?}; the streams ended: {:?}",
        envoy.ttls_received(),
        envoy.disconnects()
    );
    // The second server assigns the bucket again on the Envoy's first report to it.
    assert!(envoy.wait_for(&shared, secs(3.0), bucket_assigned).await);
    assert!(told.elapsed() < secs(5.0));
    traffic.abort();
    assert_clean(&[envoy]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_follows_on_store_error_once_assignments_end() {
    for (policy, expected) in [("closed", "deny"), ("open", "allow"), ("local", "bucket")] {
        let mut redis = redis_support::RedisServer::start();
        let store = support::redis_store(&redis.url());
        let server = QuotaServer::start(&format!("{store}on_store_error: {policy}\n"));
        let envoy = envoy(&[&server]).await;
        let shared = bucket(&[("name", "shared")]);
        let traffic = tokio::spawn(offer(
            envoy.clone(),
            shared.clone(),
            20.0,
            Instant::now(),
            secs(15.0),
        ));
        let bucket_assigned =
            |enforced: &Enforced| matches!(enforced, Enforced::TokenBucket { .. });
        assert!(
            envoy.wait_for(&shared, secs(3.0), bucket_assigned).await,
            "{policy}"
        );
        redis.freeze();
        let frozen = Instant::now();
        let wanted = |enforced: &Enforced| match expected {
            "deny" => *enforced == Enforced::DenyAll,
            "allow" => *enforced == Enforced::AllowAll,
            _ => matches!(enforced, Enforced::TokenBucket { .. }),
        };
        // Kept until near its end, then the policy: within a TTL and a report or two.
        if expected != "bucket" {
            assert!(
                envoy.wait_for(&shared, TTL * 3, wanted).await,
                "{policy}: {:?}",
                envoy.enforced(&shared)
            );
            assert!(
                frozen.elapsed() >= secs(0.5),
                "{policy}: the assignment is kept for a while"
            );
        } else {
            // Past the assignment's end: then a bucket again, the fixed fallback share. A
            // server whose store calls each take their whole deadline (2 s here) may be late
            // with it on a loaded machine: a TTL more to deliver it.
            envoy.wait_for(&shared, TTL + REPORT * 2, |_| false).await;
            assert!(
                envoy.wait_for(&shared, TTL, wanted).await,
                "{policy}: {:?}",
                envoy.enforced(&shared)
            );
        }
        redis.thaw();
        traffic.abort();
        assert_clean(&[envoy]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_a_limit_reaches_the_envoys_within_a_few_steps() {
    let server = QuotaServer::start("");
    let envoy = envoy(&[&server]).await;
    let shared = bucket(&[("name", "shared")]);
    let traffic = tokio::spawn(offer(
        envoy.clone(),
        shared.clone(),
        200.0,
        Instant::now(),
        secs(12.0),
    ));
    let rate_at_most = |most: u32| {
        move |enforced: &Enforced| {
            matches!(enforced, Enforced::TokenBucket { tokens_per_fill, fill_interval_secs, .. }
                if u64::from(*tokens_per_fill) <= u64::from(most) * fill_interval_secs)
        }
    };
    let near_whole = |enforced: &Enforced| {
        matches!(enforced, Enforced::TokenBucket { tokens_per_fill, fill_interval_secs, .. }
            if u64::from(*tokens_per_fill) >= 90 * fill_interval_secs)
    };
    assert!(
        envoy.wait_for(&shared, secs(4.0), near_whole).await,
        "{:?}",
        envoy.enforced(&shared)
    );
    let path = server.directory.file("floodgate.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let lowered = text.replace(
        "limit: { limit: 100, window: 1s, burst: 50 }",
        "limit: { limit: 20, window: 1s, burst: 10 }",
    );
    assert_ne!(text, lowered);
    support::write_atomically(&path, &lowered);
    let (status, body) = support::admin_reload(&client(), &server.gateway).await;
    assert_eq!(status, 200, "{body}");
    let reloaded = Instant::now();
    // Every holding is decided again at the stream's next step (200 ms here).
    assert!(
        envoy.wait_for(&shared, secs(2.0), rate_at_most(20)).await,
        "{:?}",
        envoy.enforced(&shared)
    );
    assert!(reloaded.elapsed() < secs(2.0));
    traffic.abort();
    assert_clean(&[envoy]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_dies_leaves_its_shares_counted_until_they_end() {
    let redis = redis_support::RedisServer::start();
    let store = support::redis_store(&redis.url());
    let mut first = QuotaServer::start(&store);
    let second = QuotaServer::start(&store);
    let shared = bucket(&[("name", "shared")]);
    let moving = envoy(&[&first, &second]).await;
    let staying = envoy(&[&second]).await;
    let start = Instant::now();
    let run = secs(14.0);
    let traffic = [moving.clone(), staying.clone()]
        .map(|envoy| tokio::spawn(offer(envoy, shared.clone(), 100.0, start, run)));
    let half = |enforced: &Enforced| {
        matches!(enforced, Enforced::TokenBucket { tokens_per_fill, fill_interval_secs, .. }
            if u64::from(*tokens_per_fill) >= 40 * fill_interval_secs)
    };
    assert!(
        moving.wait_for(&shared, secs(5.0), half).await,
        "{:?}",
        moving.enforced(&shared)
    );
    // No graceful stop: the Envoy keeps what it was sent until its TTL, and the board counts
    // it till then, whoever it reconnects to.
    first.gateway.child.kill().unwrap();
    first.gateway.child.wait().unwrap();
    let died = start.elapsed();
    let mut admitted = Vec::new();
    for task in traffic {
        admitted.push(task.await.unwrap());
    }
    assert!(moving.streams_opened() >= 2, "{:?}", moving.disconnects());
    // From the death on: at most the limit over the rest of the run, 2 % and the burst.
    let total: usize = admitted.iter().map(|times| between(times, died, run)).sum();
    let allowed = (run - died).as_secs_f64() * 100.0 * 1.02 + 50.0;
    assert!(
        (total as f64) <= allowed,
        "{total} admitted in {:?} after the death",
        run - died
    );
    // And the moved Envoy gets its half back once the dead server's claim ends (a TTL and a
    // step), within the run.
    assert!(
        half(&moving.enforced(&shared)),
        "{:?}",
        moving.enforced(&shared)
    );
    assert_clean(&[moving, staying]);
}

/// Offers `first` per second until `switch`, then `then` per second until `run`.
async fn offer_changing(
    envoy: Arc<Envoy>,
    bucket: Bucket,
    (first, then): (f64, f64),
    start: Instant,
    (switch, run): (Duration, Duration),
) -> Vec<Duration> {
    let mut admitted = offer(envoy.clone(), bucket.clone(), first, start, switch).await;
    let later = offer(envoy, bucket, then, start + switch, run - switch).await;
    admitted.extend(later.into_iter().map(|at| at + switch));
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_demand_shifts_each_envoy_has_its_fair_share_within_two_intervals() {
    let server = QuotaServer::start("");
    let shared = bucket(&[("name", "shared")]);
    let envoys = [
        envoy(&[&server]).await,
        envoy(&[&server]).await,
        envoy(&[&server]).await,
    ];
    // Before the shift: 80, 10, 10 per second; after it, at 5 s: 10, 80, 10. The holders share
    // 96 per second (the rest is kept for a newcomer): after the shift the second is owed 76.
    let demands = [(80.0, 10.0), (10.0, 80.0), (10.0, 10.0)];
    let start = Instant::now();
    let (switch, run) = (secs(5.0), secs(10.0));
    let tasks: Vec<_> = envoys
        .iter()
        .zip(demands)
        .map(|(envoy, demand)| {
            tokio::spawn(offer_changing(
                envoy.clone(),
                shared.clone(),
                demand,
                start,
                (switch, run),
            ))
        })
        .collect();
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.push(task.await.unwrap());
    }
    // From two report intervals after the shift to the end: three seconds.
    let from = switch + REPORT * 2;
    let rate =
        |index: usize| between(&admitted[index], from, run) as f64 / (run - from).as_secs_f64();
    let rates: Vec<f64> = (0..3).map(rate).collect();
    assert!(rates[1] >= 0.9 * 76.0, "the one that rose: {rates:?}");
    assert!(
        rates[0] >= 9.0 && rates[2] >= 9.0,
        "the others get their 10: {rates:?}"
    );
    let total: usize = admitted.iter().map(|times| between(times, from, run)).sum();
    assert!(total as f64 <= 3.0 * 100.0 * 1.02 + 50.0, "{total} in 3 s");
    assert_clean(&envoys);
}

/// Regression (the 10,000-user test, under load: 4,000 actions for buckets an Envoy had
/// erased): a report sent before the Envoy received the abandon of its bucket (on its way,
/// or queued at the server behind the report that abandoned it) is not a subscription. The
/// server answered it with an assignment Envoy drops, and held a share nobody reported. A
/// request for the bucket afterwards subscribes to it again, and is answered.
///
/// Written as a raw stream, reports sent at once and in order: a subscription of `idle` with
/// a request, `abandon_after` (3) idle reports (the third abandons it), the late idle report,
/// then a subscription of `marker`, whose answer shows every report before it was handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_sent_before_the_abandon_arrived_is_not_answered() {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
        BucketId, RateLimitQuotaUsageReports,
    };
    use tonic::codegen::tokio_stream::{self, StreamExt};

    let server = QuotaServer::start("");
    let report = |user: &str, requests: u64| RateLimitQuotaUsageReports {
        domain: "api".to_owned(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("name", "user"), ("user", user)]
                    .into_iter()
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
                    .collect(),
            }),
            time_elapsed: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 1,
                nanos: 0,
            }),
            num_requests_allowed: requests,
            num_requests_denied: 0,
        }],
    };
    let (sender, reports) = tokio::sync::mpsc::unbounded_channel();
    for (user, requests) in [
        ("idle", 1),
        ("idle", 0),
        ("idle", 0),
        ("idle", 0),
        ("idle", 0),
    ] {
        sender.send(report(user, requests)).unwrap();
    }
    sender.send(report("marker", 1)).unwrap();
    let outbound = tokio_stream::wrappers::UnboundedReceiverStream::new(reports);
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", server.address))
        .await
        .unwrap();
    let mut answers = client
        .stream_rate_limit_quotas(outbound)
        .await
        .unwrap()
        .into_inner();
    // What each bucket was told, in order, until `marker`'s first answer.
    let mut told: Vec<(String, &str)> = Vec::new();
    let deadline = Duration::from_secs(10);
    let heard = |told: &[(String, &str)], user: &str, what: &str| {
        told.iter().any(|(of, kind)| of == user && *kind == what)
    };
    let mut read = async |told: &mut Vec<(String, &str)>| {
        let answer = tokio::time::timeout(deadline, answers.next())
            .await
            .expect("an answer within 10 s")
            .expect("the stream open")
            .unwrap();
        for action in answer.bucket_action {
            let user = action.bucket_id.unwrap().bucket["user"].clone();
            let kind = match action.bucket_action {
                Some(Action::AbandonAction(_)) => "abandon",
                Some(Action::QuotaAssignmentAction(_)) => "assign",
                None => "empty",
            };
            told.push((user, kind));
        }
    };
    while !heard(&told, "marker", "assign") {
        read(&mut told).await;
    }
    let idle: Vec<&str> = told
        .iter()
        .filter(|(user, _)| user == "idle")
        .map(|(_, kind)| *kind)
        .collect();
    assert_eq!(idle, ["assign", "assign", "assign", "abandon"], "{told:?}");
    // A request for it after the erase subscribes to it again.
    sender.send(report("idle", 1)).unwrap();
    let before = told.len();
    while !told[before..].iter().any(|(user, _)| user == "idle") {
        read(&mut told).await;
    }
    assert_eq!(told[before..][0], ("idle".to_owned(), "assign"), "{told:?}");
}
