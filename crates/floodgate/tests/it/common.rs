//! Helpers the layer's tests share: a handler echoing the decision, a memory store on a fake
//! clock, a per-second limit, requests from a peer, and reading what a response carries.
// Each test file uses some of these, not all.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use floodgate::store::{BoxFuture, Check, Lease};
use floodgate::{
    Decision, Limit, MemoryStore, PeerAddr, Store, StoreError, time::FakeClock, time::Timestamp,
};
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};

pub(crate) const START: Timestamp = Timestamp::from_secs(1_700_006_400);

pub(crate) async fn ok_handler(request: Request<()>) -> Result<Response<Full<Bytes>>, Infallible> {
    // Echo the binding limit's remaining count from the decision extension.
    let remaining = request
        .extensions()
        .get::<Decision>()
        .and_then(|decision| decision.binding_limit())
        .map_or("none".to_owned(), |limit| limit.remaining.to_string());
    Ok(Response::new(Full::new(Bytes::from(remaining))))
}

pub(crate) fn memory(clock: &FakeClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

pub(crate) fn per_second(limit: u64) -> Limit {
    Limit::token_bucket("per-second", limit, Duration::from_secs(1)).unwrap()
}

pub(crate) fn from_peer(peer: &str) -> http::request::Builder {
    let addr: SocketAddr = peer.parse().unwrap();
    Request::builder()
        .uri("/v1/things")
        .extension(PeerAddr(addr))
}

pub(crate) async fn send<S, B>(service: &S, request: http::request::Builder) -> Response<Bytes>
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let response = service
        .clone()
        .oneshot(request.body(()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Response::from_parts(parts, bytes)
}

pub(crate) fn header<'r>(response: &'r Response<Bytes>, name: &str) -> &'r str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("missing {name}"))
        .to_str()
        .unwrap()
}

pub(crate) fn json(response: &Response<Bytes>) -> serde_json::Value {
    serde_json::from_slice(response.body()).unwrap()
}

/// `X-RateLimit-Remaining` as a number.
pub(crate) fn remaining(response: &Response<Bytes>) -> u64 {
    header(response, "x-ratelimit-remaining").parse().unwrap()
}

/// A store whose backend is down: every call fails the way a dead Redis does.
pub(crate) struct DownStore;

impl Store for DownStore {
    fn check_and_consume<'a>(
        &'a self,
        _checks: &'a [Check],
        _now: Option<Timestamp>,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }

    fn release<'a>(&'a self, _leases: Vec<Lease>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }

    fn backend(&self) -> &'static str {
        "down"
    }
}
