//! Through the layer: an operator's peek and reset of one client, and costs known only after
//! the response (SPEC §9).

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::{remaining, send};
use floodgate::store::{BoxFuture, Check, Lease};
use floodgate::{
    Decision, Limit, MemoryStore, PeerAddr, RateLimitLayer, Store, StoreError,
    post_charge::CostHeader, post_charge::ReportedCost, time::FakeClock, time::Timestamp,
};
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::Full;
use tower::{Layer, ServiceExt as _, service_fn};

const START: Timestamp = Timestamp::from_secs(1_700_006_400);
const TOKENS_USED: HeaderName = HeaderName::from_static("x-tokens-used");

fn client(key: &str) -> http::request::Builder {
    let peer: SocketAddr = "203.0.113.9:4000".parse().unwrap();
    Request::builder()
        .uri("/v1/completions")
        .header("x-api-key", key)
        .extension(PeerAddr(peer))
}

/// An upstream that reports `used` in `x-tokens-used`.
fn reporting(
    used: &'static str,
) -> impl Fn(Request<()>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>> + Clone {
    move |_| {
        let mut response = Response::new(Full::new(Bytes::from_static(b"done")));
        response
            .headers_mut()
            .insert(TOKENS_USED, http::HeaderValue::from_static(used));
        std::future::ready(Ok(response))
    }
}

fn token_budget(clock: &FakeClock) -> floodgate::RateLimitLayerBuilder {
    RateLimitLayer::builder()
        .limit(Limit::token_bucket("tokens", 100, Duration::from_secs(100)).unwrap())
        .store(MemoryStore::builder().clock(clock.clone()).build())
        .retry_after_jitter(0.0)
}

#[tokio::test]
async fn a_hundred_token_budget_admits_three_forty_token_requests_then_waits_out_the_debt() {
    let clock = FakeClock::new(START);
    let layer = token_budget(&clock)
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(reporting("40")));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let response = send(&service, client("k1")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            !response.headers().contains_key(&TOKENS_USED),
            "the upstream's accounting is not the client's"
        );
        seen.push(remaining(&response));
    }
    // Each admission shows the state before its own post-charge: 99, then 99 − 40, then 59 − 40.
    assert_eq!(seen, [99, 59, 19]);
    let denied = send(&service, client("k1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // 20 tokens of debt and 1 for the request, at one token a second.
    assert_eq!(denied.headers()["retry-after"], "21");
    clock.advance(Duration::from_secs(20));
    assert_eq!(
        send(&service, client("k1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the debt is not paid yet"
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(send(&service, client("k1")).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_visible_cost_header_reaches_the_client() {
    let clock = FakeClock::new(START);
    let layer = token_budget(&clock)
        .charge_from_response(CostHeader::new(TOKENS_USED).visible(true))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(reporting("40")));
    let response = send(&service, client("k1")).await;
    assert_eq!(response.headers()[&TOKENS_USED], "40");
}

#[tokio::test]
async fn malformed_or_missing_costs_charge_nothing_more() {
    let clock = FakeClock::new(START);
    for used in ["forty", "-3", ""] {
        let layer = token_budget(&clock)
            .charge_from_response(CostHeader::new(TOKENS_USED))
            .build()
            .unwrap();
        let service = layer.layer(service_fn(reporting(used)));
        let remaining: Vec<u64> = {
            let mut seen = Vec::new();
            for _ in 0..3 {
                seen.push(remaining(&send(&service, client("k1")).await));
            }
            seen
        };
        assert_eq!(remaining, [99, 98, 97], "x-tokens-used: {used:?}");
    }
}

#[tokio::test]
async fn an_inner_service_can_report_the_cost_in_the_response_extensions() {
    let clock = FakeClock::new(START);
    let layer = token_budget(&clock).build().unwrap();
    let service = layer.layer(service_fn(|_: Request<()>| async {
        let mut response = Response::new(Full::new(Bytes::new()));
        response.extensions_mut().insert(ReportedCost::Total(50));
        Ok::<_, Infallible>(response)
    }));
    assert_eq!(remaining(&send(&service, client("k1")).await), 99);
    assert_eq!(remaining(&send(&service, client("k1")).await), 49);
}

/// A memory store that decides at once but, like a networked store, lets its post-charges
/// wait: each yields once to the runtime before it charges.
struct ChargesAfterAYield(MemoryStore);

impl Store for ChargesAfterAYield {
    fn check_and_consume<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.0.check_and_consume(checks, now)
    }

    fn check_and_consume_ready(
        &self,
        checks: &[Check],
        now: Option<Timestamp>,
    ) -> Option<Result<Decision, StoreError>> {
        self.0.check_and_consume_ready(checks, now)
    }

    fn release<'a>(&'a self, leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        self.0.release(leases)
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    fn charge<'a>(
        &'a self,
        checks: &'a [Check],
        now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.0.charge(checks, now).await
        })
    }
}

/// A request admitted at once whose response reports a cost that the store settles only after
/// a wait: the answer comes once the charge is made (the layer's future wakes for it), with
/// the headers of the decision, and the next request sees the charge.
#[tokio::test]
async fn a_post_charge_that_waits_is_made_before_the_answer() {
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::token_bucket("tokens", 100, Duration::from_secs(100)).unwrap())
        .store(ChargesAfterAYield(
            MemoryStore::builder().clock(clock.clone()).build(),
        ))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(reporting("40")));
    // Generous: a future that lost its waker would never answer.
    let within = Duration::from_secs(10);
    let first = tokio::time::timeout(within, send(&service, client("k1")))
        .await
        .expect("answered");
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(remaining(&first), 99);
    let second = tokio::time::timeout(within, send(&service, client("k1")))
        .await
        .expect("answered");
    assert_eq!(
        remaining(&second),
        59,
        "99 - 39 charged after the first answer - 1"
    );
}

