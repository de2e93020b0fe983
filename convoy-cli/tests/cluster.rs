//! Three-node clusters on the loopback, one failover test per broker, each under load (a
//! producer and two `convoy consume` processes, `scenarios/failover.rs`): 0 lost and 0 per-key
//! order violations of everything the producer had confirmed, and the time to recover from
//! each fault. The clusters are private (testkit `nodes`), started and stopped by these tests.
//!
//! - Kafka: 3 KRaft nodes, replication 3, `min.insync.replicas=2`; the node leading most of the
//!   topic's partitions is killed with SIGKILL mid-stream and restarted, then all three are
//!   restarted one after another (SIGTERM: a controlled shutdown), each once the others have
//!   every replica back in sync.
//! - RabbitMQ: 3 nodes in one cluster, the partition queues quorum queues replicated on all
//!   three; the node leading most of them is killed with SIGKILL and restarted.
//! - NATS: 3 servers in one cluster, the topic's stream and the group's buckets with 3
//!   replicas; the stream's leader is killed with SIGKILL and restarted.

#![allow(clippy::unwrap_used)]

mod scenarios;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convoy_testkit::nodes::kafka::KafkaCluster;
use convoy_testkit::nodes::nats::NatsCluster;
use convoy_testkit::nodes::rabbitmq::RabbitCluster;
use convoy_testkit::nodes::NodeError;
use rdkafka::consumer::{BaseConsumer, Consumer};
use scenarios::failover::{failover, Producer};
use scenarios::unique;

const PARTITIONS: u32 = 6;

