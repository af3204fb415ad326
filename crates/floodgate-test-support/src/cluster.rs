//! Real Redis Clusters on free ports: masters, optionally replicas, optionally every node
//! behind a [`FaultProxy`] that its clients go through.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::time::Duration;

use deadpool_redis::redis::Value;

use crate::faults::FaultProxy;
use crate::{RedisServer, free_port, wait_until};

/// Slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// How long a cluster may take to form (every node meeting every other, replicas syncing) on a
/// loaded test machine.
const FORMING: Duration = Duration::from_secs(30);

/// One node of a [`RedisCluster`], named by the place it was created in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterNode {
    /// The master created `n`th (a failover may since have demoted it).
    Master(usize),
    /// Replica `replica` of the master created `master`th (a failover may since have promoted
    /// it).
    Replica {
        /// The index of the master it was created to replicate.
        master: usize,
        /// Its index among that master's replicas.
        replica: usize,
    },
}

/// A real Redis Cluster: servers with `--cluster-enabled yes`, slots split evenly over the
/// masters, each master with the same number of replicas (0 by default).
/// `cluster-require-full-coverage no` lets the surviving masters serve their slots when one
/// dies; `cluster-node-timeout` is 1000 ms, so a dead master's replica is promoted within a few
/// seconds (that takes a majority of masters: at least three).
///
/// Nodes advertise themselves as `127.0.0.1` and (in a [proxied](Self::start_proxied) cluster)
/// at their proxy's port, in `CLUSTER SLOTS`, `MOVED` and to their replicas, so that clients
/// and replication streams always go through the proxies. The cluster bus goes directly between
/// nodes: a proxy cuts a node off from its clients (and its replicas' replication stream), not
/// from the cluster, which keeps seeing it. To make the cluster fail a master over, kill it
/// ([`kill_master`](Self::kill_master)) or freeze it ([`RedisServer::freeze`]).
pub struct RedisCluster {
    /// The masters, in the order they were created.
    pub masters: Vec<RedisServer>,
    /// Each master's replicas, by the master's index.
    pub replicas: Vec<Vec<RedisServer>>,
    /// The proxies in front of the masters (empty unless proxied).
    master_proxies: Vec<FaultProxy>,
    /// The proxies in front of the replicas, by master (empty unless proxied).
    replica_proxies: Vec<Vec<FaultProxy>>,
    config_dir: PathBuf,
}

/// A node just started: its server, its proxy, and its cluster bus port.
struct Started {
    server: RedisServer,
    proxy: Option<FaultProxy>,
    bus_port: u16,
}

impl RedisCluster {
    /// Starts a cluster of `masters` masters (no replicas) on free ports and waits until it is up.
    pub fn start(masters: usize) -> RedisCluster {
        RedisCluster::build(masters, 0, false)
    }

    /// Starts a cluster of `masters` masters with `replicas_per_master` replicas each, and waits
    /// until it is up and every replica is in sync.
    pub fn start_with_replicas(masters: usize, replicas_per_master: usize) -> RedisCluster {
        RedisCluster::build(masters, replicas_per_master, false)
    }

    /// As [`start_with_replicas`](Self::start_with_replicas), with every node behind a
    /// [`FaultProxy`] that it advertises as its address: clients (and replicas) reach it only
    /// through the proxy, which a test can switch to any [`Fault`](crate::faults::Fault).
    pub fn start_proxied(masters: usize, replicas_per_master: usize) -> RedisCluster {
        RedisCluster::build(masters, replicas_per_master, true)
    }

