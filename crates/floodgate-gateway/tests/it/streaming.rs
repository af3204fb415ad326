//! Streaming through the gateway: 200 MiB each way with bounded memory. Alone in its test
//! binary, so that its load does not disturb the timing bounds of the other black-box tests.

use crate::support;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::{Gateway, TempDir, Upstream, client, free_port};

fn gateway(upstream: &Upstream) -> (Gateway, TempDir) {
    let directory = TempDir::new("stream");
    let listen = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let path = directory.file("floodgate.yaml");
    let text = format!(
        "listen: \"{listen}\"\nadmin:\n  listen: \"{admin}\"\nupstream: \"{}\"\n",
        upstream.url()
    );
    std::fs::write(&path, text).unwrap();
    (Gateway::start(&path, listen, admin), directory)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_megabytes_stream_both_ways_in_bounded_memory() {
    const SIZE: u64 = 200 * 1024 * 1024;
    let upstream = Upstream::start().await;
    let (gateway, _directory) = gateway(&upstream);
    let client = client();
    let download = client
        .request(
            http::Request::get(gateway.url(&format!("/download?bytes={SIZE}")))
                .body(Default::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let mut body = download.into_body();
    let mut received = 0u64;
    while let Some(frame) = body.frame().await {
        received += frame
            .unwrap()
            .into_data()
            .map_or(0, |data| data.len() as u64);
    }
    assert_eq!(received, SIZE);

    let uploader: hyper_util::client::legacy::Client<_, support::ChunkBody> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let body = support::ChunkBody {
        chunk: Bytes::from(vec![b'u'; 64 * 1024]),
        remaining: SIZE,
    };
    let response = uploader
        .request(
            http::Request::post(gateway.url("/upload"))
                .body(body)
                .unwrap(),
        )
        .await
        .unwrap();
    let counted = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(counted, SIZE.to_string().as_bytes());
    let peak = gateway.peak_rss_kib();
    assert!(
        peak < 64 * 1024,
        "gateway peak RSS {peak} KiB for 2 × 200 MiB: bodies must stream"
    );
}
