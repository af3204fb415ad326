//! floodgate as Envoy's Rate Limit Quota Service (SPEC §10a):
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`, served on
//! the rate limit service's listener. Each Envoy enforces its buckets' assignments locally and
//! reports its usage on one stream; floodgate shares each limit among every Envoy reporting
//! it, through every floodgate server, by their demand (`floodgate::store::quota`).
//!
//! - [`buckets`]: a reported bucket matched to its rule and its limit's key.
//! - [`assignment`]: shares as the token buckets and blanket rules Envoy's filter reads.
//! - [`stream`]: one Envoy's stream, from its reports to its assignments.
//! - `counters`: a stream's metrics, registered once per domain.

pub(crate) mod assignment;
pub(crate) mod buckets;
mod counters;
pub(crate) mod stream;

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use floodgate::store::quota::QuotaBoard;
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use self::assignment::Strategy;
use crate::gateway::Gateway;
use crate::telemetry;

/// What every stream of this server shares.
pub(crate) struct Shared {
    gateway: Arc<Gateway>,
    board: QuotaBoard,
    /// This server's name on the board (random per process: a restarted server is another).
    server: String,
    /// `true` once the server shuts down.
    shutdown: watch::Sender<bool>,
    views: Views,
}

/// The quota service: one task per Envoy stream.
pub(crate) struct QuotaService {
    shared: Arc<Shared>,
    streams: AtomicU64,
}

impl QuotaService {
    /// A service for `gateway`'s quota rules, sharing on `board`.
    pub(crate) fn new(gateway: Arc<Gateway>, board: QuotaBoard) -> QuotaService {
        let (shutdown, _) = watch::channel(false);
        QuotaService {
            shared: Arc::new(Shared {
                gateway,
                board,
                server: format!("{:016x}", fastrand::u64(..)),
                shutdown,
                views: Views::default(),
            }),
            streams: AtomicU64::new(0),
        }
    }

    /// Tells every Envoy its assignments end now (TTL 0) and waits, up to `within`, for the
    /// streams to end, so that the Envoys fall back at once and reconnect to another server.
    pub(crate) async fn shut_down(&self, within: Duration) {
        self.shared.shutdown.send_replace(true);
        let _ = tokio::time::timeout(within, async {
            while self.shared.views.streams() > 0 {
                self.shared.views.changed.notified().await;
            }
        })
        .await;
    }

    /// This server's holdings, grouped by bucket, for `GET /admin/rlqs`: every stream asked
    /// for them, each answering at its next step (a stream that does not within two seconds
    /// shows what it last published).
    pub(crate) async fn snapshot(&self) -> QuotaSnapshot {
        self.shared.views.refresh(Duration::from_secs(2)).await;
        self.shared.views.snapshot(self.shared.board.backend())
    }
}

/// The stream of answers to one Envoy.
type Answers = Pin<
    Box<
        dyn tonic::codegen::tokio_stream::Stream<
                Item = Result<RateLimitQuotaResponse, tonic::Status>,
            > + Send,
    >,
>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        if *self.shared.shutdown.borrow() {
            return Err(tonic::Status::unavailable("floodgate is shutting down"));
        }
        let id = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        let (outbound, answers) = mpsc::channel(16);
        self.shared.views.open(id);
        tokio::spawn(stream::run(
            request.into_inner(),
            outbound,
            self.shared.clone(),
            id,
        ));
        Ok(tonic::Response::new(Box::pin(
            tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(answers),
        )))
    }
}

/// One holding as `GET /admin/rlqs` shows it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct HoldingView {
    domain: String,
    bucket: BTreeMap<String, String>,
    rule: Option<String>,
    #[serde(skip)]
    key: Option<String>,
    holder: String,
    demand_per_second: f64,
    share_per_second: f64,
    fair_per_second: f64,
    #[serde(serialize_with = "strategy_label")]
    strategy: Option<Strategy>,
    expires_in_ms: u64,
}

fn strategy_label<S: serde::Serializer>(
    strategy: &Option<Strategy>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match strategy {
        Some(Strategy::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval_secs,
        }) => serializer.serialize_str(&format!(
            "token_bucket {tokens_per_fill}/{fill_interval_secs}s max {max_tokens}"
        )),
        Some(other) => serializer.serialize_str(other.label()),
        None => serializer.serialize_none(),
    }
}

/// Every stream's holdings, as last published. Streams publish only when asked (the admin API
/// raises `requested`; each stream answers at its next step), so that nothing is copied while
/// nobody looks.
#[derive(Default)]
struct Views {
    /// Per stream: the request it last answered, and its holdings then.
    streams: Mutex<HashMap<u64, (u64, Vec<HoldingView>)>>,
    /// The last request for fresh views.
    requested: AtomicU64,
    /// A stream published or ended.
    changed: tokio::sync::Notify,
}

impl Views {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (u64, Vec<HoldingView>)>> {
        self.streams
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// A stream starts (and has nothing to show).
    fn open(&self, stream: u64) {
        let streams = {
            let mut views = self.lock();
            views.insert(stream, (0, Vec::new()));
            views.len()
        };
        metrics::gauge!(telemetry::RLQS_STREAMS).set(streams as f64);
    }

    /// Whether fresh views were asked for since `stream` last published.
    fn wanted(&self, stream: u64) -> bool {
        let requested = self.requested.load(Ordering::Acquire);
        self.lock()
            .get(&stream)
            .is_some_and(|(answered, _)| *answered < requested)
    }

    fn set(&self, stream: u64, holdings: Vec<HoldingView>) {
        let requested = self.requested.load(Ordering::Acquire);
        self.lock().insert(stream, (requested, holdings));
        self.changed.notify_waiters();
    }

    fn remove(&self, stream: u64) {
        let streams = {
            let mut views = self.lock();
            views.remove(&stream);
            views.len()
        };
        metrics::gauge!(telemetry::RLQS_STREAMS).set(streams as f64);
        self.changed.notify_waiters();
    }

    fn streams(&self) -> usize {
        self.lock().len()
    }

    /// Asks every stream for its holdings and waits, up to `within`, for all to answer.
    async fn refresh(&self, within: Duration) {
        let request = self.requested.fetch_add(1, Ordering::AcqRel) + 1;
        let _ = tokio::time::timeout(within, async {
            loop {
                let changed = self.changed.notified();
                if self
                    .lock()
                    .values()
                    .all(|(answered, _)| *answered >= request)
                {
                    return;
                }
                changed.await;
            }
        })
        .await;
    }

    fn snapshot(&self, board: &'static str) -> QuotaSnapshot {
        let views = self.lock();
        let mut buckets: BTreeMap<String, BucketSnapshot> = BTreeMap::new();
        for view in views.values().flat_map(|(_, holdings)| holdings) {
            let name = view
                .key
                .clone()
                .unwrap_or_else(|| format!("{}:{:?}", view.domain, view.bucket));
            let bucket = buckets.entry(name).or_insert_with(|| BucketSnapshot {
                domain: view.domain.clone(),
                rule: view.rule.clone(),
                holders: Vec::new(),
                share_per_second: 0.0,
            });
            bucket.share_per_second += view.share_per_second;
            bucket.holders.push(view.clone());
        }
        QuotaSnapshot {
            board,
            streams: views.len(),
            limits: buckets.into_values().collect(),
        }
    }
}

/// `GET /admin/rlqs`: this server's streams and what their Envoys hold.
#[derive(Debug, Serialize)]
pub(crate) struct QuotaSnapshot {
    board: &'static str,
    streams: usize,
    limits: Vec<BucketSnapshot>,
}

/// One limit (or unlimited bucket) as this server's Envoys hold it.
#[derive(Debug, Serialize)]
struct BucketSnapshot {
    domain: String,
    rule: Option<String>,
    /// The shares this server's Envoys hold together (other servers' are not shown).
    share_per_second: f64,
    holders: Vec<HoldingView>,
}