    fn build(masters: usize, replicas_per_master: usize, proxied: bool) -> RedisCluster {
        assert!(
            (1..=usize::from(SLOTS)).contains(&masters),
            "a cluster has 1 to {SLOTS} masters"
        );
        let config_dir = crate::unique_temp_path("cluster");
        std::fs::create_dir_all(&config_dir).expect("cluster config dir");
        let start = || start_node(&config_dir, proxied);
        let masters: Vec<Started> = (0..masters).map(|_| start()).collect();
        let replicas: Vec<Vec<Started>> = (0..masters.len())
            .map(|_| (0..replicas_per_master).map(|_| start()).collect())
            .collect();

        let assigned = assign_slots(&masters);
        let everyone: Vec<&Started> = masters.iter().chain(replicas.iter().flatten()).collect();
        meet_everyone(&everyone);
        for (master, its_replicas) in masters.iter().zip(&replicas) {
            let id: String = master.server.command(&["CLUSTER", "MYID"]);
            for replica in its_replicas {
                let _: () = replica.server.command(&["CLUSTER", "REPLICATE", &id]);
            }
        }
        wait_until_formed(&everyone, masters.len() * replicas_per_master, &assigned);
        for replica in replicas.iter().flatten() {
            wait_until(FORMING, "a replica in sync", || {
                replica
                    .server
                    .try_command::<String>(&["INFO", "replication"])
                    .is_ok_and(|info| info.contains("master_link_status:up"))
            });
        }

        let (masters, master_proxies) = split(masters);
        let (replicas, replica_proxies) = replicas.into_iter().map(split).unzip();
        RedisCluster {
            masters,
            replicas,
            master_proxies,
            replica_proxies,
            config_dir,
        }
    }

    /// The server of `node`.
    pub fn server(&self, node: ClusterNode) -> &RedisServer {
        match node {
            ClusterNode::Master(index) => &self.masters[index],
            ClusterNode::Replica { master, replica } => &self.replicas[master][replica],
        }
    }

    /// The proxy in front of `node`. Panics unless the cluster was started
    /// [proxied](Self::start_proxied).
    pub fn proxy(&self, node: ClusterNode) -> &FaultProxy {
        let proxy = match node {
            ClusterNode::Master(index) => self.master_proxies.get(index),
            ClusterNode::Replica { master, replica } => self
                .replica_proxies
                .get(master)
                .and_then(|proxies| proxies.get(replica)),
        };
        proxy.expect("a proxied cluster (RedisCluster::start_proxied)")
    }

    /// The port `node` advertises, where its clients reach it (its proxy's, if proxied).
    pub fn client_port(&self, node: ClusterNode) -> u16 {
        if self.master_proxies.is_empty() {
            self.server(node).port()
        } else {
            self.proxy(node).port()
        }
    }

    /// `redis://127.0.0.1:<port>` of `node` as its clients reach it.
    pub fn url(&self, node: ClusterNode) -> String {
        format!("redis://127.0.0.1:{}", self.client_port(node))
    }

    /// Seed URLs of every master as created, as clients reach them (through the proxies, if
    /// proxied).
    pub fn urls(&self) -> Vec<String> {
        (0..self.masters.len())
            .map(|index| self.url(ClusterNode::Master(index)))
            .collect()
    }

    /// Every node, masters first, then each master's replicas.
    pub fn nodes(&self) -> Vec<ClusterNode> {
        let masters = (0..self.masters.len()).map(ClusterNode::Master);
        let replicas = self.replicas.iter().enumerate().flat_map(|(master, its)| {
            (0..its.len()).map(move |replica| ClusterNode::Replica { master, replica })
        });
        masters.chain(replicas).collect()
    }

    /// Kills master `index` (SIGKILL): its replica, if it has one, is promoted once the other
    /// masters agree that it failed (see [`wait_for_promotion`](Self::wait_for_promotion)).
    pub fn kill_master(&mut self, index: usize) {
        self.masters[index].kill();
    }

