//! A fleet of batched nodes in one process: `N` independent [`BatchedStore`]s, each with its
//! own connection and its own clock-driven trading task (as `N` gateways would have), against
//! one real Redis; traffic shapes driven through them in real time; what they admitted against
//! what the limit allowed, and the Redis calls it took.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::store::{BatchedStore, RedisStore};
use floodgate::{Limit, Store, store::Check};

/// How the traffic of one client spreads over the fleet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shape {
    /// `rate` requests a second, round-robin over every node.
    Uniform {
        /// Requests a second, in all.
        rate: u64,
    },
    /// `rate` requests a second, `share` of them on node 0 and the rest round-robin.
    Skewed {
        /// Requests a second, in all.
        rate: u64,
        /// Node 0's share (0 to 1).
        share: f64,
    },
    /// `per_node` requests at once on every node, from a fresh key (a cold burst).
    ColdBurst {
        /// Requests each node receives at once.
        per_node: u64,
    },
    /// `rate` requests a second on node 0 for the first half, then on node 1.
    Moving {
        /// Requests a second.
        rate: u64,
    },
}

impl Shape {
    /// A short name for tables.
    pub fn name(&self) -> String {
        match self {
            Shape::Uniform { rate } => format!("uniform {rate}/s"),
            Shape::Skewed { rate, share } => {
                format!("skewed {rate}/s, {:.0}% on one", share * 100.0)
            }
            Shape::ColdBurst { per_node } => format!("cold burst, {per_node} at once per node"),
            Shape::Moving { rate } => format!("moving {rate}/s, node 0 then 1"),
        }
    }
}

/// What a run admitted.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// Requests sent.
    pub requests: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// What the limit allowed over the run: its capacity plus its refill while the run lasted
    /// (from the first decision to the last).
    pub allowance: f64,
    /// The run's length.
    pub elapsed: Duration,
    /// Script calls Redis ran during the run.
    pub calls: u64,
}

impl Report {
    /// Admitted minus allowance, as a share of the allowance.
    pub fn error(&self) -> f64 {
        (self.admitted as f64 - self.allowance) / self.allowance
    }

    /// Script calls per node per interval.
    pub fn calls_per_node_interval(&self, nodes: usize, interval: Duration) -> f64 {
        let intervals = self.elapsed.as_secs_f64() / interval.as_secs_f64();
        self.calls as f64 / nodes as f64 / intervals.max(1.0)
    }
}

/// `N` batched nodes on one Redis.
pub struct Fleet {
    /// The nodes.
    pub nodes: Vec<BatchedStore<RedisStore>>,
    url: String,
    /// Their trading interval.
    pub interval: Duration,
}

impl Fleet {
    /// `count` nodes on the Redis at `url`, trading every `interval`. Call from inside a Tokio
    /// runtime (each node starts its trading task).
    pub fn start(url: &str, count: usize, interval: Duration) -> Fleet {
        let nodes = (0..count)
            .map(|_| {
                let store = RedisStore::builder(url.to_owned())
                    .timeout(Duration::from_secs(2))
                    .build()
                    .expect("a Redis store");
                BatchedStore::builder(store).sync_interval(interval).build()
            })
            .collect();
        Fleet {
            nodes,
            url: url.to_owned(),
            interval,
        }
    }

    fn script_calls(&self) -> u64 {
        let client = deadpool_redis::redis::Client::open(self.url.as_str()).expect("a Redis URL");
        let mut connection = client.get_connection().expect("Redis answers");
        let info: String = deadpool_redis::redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut connection)
            .expect("INFO");
        crate::script_calls_in(&info)
    }

    /// Drives `shape` for `duration` (a cold burst: at once) against `limit` on a key of
    /// `client`, and reports. The limit's refill rate is taken as `limit / window`.
    pub async fn run(
        &self,
        shape: Shape,
        limit: &Arc<Limit>,
        client: &str,
        duration: Duration,
    ) -> Report {
        let checks = [Check::new(
            format!("fgfleet:{{key:{client}}}:plan:{}", limit.name()),
            limit.clone(),
            1,
        )];
        let calls_before = self.script_calls();
        let started = Instant::now();
        // The instant the first request could be decided: a cold burst's refill runs from its
        // release, not from the spawning before it.
        let (requests, admitted, began) = match shape {
            Shape::ColdBurst { per_node } => {
                // Every request waits until all are spawned, so that they arrive at once, as
                // the shape says, and not spread over the spawning while earlier ones' trades
                // are answered (a trickle that doubling top-ups meet differently).
                let start = Arc::new(tokio::sync::Barrier::new(
                    self.nodes.len() * per_node as usize + 1,
                ));
                let mut tasks = Vec::new();
                for node in &self.nodes {
                    for _ in 0..per_node {
                        let (node, checks, start) = (node.clone(), checks.clone(), start.clone());
                        tasks.push(tokio::spawn(async move {
                            start.wait().await;
                            node.check_and_consume(&checks, None)
                                .await
                                .is_ok_and(|decision| decision.is_allowed())
                        }));
                    }
                }
                start.wait().await;
                let released = Instant::now();
                let mut admitted = 0;
                let requests = tasks.len() as u64;
                for task in tasks {
                    admitted += u64::from(task.await.unwrap_or(false));
                }
                (requests, admitted, released)
            }
            Shape::Uniform { rate } | Shape::Skewed { rate, .. } | Shape::Moving { rate } => {
                let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let total = (rate as f64 * duration.as_secs_f64()) as u64;
                let mut admitted = 0;
                let nodes = self.nodes.len();
                for sent in 0..total {
                    ticks.tick().await;
                    let node = match shape {
                        Shape::Uniform { .. } => sent as usize % nodes,
                        Shape::Skewed { share, .. } => {
                            // Every request on node 0 until its share is met, else the others.
                            let on_zero = (sent as f64 * share).floor() as u64
                                != ((sent + 1) as f64 * share).floor() as u64;
                            if on_zero || nodes == 1 {
                                0
                            } else {
                                1 + sent as usize % (nodes - 1)
                            }
                        }
                        _ => usize::from(sent * 2 >= total).min(nodes - 1),
                    };
                    let decision = self.nodes[node].check_and_consume(&checks, None).await;
                    admitted += u64::from(decision.is_ok_and(|decision| decision.is_allowed()));
                }
                (total, admitted, started)
            }
        };
        let elapsed = began.elapsed();
        let rate = limit.limit() as f64 / limit.window().as_secs_f64();
        let allowance = limit.capacity() as f64 + rate * elapsed.as_secs_f64();
        // Every node's next round: the calls the run's leases cost.
        tokio::time::sleep(self.interval * 2).await;
        let calls = self.script_calls() - calls_before;
        Report {
            requests,
            admitted,
            allowance,
            elapsed,
            calls,
        }
    }
}
