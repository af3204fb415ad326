//! The fault proxy drives a real redis-server: each fault has the effect it promises on a plain
//! Redis client with a deadline, on new and existing connections, and switching back to
//! `Fault::None` recovers. Then a proxied cluster with replicas fails a killed master over.
//!
//! Timing: client deadlines are 300 ms against delays of 800 ms (a margin of half a second
//! either way); what Redis applied is polled for (every 50 ms, up to 2 s) rather than waited
//! for; the failover is given 20 s (the node timeout is 1 s, an election one or two more).

use std::time::{Duration, Instant};

use deadpool_redis::redis::{self, Connection, RedisResult};
use floodgate_test_support::faults::{Fault, FaultProxy};
use floodgate_test_support::{ClusterNode, RedisCluster, RedisServer, wait_until};

const CLIENT_DEADLINE: Duration = Duration::from_millis(300);
const DELAY: Duration = Duration::from_millis(800);

/// A plain client connection to `url` whose every read gives up after `deadline`.
fn connect(url: &str, deadline: Duration) -> RedisResult<Connection> {
    let connection = redis::Client::open(url)?.get_connection_with_timeout(deadline)?;
    connection.set_read_timeout(Some(deadline))?;
    connection.set_write_timeout(Some(deadline))?;
    Ok(connection)
}

fn incr(connection: &mut Connection, key: &str) -> RedisResult<i64> {
    redis::cmd("INCR").arg(key).query(connection)
}

fn ping(connection: &mut Connection) -> RedisResult<String> {
    redis::cmd("PING").query(connection)
}

/// What a new raw connection to `proxy` reads back after sending `INCR key` (no client
/// handshake: a client library's would go through the fault first): the reply, or the error.
fn incr_on_new_connection(proxy: &FaultProxy, key: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(proxy.addr())?;
    stream.set_read_timeout(Some(CLIENT_DEADLINE))?;
    write!(stream, "*2\r\n$4\r\nINCR\r\n${}\r\n{key}\r\n", key.len())?;
    let mut reply = [0u8; 64];
    match stream.read(&mut reply)? {
        0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
        read => Ok(String::from_utf8_lossy(&reply[..read]).into_owned()),
    }
}

/// Whether `error` is what a read past its deadline gives.
fn timed_out(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The value of `key` read on the server itself, not through the proxy.
fn stored(server: &RedisServer, key: &str) -> Option<i64> {
    server.command(&["GET", key])
}

#[test]
fn no_fault_forwards_both_ways_and_counts() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    assert_eq!(proxy.url(), format!("redis://127.0.0.1:{}", proxy.port()));
    assert_eq!(proxy.addr().port(), proxy.port());
    let mut client = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(incr(&mut client, "k").unwrap(), 1);
    assert_eq!(incr(&mut client, "k").unwrap(), 2);
    assert_eq!(stored(&server, "k"), Some(2));
    assert_eq!(proxy.connections_accepted(), 1);
    assert!(proxy.bytes_forwarded() > 0 && proxy.bytes_delivered() > 0);
    assert_eq!(proxy.bytes_swallowed(), 0);
}

#[test]
fn delayed_replies_time_out_at_the_client_although_redis_applied_the_command() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    // An existing connection, switched from another thread.
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    let switch =
        std::thread::scope(|scope| scope.spawn(|| proxy.set(Fault::DelayReplies(DELAY))).join());
    switch.unwrap();
    assert_eq!(proxy.fault(), Fault::DelayReplies(DELAY));

    let error = incr(&mut existing, "k").expect_err("the reply comes after the deadline");
    assert!(error.is_timeout(), "{error}");
    wait_until(Duration::from_secs(2), "the INCR applied", || {
        stored(&server, "k") == Some(1)
    });

    // A new connection under the fault; a client patient enough gets its reply, late.
    let mut patient = connect(&proxy.url(), DELAY * 4).unwrap();
    let started = Instant::now();
    assert_eq!(incr(&mut patient, "k").unwrap(), 2);
    assert!(started.elapsed() >= DELAY, "{:?}", started.elapsed());

    proxy.set(Fault::None);
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(incr(&mut fresh, "k").unwrap(), 3, "recovered");
}

/// One-way latency: a command reaches Redis only after the delay (not applied while the
/// client's deadline runs out before it), and a patient client's round trip takes twice it.
#[test]
fn latency_delays_commands_and_replies_alike() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    proxy.set(Fault::Latency(DELAY));
    let sent = Instant::now();
    let error = incr(&mut existing, "k").expect_err("the reply comes after the deadline");
    assert!(error.is_timeout(), "{error}");
    // Its deadline is over (300 ms) and the command is still on its way (800 ms).
    assert!(sent.elapsed() < DELAY);
    assert_eq!(stored(&server, "k"), None, "not applied before the delay");
    wait_until(Duration::from_secs(3), "the INCR applied", || {
        stored(&server, "k") == Some(1)
    });
    assert!(sent.elapsed() >= DELAY, "{:?}", sent.elapsed());

    let mut patient = connect(&proxy.url(), DELAY * 5).unwrap();
    let started = Instant::now();
    assert_eq!(incr(&mut patient, "k").unwrap(), 2);
    assert!(started.elapsed() >= DELAY * 2, "{:?}", started.elapsed());

    proxy.set(Fault::None);
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(incr(&mut fresh, "k").unwrap(), 3, "recovered");
}