    /// Waits until a replica of the master created `index`th has been promoted and every other
    /// node that runs sees the cluster whole again (`cluster_state:ok`, all 16384 slots served
    /// by nodes it does not consider failing); returns the promoted replica. Polls every 50 ms
    /// up to `within` (the node timeout is one second; an election then takes one or two more).
    pub fn wait_for_promotion(&self, index: usize, within: Duration) -> ClusterNode {
        let promoted = Cell::new(None);
        wait_until(within, "a replica promoted", || {
            let found = (0..self.replicas[index].len()).find(|&replica| {
                let server = &self.replicas[index][replica];
                server.is_running()
                    && !server.is_frozen()
                    && server
                        .try_command::<String>(&["INFO", "replication"])
                        .is_ok_and(|info| info.contains("role:master"))
            });
            promoted.set(found);
            found.is_some()
        });
        let whole = format!("cluster_slots_ok:{SLOTS}");
        for node in self.nodes() {
            let server = self.server(node);
            if node == ClusterNode::Master(index) || !server.is_running() || server.is_frozen() {
                continue;
            }
            wait_until(within, "the cluster whole again", || {
                server
                    .try_command::<String>(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok") && info.contains(&whole))
            });
        }
        let replica = promoted.get().expect("found above");
        ClusterNode::Replica {
            master: index,
            replica,
        }
    }

    /// Gives `key`'s slot to master `to`, as a resharding's last step does, and waits until
    /// every master sees `to` serve it. Its keys stay where they are (move none first to keep
    /// them reachable).
    ///
    /// Why not just `CLUSTER SETSLOT … NODE` on each master: a node's claim on a slot spreads
    /// by gossip, and a claim with a greater config epoch wins. Told first, `to` could take
    /// back the old owner's claim from a ping sent before the old owner was told, and then
    /// each of the two would send the slot's calls to the other (`MOVED` both ways, for good).
    /// So: the old owner first (it stops claiming), then `to`, then `to` takes the greatest
    /// epoch (a stale claim then loses), and all of it again if a node still disagrees.
    pub fn give_slot(&self, key: &str, to: usize) {
        let slot = floodgate::store::redis::hash_slot(key).to_string();
        let to_id: String = self.masters[to].command(&["CLUSTER", "MYID"]);
        let settled = || {
            self.masters
                .iter()
                .all(|master| self.served_in_view_of(master, key) == Some(ClusterNode::Master(to)))
        };
        wait_until(
            FORMING,
            "every master agreeing on a slot's new owner",
            || {
                let others = self
                    .masters
                    .iter()
                    .enumerate()
                    .filter(|(index, _)| *index != to);
                for (_, master) in others {
                    let _: () = master.command(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
                }
                let _: () =
                    self.masters[to].command(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
                let _: String = self.masters[to].command(&["CLUSTER", "BUMPEPOCH"]);
                let deadline = std::time::Instant::now() + Duration::from_secs(1);
                while !settled() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                settled()
            },
        );
    }

    /// The node serving `key`'s slot as `server` sees it.
    fn served_in_view_of(&self, server: &RedisServer, key: &str) -> Option<ClusterNode> {
        let slot = floodgate::store::redis::hash_slot(key);
        let ranges = server.try_command(&["CLUSTER", "SLOTS"]).ok()?;
        self.ranges_of(ranges)
            .into_iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|(_, _, node)| node)
    }

    /// `CLUSTER SLOTS` (asked of the first node that runs and answers) as (first slot, last
    /// slot, the serving node).
    fn slot_ranges(&self) -> Vec<(u16, u16, ClusterNode)> {
        let ranges: Vec<Vec<Value>> = self
            .nodes()
            .into_iter()
            .map(|node| self.server(node))
            .filter(|server| server.is_running() && !server.is_frozen())
            .find_map(|server| server.try_command(&["CLUSTER", "SLOTS"]).ok())
            .expect("a node of the cluster answers");
        self.ranges_of(ranges)
    }

    /// A `CLUSTER SLOTS` answer as (first slot, last slot, the serving node).
    fn ranges_of(&self, ranges: Vec<Vec<Value>>) -> Vec<(u16, u16, ClusterNode)> {
        let number = |value: Option<&Value>| match value {
            Some(Value::Int(int)) => *int,
            _ => -1,
        };
        ranges
            .iter()
            .filter_map(|range| {
                let Some(Value::Array(serving)) = range.get(2) else {
                    return None;
                };
                let port = number(serving.get(1));
                let node = self
                    .nodes()
                    .into_iter()
                    .find(|node| i64::from(self.client_port(*node)) == port)?;
                let (start, end) = (number(range.first()), number(range.get(1)));
                Some((u16::try_from(start).ok()?, u16::try_from(end).ok()?, node))
            })
            .collect()
    }

    /// The node serving `key`'s slot now.
    pub fn node_of(&self, key: &str) -> ClusterNode {
        let slot = floodgate::store::redis::hash_slot(key);
        self.slot_ranges()
            .into_iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|(_, _, node)| node)
            .unwrap_or_else(|| panic!("slot {slot} is not served"))
    }

    /// The master (as created) serving `key`'s slot. Panics if a promoted replica serves it:
    /// ask [`node_of`](Self::node_of) after a failover.
    pub fn master_of(&self, key: &str) -> usize {
        match self.node_of(key) {
            ClusterNode::Master(index) => index,
            replica => panic!("{key} is served by {replica:?}"),
        }
    }

    /// The slot ranges (first, last) that master `index` serves now.
    pub fn slots_of(&self, index: usize) -> Vec<(u16, u16)> {
        self.slot_ranges()
            .into_iter()
            .filter(|(_, _, node)| *node == ClusterNode::Master(index))
            .map(|(start, end, _)| (start, end))
            .collect()
    }

    /// How many slots master `index` serves.
    pub fn slots_served_by(&self, index: usize) -> u32 {
        self.slot_ranges()
            .into_iter()
            .filter(|(_, _, node)| *node == ClusterNode::Master(index))
            .map(|(start, end, _)| u32::from(end - start) + 1)
            .sum()
    }
}

/// Starts one cluster node (behind a proxy it advertises, if `proxied`).
fn start_node(config_dir: &std::path::Path, proxied: bool) -> Started {
    // Made for each try of a port: the arguments name them.
    let proxy = RefCell::new(None);
    let bus_port = Cell::new(0);
    let server = RedisServer::start_with(|port| {
        let file = config_dir.join(format!("nodes-{port}.conf"));
        let _ = std::fs::remove_file(&file);
        // The bus port is chosen, not `port + 10000`, which may be past 65535.
        bus_port.set(free_port());
        let mut args: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &file.display().to_string(),
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
            // A replica may be promoted however long its master has been silent: tests
            // freeze masters for as long as they like.
            "--cluster-replica-validity-factor",
            "0",
            "--cluster-port",
            &bus_port.get().to_string(),
            "--cluster-announce-ip",
            "127.0.0.1",
        ]
        .map(String::from)
        .to_vec();
        if proxied {
            let node_proxy = FaultProxy::start(port);
            args.extend([
                "--cluster-announce-port".to_owned(),
                node_proxy.port().to_string(),
            ]);
            *proxy.borrow_mut() = Some(node_proxy);
        }
        args
    });
    Started {
        server,
        proxy: proxy.into_inner(),
        bus_port: bus_port.get(),
    }
}