#[tokio::test]
async fn peek_reads_a_client_without_consuming_and_reset_unblocks_it() {
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("per-minute", 3, Duration::from_secs(60)).unwrap())
        .store(MemoryStore::builder().clock(clock.clone()).build())
        .build()
        .unwrap();
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let last = send(&service, client("blocked")).await;
    send(&service, client("other")).await;
    for _ in 0..2 {
        let look = layer
            .peek(&client("blocked").body(()).unwrap())
            .await
            .unwrap()
            .expect("a limit applies");
        assert_eq!(look.limits()[0].remaining, remaining(&last));
    }
    assert_eq!(remaining(&send(&service, client("blocked")).await), 1);
    send(&service, client("blocked")).await;
    let look = layer
        .peek(&client("blocked").body(()).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(!look.is_allowed());
    assert_eq!(look.retry_after(), Some(Duration::from_secs(60)));

    let reset = layer
        .reset(&client("blocked").body(()).unwrap(), None)
        .await
        .unwrap();
    assert_eq!(reset, 1);
    assert_eq!(
        send(&service, client("blocked")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        remaining(&send(&service, client("other")).await),
        1,
        "another client is untouched"
    );
    assert_eq!(
        layer
            .reset(&client("blocked").body(()).unwrap(), Some("no-such-limit"))
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn a_shadow_denial_is_not_post_charged() {
    let clock = FakeClock::new(START);
    let layer = token_budget(&clock)
        .rollout(floodgate::rollout::Rollout::new(
            floodgate::rollout::Mode::Shadow,
            100.0,
        ))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(reporting("40")));
    // Three admitted and charged (20 tokens of debt), then one the limit would have denied.
    for _ in 0..4 {
        assert_eq!(send(&service, client("k1")).await.status(), StatusCode::OK);
    }
    let look = layer
        .peek(&client("k1").body(()).unwrap())
        .await
        .unwrap()
        .unwrap();
    // Had the shadow denial been charged its 39, the wait would be 60 s.
    assert_eq!(look.retry_after(), Some(Duration::from_secs(21)));
}

#[tokio::test]
async fn an_absurd_reported_cost_is_capped_and_never_fails_the_request() {
    let clock = FakeClock::new(START);
    let layer = token_budget(&clock)
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let service = layer.layer(service_fn(reporting("18446744073709551615")));
    let response = send(&service, client("k1")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let look = layer
        .peek(&client("k1").body(()).unwrap())
        .await
        .unwrap()
        .unwrap();
    // Capped at 16 capacities of debt (1,600 tokens at one a second), not wrapped around.
    let wait = look.retry_after().expect("in debt");
    assert!(
        wait > Duration::from_secs(1_500) && wait <= Duration::from_secs(1_601),
        "{wait:?}"
    );
}

#[tokio::test]
async fn the_cost_header_is_removed_even_when_nothing_is_charged() {
    let clock = FakeClock::new(START);
    let allowlisted = token_budget(&clock)
        .allowlist(floodgate::lists::ClientList::new().api_key("vip"))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let response = send(
        &allowlisted.layer(service_fn(reporting("40"))),
        client("vip"),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        !response.headers().contains_key(&TOKENS_USED),
        "allowlisted"
    );

    let off = token_budget(&clock)
        .rollout(floodgate::rollout::Rollout::new(
            floodgate::rollout::Mode::Off,
            100.0,
        ))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let response = send(&off.layer(service_fn(reporting("40"))), client("k1")).await;
    assert!(
        !response.headers().contains_key(&TOKENS_USED),
        "rollout off"
    );
}

/// Units `k1` has used of its 1,000, read without consuming.
async fn used(layer: &RateLimitLayer) -> u64 {
    let request = client("k1").body(()).unwrap();
    let look = layer.peek(&request).await.unwrap().unwrap();
    1_000 - look.limits()[0].remaining
}

/// SPEC §9's settlement: a request with an estimate (`x-max-tokens`) reserves `estimate_max`
/// (400) up front, whatever it estimates, and is settled against what the response reports:
/// under the reservation gives the difference back, over it charges the rest, and no report
/// leaves the reservation charged.
#[tokio::test]
async fn an_estimate_is_settled_against_the_reported_cost_both_ways() {
    use floodgate::post_charge::EstimateHeader;
    const MAX_TOKENS: HeaderName = HeaderName::from_static("x-max-tokens");
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("tokens", 1_000, Duration::from_secs(3_600)).unwrap())
        .store(MemoryStore::builder().clock(clock.clone()).build())
        .cost(EstimateHeader::new(MAX_TOKENS, 400).default(100))
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let estimate = |max_tokens: &str| client("k1").header(&MAX_TOKENS, max_tokens);
    // 300 estimated, 400 reserved, 200 used: 200 back.
    let under = layer.layer(service_fn(reporting("200")));
    let answer = send(&under, estimate("300")).await;
    assert_eq!(remaining(&answer), 600, "estimate_max is reserved up front");
    assert_eq!(used(&layer).await, 200);
    // What it reported: 300.
    let at = layer.layer(service_fn(reporting("300")));
    send(&at, estimate("300")).await;
    assert_eq!(used(&layer).await, 500);
    // 450 used, more than the 400 reserved: 50 more.
    let over = layer.layer(service_fn(reporting("450")));
    let answer = send(&over, estimate("9999")).await;
    assert_eq!(remaining(&answer), 1_000 - 500 - 400);
    assert_eq!(used(&layer).await, 950);
    clock.advance(Duration::from_secs(3_600));
    // A response that reports nothing: the reservation stands, whatever the estimate.
    let silent = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    send(&silent, estimate("1")).await;
    assert_eq!(used(&layer).await, 400);
    // A refund never gives back more than was charged: 0 used of 400 reserved gives back 400.
    let nothing = layer.layer(service_fn(reporting("0")));
    send(&nothing, estimate("lots")).await;
    assert_eq!(used(&layer).await, 400);
}

/// A streamed completion: two data frames, then (when `used` is given) the tokens it used in
/// its trailers, as a streaming LLM API reports them. No known length: its end is a stream's.
struct Streamed {
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
}

impl Streamed {
    fn new(used: Option<&'static str>) -> Streamed {
        let mut frames: std::collections::VecDeque<_> = [
            http_body::Frame::data(Bytes::from_static(b"data: one\n\n")),
            http_body::Frame::data(Bytes::from_static(b"data: two\n\n")),
        ]
        .into();
        if let Some(used) = used {
            let mut trailers = http::HeaderMap::new();
            trailers.insert(TOKENS_USED, http::HeaderValue::from_static(used));
            frames.push_back(http_body::Frame::trailers(trailers));
        }
        Streamed { frames }
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.frames.pop_front().map(Ok))
    }
}

/// SPEC §9: a stream reports its cost in its trailers; the layer settles from them once the
/// stream ends, and takes the header out of them. A client that leaves mid-stream, or a
/// stream that ends without the cost, leaves the estimate charged.
#[tokio::test]
async fn a_streamed_response_is_settled_from_its_trailers() {
    use http_body_util::BodyExt as _;
    let clock = FakeClock::new(START);
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("tokens", 1_000, Duration::from_secs(3_600)).unwrap())
        .store(MemoryStore::builder().clock(clock.clone()).build())
        .cost_with(|_: &floodgate::RequestInfo<'_>| 300)
        .charge_from_response(CostHeader::new(TOKENS_USED))
        .build()
        .unwrap();
    let streaming = |used: Option<&'static str>| {
        layer.layer(service_fn(move |_: Request<()>| async move {
            Ok::<_, Infallible>(Response::new(Streamed::new(used)))
        }))
    };

    let response = streaming(Some("120"))
        .oneshot(client("k1").body(()).unwrap())
        .await
        .unwrap();
    assert_eq!(
        used(&layer).await,
        300,
        "the estimate until the stream ends"
    );
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    assert!(
        !trailers.contains_key(&TOKENS_USED),
        "the client's trailers"
    );
    assert_eq!(used(&layer).await, 120, "settled from the trailers");

    // The client leaves after the first frame: the estimate stands.
    let response = streaming(Some("10"))
        .oneshot(client("k1").body(()).unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert_eq!(used(&layer).await, 420);
    // A stream that ends without reporting: the estimate stands too.
    let response = streaming(None)
        .oneshot(client("k1").body(()).unwrap())
        .await
        .unwrap();
    response.into_body().collect().await.unwrap();
    assert_eq!(used(&layer).await, 720);
}