#[test]
fn drop_after_forward_applies_the_command_and_closes_before_the_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    proxy.set(Fault::DropAfterForward);

    let error = incr(&mut existing, "k").expect_err("closed before the reply");
    assert!(!error.is_timeout(), "closed at once, not silent: {error}");
    // The proxy closes only once Redis has answered: applied before the client's error.
    assert_eq!(stored(&server, "k"), Some(1));

    let error = incr_on_new_connection(&proxy, "k").expect_err("closed before the reply");
    assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof, "{error}");
    assert_eq!(stored(&server, "k"), Some(2));
    assert!(
        proxy.bytes_swallowed() > 0,
        "the replies were read and dropped"
    );

    proxy.set(Fault::None);
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(incr(&mut fresh, "k").unwrap(), 3, "recovered");
}

#[test]
fn a_black_hole_answers_nothing_and_applies_nothing() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    let forwarded = proxy.bytes_forwarded();
    proxy.set(Fault::BlackHole);

    let error = incr(&mut existing, "k").expect_err("no answer");
    assert!(error.is_timeout(), "{error}");
    // A new connection is accepted, and is just as silent.
    let error = incr_on_new_connection(&proxy, "k").expect_err("no answer");
    assert!(timed_out(&error), "{error}");
    assert_eq!(proxy.bytes_forwarded(), forwarded, "nothing reached Redis");
    assert_eq!(stored(&server, "k"), None);
    assert!(proxy.bytes_swallowed() > 0);

    proxy.set(Fault::None);
    // A connection that lost commands is closed: its replies could no longer be matched.
    assert!(
        ping(&mut existing).is_err(),
        "the desynchronised connection is closed"
    );
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(
        incr(&mut fresh, "k").unwrap(),
        1,
        "recovered, nothing applied late"
    );
}

#[test]
fn strand_silences_the_open_connections_for_good_and_serves_new_ones() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    proxy.set(Fault::Strand);

    let error = incr(&mut existing, "k").expect_err("no answer");
    assert!(error.is_timeout(), "{error}");
    assert_eq!(stored(&server, "k"), None, "nothing reached Redis");
    // A connection opened while the fault is set is served.
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(incr(&mut fresh, "k").unwrap(), 1);

    // The stranded connection stays silent and open whatever the fault becomes: nothing
    // closes it (a client must notice the silence itself).
    proxy.set(Fault::None);
    let error = ping(&mut existing).expect_err("still silent");
    assert!(error.is_timeout(), "silent, not closed: {error}");
    assert_eq!(incr(&mut fresh, "k").unwrap(), 2);
    assert_eq!(
        stored(&server, "k"),
        Some(2),
        "nothing the stranded one sent applied"
    );
}

#[test]
fn refuse_closes_existing_and_new_connections_until_switched_back() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut existing = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    ping(&mut existing).unwrap();
    proxy.set(Fault::Refuse);

    let started = Instant::now();
    let error = ping(&mut existing).expect_err("closed");
    assert!(!error.is_timeout(), "closed at once, not silent: {error}");
    let error = incr_on_new_connection(&proxy, "k").expect_err("a new connection is closed");
    assert!(!timed_out(&error), "closed at once, not silent: {error}");
    assert_eq!(stored(&server, "k"), None);
    assert!(
        started.elapsed() < CLIENT_DEADLINE,
        "{:?}",
        started.elapsed()
    );

    proxy.set(Fault::None);
    let mut fresh = connect(&proxy.url(), CLIENT_DEADLINE).unwrap();
    assert_eq!(ping(&mut fresh).unwrap(), "PONG", "back on the same port");
}

/// A proxied cluster with a replica per master: clients go through the proxies (the nodes
/// advertise them), and when a key's master is killed its replica is promoted and serves the
/// key's slot, through its own proxy.
#[test]
fn a_proxied_cluster_promotes_the_replica_of_a_killed_master() {
    let mut cluster = RedisCluster::start_proxied(3, 1);
    assert_eq!(cluster.nodes().len(), 6);
    let key = "fgtest:{failover}:k";
    let cluster_client = |cluster: &RedisCluster| {
        redis::cluster::ClusterClientBuilder::new(cluster.urls())
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(2))
            .build()
            .unwrap()
            .get_connection()
            .unwrap()
    };
    let mut client = cluster_client(&cluster);
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("v")
        .query(&mut client)
        .unwrap();
    let ClusterNode::Master(owner) = cluster.node_of(key) else {
        panic!("a master serves every slot at first");
    };
    let master = ClusterNode::Master(owner);
    assert!(
        cluster.proxy(master).bytes_forwarded() > 0,
        "the SET went through the proxy"
    );
    // Replication is asynchronous: the key survives the failover only once a replica has it.
    let replicas: i64 = cluster.server(master).command(&["WAIT", "1", "5000"]);
    assert_eq!(replicas, 1);

    cluster.kill_master(owner);
    let promoted = cluster.wait_for_promotion(owner, Duration::from_secs(20));
    assert_eq!(
        promoted,
        ClusterNode::Replica {
            master: owner,
            replica: 0
        }
    );
    assert_eq!(cluster.node_of(key), promoted);

    let through_promoted = cluster.proxy(promoted).bytes_forwarded();
    let mut client = cluster_client(&cluster);
    let value: String = redis::cmd("GET").arg(key).query(&mut client).unwrap();
    assert_eq!(value, "v");
    assert!(
        cluster.proxy(promoted).bytes_forwarded() > through_promoted,
        "the promoted replica is reached through its proxy"
    );
}