/// Gives each master an equal share of the slots and a config epoch of its own (a node takes
/// an epoch only while it knows no other, so before any `MEET`), as `redis-cli --cluster
/// create` does. Returns each master's `(first slot, last slot, client port)`.
fn assign_slots(masters: &[Started]) -> Vec<(i64, i64, i64)> {
    let count = masters.len();
    let assigned: Vec<(i64, i64, i64)> = masters
        .iter()
        .enumerate()
        .map(|(index, master)| {
            let first = usize::from(SLOTS) * index / count;
            let last = usize::from(SLOTS) * (index + 1) / count - 1;
            let as_int = |value: usize| i64::try_from(value).expect("a slot");
            (as_int(first), as_int(last), i64::from(client_port(master)))
        })
        .collect();
    for (index, (master, (first, last, _))) in masters.iter().zip(&assigned).enumerate() {
        let _: () = master.server.command(&[
            "CLUSTER",
            "ADDSLOTSRANGE",
            &first.to_string(),
            &last.to_string(),
        ]);
        let _: () =
            master
                .server
                .command(&["CLUSTER", "SET-CONFIG-EPOCH", &(index + 1).to_string()]);
    }
    assigned
}

/// Introduces every node to the first, and waits until every node knows every other.
fn meet_everyone(everyone: &[&Started]) {
    let introducer = &everyone[0].server;
    for node in &everyone[1..] {
        let _: () = introducer.command(&[
            "CLUSTER",
            "MEET",
            "127.0.0.1",
            &client_port(node).to_string(),
            &node.bus_port.to_string(),
        ]);
    }
    let known = format!("cluster_known_nodes:{}", everyone.len());
    for node in everyone {
        wait_until(FORMING, "every node to know every other", || {
            node.server
                .try_command::<String>(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains(&known))
        });
    }
}

