//! An operator's look at a client is not a decision: `RateLimitLayer::peek` and `reset` of an
//! allowlisted or denylisted client count nothing in the process's decision totals (which the
//! status page shows). Its own test binary: the totals are process-wide.

use std::time::Duration;

use floodgate::lists::ClientList;
use floodgate::telemetry::decision_totals;
use floodgate::{Limit, PeerAddr, RateLimitLayer};

fn client(key: &str) -> http::Request<()> {
    http::Request::get("/")
        .header("x-api-key", key)
        .extension(PeerAddr("203.0.113.5:1000".parse().unwrap()))
        .body(())
        .unwrap()
}

#[tokio::test]
async fn peeking_and_resetting_listed_clients_counts_no_decision() {
    let layer = RateLimitLayer::builder()
        .limit(Limit::fixed_window("hourly", 10, Duration::from_secs(3600)).unwrap())
        .allowlist(ClientList::new().api_key("vip"))
        .denylist(ClientList::new().api_key("abuser"))
        .build()
        .unwrap();
    let before = decision_totals();
    for key in ["vip", "abuser"] {
        assert!(
            layer.peek(&client(key)).await.unwrap().is_none(),
            "{key}: no limit applies"
        );
        assert_eq!(layer.reset(&client(key), None).await.unwrap(), 0);
    }
    assert!(layer.peek(&client("someone")).await.unwrap().is_some());
    assert_eq!(decision_totals(), before, "a lookup is not a decision");
}