/// One cluster at a time: three brokers' nodes each are plenty for a 2-core machine.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Starts a cluster off the runtime, or says why the test is skipped. Shared: the test holds
/// it until the scenario's end, while the faults act on it from their own thread.
async fn cluster<T: Send + 'static>(start: fn(usize) -> Result<T, NodeError>) -> Option<Arc<Mutex<T>>> {
    convoy_testkit::support::init_tracing();
    match tokio::task::spawn_blocking(move || start(3)).await.unwrap() {
        Ok(cluster) => Some(Arc::new(Mutex::new(cluster))),
        Err(missing @ NodeError::Missing(_)) => {
            convoy_testkit::support::skip(missing);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Each partition's leader and in-sync replicas.
fn kafka_partitions(bootstrap: &str, topic: &str) -> BTreeMap<i32, (i32, usize)> {
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let metadata = client
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions())
        .map(|p| (p.id(), (p.leader(), p.isr().len())))
        .collect()
}

/// Waits until every partition of `topic` has all three replicas in sync again.
fn kafka_in_sync(bootstrap: &str, topic: &str) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let partitions = kafka_partitions(bootstrap, topic);
        if partitions.len() == PARTITIONS as usize && partitions.values().all(|(_, isr)| *isr == 3) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replicas of {topic} not back in sync: {partitions:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_loses_its_busiest_leader_then_rolls_all_three_nodes() {
    let _one = ONE_CLUSTER.lock().await;
    let Some(nodes) = cluster(KafkaCluster::start).await else {
        return;
    };
    let bootstrap = nodes.lock().unwrap().bootstrap();
    let topic = unique("failover");
    let url = format!(
        "kafka://{bootstrap}?group={}&topics={topic}&partitions={PARTITIONS}",
        unique("failover-group")
    );
    let cluster = nodes.clone();
    let report = failover(&url, &topic.clone(), Producer::Convoy, move |progress| {
        let with_node = |id: u32, act: &mut dyn FnMut(&mut convoy_testkit::nodes::kafka::KafkaNode)| {
            act(cluster.lock().unwrap().node(id).unwrap());
        };
        kafka_in_sync(&bootstrap, &topic);
        let mut leads = BTreeMap::<i32, usize>::new();
        for (leader, _) in kafka_partitions(&bootstrap, &topic).values() {
            *leads.entry(*leader).or_default() += 1;
        }
        let (&busiest, &count) = leads.iter().max_by_key(|(_, n)| **n).unwrap();
        let busiest = busiest as u32;
        progress.fault(
            &format!("kill -9 of Kafka node {busiest}, leader of {count} of {PARTITIONS} partitions"),
            || with_node(busiest, &mut |n| n.kill().expect("the node was killed")),
        );
        progress.fault(&format!("restart of Kafka node {busiest}"), || {
            with_node(busiest, &mut |n| n.restart().unwrap())
        });
        kafka_in_sync(&bootstrap, &topic);
        for id in 1..=3 {
            progress.fault(
                &format!("rolling restart: controlled shutdown of Kafka node {id}"),
                || with_node(id, &mut |n| n.stop().unwrap()),
            );
            progress.fault(&format!("rolling restart: Kafka node {id} started again"), || {
                with_node(id, &mut |n| n.restart().unwrap())
            });
            kafka_in_sync(&bootstrap, &topic);
            progress.let_flow(400);
        }
    })
    .await;
    drop(nodes);
    assert_eq!(report.faults.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_loses_the_node_leading_the_partition_queues() {
    let _one = ONE_CLUSTER.lock().await;
    let Some(nodes) = cluster(RabbitCluster::start).await else {
        return;
    };
    let topic = unique("failover");
    let url = format!(
        "{}?group={}&topics={topic}&partitions={PARTITIONS}",
        nodes.lock().unwrap().uri(),
        unique("failover-group")
    );
    let cluster = nodes.clone();
    let report = failover(&url, &topic.clone(), Producer::Convoy, move |progress| {
        let cluster = cluster.lock().unwrap();
        let members = cluster.nodes[0]
            .ctl(&["list_queues", "name", "members", "--quiet", "--no-table-headers"])
            .unwrap();
        // The partition queues `T.G.p<i>` (not the exclusive lock queues beside them).
        let partition_queue = |name: &str| {
            name.starts_with(topic.as_str())
                && name
                    .rsplit_once(".p")
                    .is_some_and(|(_, i)| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        };
        let queues: Vec<&str> = members
            .lines()
            .filter(|l| l.split_whitespace().next().is_some_and(partition_queue))
            .collect();
        assert_eq!(queues.len(), PARTITIONS as usize, "{members}");
        for line in queues {
            assert_eq!(
                line.matches("@localhost").count(),
                3,
                "a partition queue replicated on all three nodes: {line}"
            );
        }
        let mut leads = BTreeMap::<String, usize>::new();
        for (_, leader) in cluster
            .queue_leaders()
            .unwrap()
            .into_iter()
            .filter(|(queue, _)| partition_queue(queue))
        {
            *leads.entry(leader).or_default() += 1;
        }
        let (busiest, count) = leads.iter().max_by_key(|(_, n)| **n).unwrap();
        let node = cluster.nodes.iter().find(|n| n.name() == busiest).unwrap();
        progress.fault(
            &format!("kill -9 of RabbitMQ node {busiest}, leader of {count} partition queues"),
            || node.kill().expect("the node was killed"),
        );
        progress.fault(&format!("restart of RabbitMQ node {busiest}"), || {
            node.boot().unwrap()
        });
    })
    .await;
    drop(nodes);
    assert_eq!(report.faults.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_loses_the_stream_leader() {
    let _one = ONE_CLUSTER.lock().await;
    let Some(nodes) = cluster(NatsCluster::start).await else {
        return;
    };
    let topic = unique("failover");
    let url = format!(
        "nats://{}?group={}&topics={topic}&partitions={PARTITIONS}&replicas=3",
        nodes.lock().unwrap().addresses(),
        unique("failover-group")
    );
    // A topic name of letters, digits and dashes is its stream's name.
    let stream = topic.clone();
    let cluster = nodes.clone();
    let report = failover(&url, &topic.clone(), Producer::Convoy, move |progress| {
        let mut cluster = cluster.lock().unwrap();
        let leader = cluster.stream_leader(&stream).expect("the stream has a leader");
        progress.fault(
            &format!("kill -9 of NATS server {leader}, the stream's leader"),
            || {
                cluster
                    .by_name(&leader)
                    .unwrap()
                    .kill()
                    .expect("the server was killed")
            },
        );
        progress.fault(&format!("restart of NATS server {leader}"), || {
            cluster.by_name(&leader).unwrap().restart().unwrap()
        });
    })
    .await;
    drop(nodes);
    assert_eq!(report.faults.len(), 2);
}