/// Waits until every node says `cluster_state:ok` and knows `replica_count` replicas, then
/// until every node names the masters as `assigned`: `cluster_state:ok` says every slot is
/// served, not by whom, and a node may still name a stale owner (a client that takes its map
/// from it is sent MOVED twice: once by the node it names, once on retry).
fn wait_until_formed(everyone: &[&Started], replica_count: usize, assigned: &[(i64, i64, i64)]) {
    for node in everyone {
        wait_until(FORMING, "cluster_state:ok, every replica known", || {
            let ok = node
                .server
                .try_command::<String>(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains("cluster_state:ok"));
            ok && node
                .server
                .try_command::<String>(&["CLUSTER", "NODES"])
                .is_ok_and(|nodes| {
                    let is_replica = |line: &&str| {
                        line.split(' ')
                            .nth(2)
                            .is_some_and(|flags| flags.split(',').any(|flag| flag == "slave"))
                    };
                    nodes.lines().filter(is_replica).count() == replica_count
                })
        });
    }
    for node in everyone {
        wait_until(FORMING, "every node to name each slot's master", || {
            node.server
                .try_command::<Vec<Vec<Value>>>(&["CLUSTER", "SLOTS"])
                .is_ok_and(|ranges| served_as_assigned(&ranges, assigned))
        });
    }
}

/// The port a started node advertises.
/// Whether `CLUSTER SLOTS` (`ranges`) names, for every range, the master `assigned` it, as
/// (first slot, last slot, client port).
fn served_as_assigned(ranges: &[Vec<Value>], assigned: &[(i64, i64, i64)]) -> bool {
    let number = |value: Option<&Value>| match value {
        Some(Value::Int(int)) => Some(*int),
        _ => None,
    };
    let mut served: Vec<(i64, i64, i64)> = ranges
        .iter()
        .filter_map(|range| {
            let Some(Value::Array(master)) = range.get(2) else {
                return None;
            };
            Some((
                number(range.first())?,
                number(range.get(1))?,
                number(master.get(1))?,
            ))
        })
        .collect();
    served.sort_unstable();
    served == assigned
}

fn client_port(node: &Started) -> u16 {
    node.proxy
        .as_ref()
        .map_or(node.server.port(), FaultProxy::port)
}

/// Servers and their proxies (none unless proxied).
fn split(nodes: Vec<Started>) -> (Vec<RedisServer>, Vec<FaultProxy>) {
    let mut servers = Vec::with_capacity(nodes.len());
    let mut proxies = Vec::new();
    for node in nodes {
        servers.push(node.server);
        proxies.extend(node.proxy);
    }
    (servers, proxies)
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for server in self
            .masters
            .iter_mut()
            .chain(self.replicas.iter_mut().flatten())
        {
            server.kill();
        }
        let _ = std::fs::remove_dir_all(&self.config_dir);
    }
}
