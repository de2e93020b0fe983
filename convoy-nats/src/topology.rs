//! What a topic is on NATS JetStream, and declaring it.
//!
//! A topic `T` of N partitions is a stream with file storage and limits retention (messages stay
//! after they are handled, like a Kafka log, until `stream_max_age_s` / `stream_max_bytes`)
//! whose subjects are exactly `T.0 … T.{N-1}` — listed, not `T.*`, so the dead-letter stream
//! `T.dlq` never overlaps it. Each consumer group `G` keeps two key-value buckets:
//! `convoy_wm_G` (no expiry), the committed watermark of each partition, and
//! `convoy_leases_G` (entries expire `lease_ttl_ms` after their last write), the partition
//! leases, the members' presence and the extra tokens of fair shares. All of them have
//! `replicas` replicas (1 by default; 3 on a cluster that must survive losing a server). Every
//! declare is idempotent and tolerates another member declaring the same at the same moment;
//! an existing stream or bucket with another configuration is a clear error naming what
//! differs, never used as it is.

use std::time::Duration;

use async_nats::jetstream::context::CreateStreamErrorKind;
use async_nats::jetstream::kv::Store;
use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use bytes::Bytes;
use convoy_core::offset_map;
use convoy_core::{Offset, TransportError};

use crate::config::NatsConfig;
use crate::error::nats_error;

/// A name made of what stream, bucket and consumer names may hold (`A-Z a-z 0-9 _ -`): other
/// characters become `_`, and a hash of the original is appended when any did, so `a.b` and
/// `a_b` never share a name.
pub fn safe_name(name: &str) -> String {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if safe == name {
        safe
    } else {
        format!("{safe}-{:08x}", fnv1a(name.as_bytes()))
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The stream of `topic`.
pub fn stream_name(topic: &str) -> String {
    safe_name(topic)
}

/// The subject of partition `p` of `topic`.
pub fn partition_subject(topic: &str, p: u32) -> String {
    format!("{topic}.{p}")
}

/// The bucket of `group`'s committed watermarks.
pub fn watermarks_bucket(group: &str) -> String {
    format!("convoy_wm_{}", safe_name(group))
}

/// The bucket of `group`'s leases, member presence and extra tokens.
pub fn leases_bucket(group: &str) -> String {
    format!("convoy_leases_{}", safe_name(group))
}

/// Key of partition `p` of `topic`, in both buckets: its lease, and its watermark.
pub fn partition_key(topic: &str, p: u32) -> String {
    format!("p.{}.{p}", stream_name(topic))
}

/// What a watermark entry holds: the watermark, the member that wrote it (so a member can tell
/// its own write from another's when the answer to a write was lost), when the stream it
/// counts in was created (so a watermark of a stream deleted and created again, or restored
/// from an older backup, is not taken for a position in the new one), and the sequences above
/// the watermark already finished (so the next owner skips them, as Kafka's offset map does).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatermarkEntry {
    /// Every stream sequence up to it is finished (none: nothing is).
    pub watermark: Option<Offset>,
    /// The member that wrote it (an earlier version's bare number has none).
    pub writer: Option<u64>,
    /// The stream's creation time, in Unix nanoseconds (none in an earlier version's value).
    pub stream_created: Option<i128>,
    /// Finished sequences above the watermark, ascending (empty in an earlier version's value,
    /// and when they would not fit [`FINISHED_ABOVE_MAX_BYTES`]: they are handled again then).
    pub finished_above: Vec<Offset>,
}

/// The most bytes the finished sequences above a watermark take in its entry.
pub const FINISHED_ABOVE_MAX_BYTES: usize = 16 * 1024;

impl WatermarkEntry {
    /// The entry's value: `"<watermark>@<writer hex>@<stream created ns>@<offset map>"`, the
    /// watermark empty for none, the map ([`convoy_core::offset_map`]) empty for nothing above.
    pub fn encode(&self) -> Bytes {
        let next = self.watermark.map_or(0, |w| w + 1);
        let map = offset_map::encode(next, &self.finished_above, FINISHED_ABOVE_MAX_BYTES);
        Bytes::from(format!(
            "{}@{:016x}@{}@{}",
            self.watermark.map(|w| w.to_string()).unwrap_or_default(),
            self.writer.unwrap_or_default(),
            self.stream_created.unwrap_or_default(),
            map.unwrap_or_default()
        ))
    }

    /// Reads a value written by [`WatermarkEntry::encode`] or an earlier version's.
    pub fn decode(value: &[u8]) -> WatermarkEntry {
        let text = std::str::from_utf8(value).unwrap_or_default();
        let mut parts = text.split('@');
        let watermark = parts.next().and_then(|w| w.parse().ok());
        WatermarkEntry {
            watermark,
            writer: parts.next().and_then(|m| u64::from_str_radix(m, 16).ok()),
            stream_created: parts.next().and_then(|c| c.parse().ok()),
            finished_above: parts
                .next()
                .map(|map| offset_map::decode(watermark.map_or(0, |w| w + 1), map))
                .unwrap_or_default(),
        }
    }
}

/// Key announcing member `id`.
pub fn member_key(id: u64) -> String {
    format!("m.{id:016x}")
}

/// The subject filter (below the bucket's prefix) of every [`member_key`].
pub fn member_key_filter() -> &'static str {
    "m.>"
}

/// Key of extra token `j`.
pub fn token_key(j: u32) -> String {
    format!("x.{j}")
}

/// The topic a stream of these subjects holds, if they are a convoy topic's: `T.0 … T.{N-1}`.
pub fn topic_of_subjects(subjects: &[String]) -> Option<String> {
    let topic = subjects.first()?.strip_suffix(".0")?;
    let expected = (0..subjects.len()).map(|p| partition_subject(topic, p as u32));
    expected.eq(subjects.iter().cloned()).then(|| topic.to_owned())
}

/// True for the key of an extra token.
pub fn is_token_key(key: &str) -> bool {
    key.starts_with("x.")
}

/// The name of member `member`'s consumer of partition `p`, the `serial`-th it created: one
/// per ownership epoch and per re-creation, because a consumer's start can never be moved.
pub fn consumer_name(member: u64, p: u32, serial: u64) -> String {
    format!("cv-{member:016x}-{p}-{serial}")
}

fn stream_config(name: String, subjects: Vec<String>, config: &NatsConfig) -> Config {
    Config {
        name,
        subjects,
        retention: RetentionPolicy::Limits,
        storage: StorageType::File,
        max_age: Duration::from_secs(config.stream_max_age_s),
        max_bytes: config.stream_max_bytes,
        duplicate_window: Duration::from_secs(config.duplicate_window_s),
        discard: DiscardPolicy::Old,
        num_replicas: config.replicas,
        ..Config::default()
    }
}

/// Declares the stream of `topic` with `partitions` partition subjects.
pub async fn declare_topic(
    js: &Context,
    config: &NatsConfig,
    topic: &str,
    partitions: u32,
) -> Result<(), TransportError> {
    let subjects = (0..partitions).map(|p| partition_subject(topic, p)).collect();
    create_stream(js, stream_config(stream_name(topic), subjects, config), topic).await
}

/// Declares a dead-letter stream: one subject, the stream's own name.
pub async fn declare_dead_letters(
    js: &Context,
    config: &NatsConfig,
    topic: &str,
) -> Result<(), TransportError> {
    create_stream(
        js,
        stream_config(stream_name(topic), vec![topic.to_owned()], config),
        topic,
    )
    .await
}

async fn create_stream(js: &Context, wanted: Config, what: &str) -> Result<(), TransportError> {
    let error = match js.create_stream(wanted.clone()).await {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    // A stream of this name exists already with another configuration — or another member
    // created it an instant earlier, which some servers answer as an overlap of its subjects.
    if !matches!(error.kind(), CreateStreamErrorKind::JetStream(ref j)
        if [ErrorCode::STREAM_NAME_EXIST, ErrorCode::STREAM_SUBJECT_OVERLAP].contains(&j.error_code()))
    {
        return Err(nats_error(&format!("creating the stream of {what}"), error));
    }
    let found = match js.get_stream(&wanted.name).await {
        Ok(stream) => stream.cached_info().config.clone(),
        // No stream of that name: the subjects really belong to another stream.
        Err(_) => return Err(nats_error(&format!("creating the stream of {what}"), error)),
    };
    let differs = differences(&wanted, &found);
    if differs.is_empty() {
        return Ok(());
    }
    Err(TransportError::Fatal(format!(
        "stream {} ({what}) already exists with another configuration: {}; use the settings it \
         was created with (partitions, replicas, stream_max_age_s, stream_max_bytes, \
         duplicate_window_s, lease_ttl_ms), or another topic name: convoy never uses a stream \
         it did not configure",
        wanted.name,
        differs.join(", ")
    )))
}

/// "Unlimited" is 0 or -1 in a request and always -1 in what the server stores.
fn limit(value: i64) -> i64 {
    if value <= 0 {
        -1
    } else {
        value
    }
}

/// What differs between the configuration convoy wants and the one `found` on the server, in
/// the fields convoy sets, compared as the server stores them.
fn differences(wanted: &Config, found: &Config) -> Vec<String> {
    let mut differs = Vec::new();
    let mut compare = |field: &str, ours: String, theirs: String| {
        if ours != theirs {
            differs.push(format!("{field} {theirs} (convoy wants {ours})"));
        }
    };
    compare(
        "subjects",
        format!("{:?}", wanted.subjects),
        format!("{:?}", found.subjects),
    );
    compare(
        "retention",
        format!("{:?}", wanted.retention),
        format!("{:?}", found.retention),
    );
    compare(
        "storage",
        format!("{:?}", wanted.storage),
        format!("{:?}", found.storage),
    );
    compare(
        "max_age",
        format!("{:?}", wanted.max_age),
        format!("{:?}", found.max_age),
    );
    compare(
        "max_bytes",
        limit(wanted.max_bytes).to_string(),
        limit(found.max_bytes).to_string(),
    );
    compare(
        "duplicate_window",
        format!("{:?}", wanted.duplicate_window),
        format!("{:?}", found.duplicate_window),
    );
    compare(
        "discard",
        format!("{:?}", wanted.discard),
        format!("{:?}", found.discard),
    );
    compare(
        "max_messages_per_subject",
        limit(wanted.max_messages_per_subject).to_string(),
        limit(found.max_messages_per_subject).to_string(),
    );
    compare(
        "replicas",
        wanted.num_replicas.max(1).to_string(),
        found.num_replicas.max(1).to_string(),
    );
    differs
}

/// Declares a key-value bucket the way the server's own KV API would (async-nats'
/// `create_key_value` fails on nats-server 2.9: it first asks for account fields 2.9 does not
/// send), then opens it. `max_age` zero: entries never expire.
async fn declare_bucket(
    js: &Context,
    bucket: &str,
    max_age: Duration,
    replicas: usize,
) -> Result<Store, TransportError> {
    let stream = Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: StorageType::File,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: DiscardPolicy::New,
        num_replicas: replicas,
        // The server sets the duplicate window to max_age when it is shorter than the default
        // two minutes; asking for that keeps a second declare identical.
        duplicate_window: if max_age.is_zero() {
            Duration::from_secs(120)
        } else {
            max_age.min(Duration::from_secs(120))
        },
        ..Config::default()
    };
    create_stream(js, stream, bucket).await?;
    js.get_key_value(bucket)
        .await
        .map_err(|e| nats_error(&format!("opening the bucket {bucket}"), e))
}

/// The group's buckets: watermarks and leases.
pub struct Buckets {
    /// Committed watermarks (never expire).
    pub watermarks: Store,
    /// Leases, members and tokens (expire `lease_ttl_ms` after their last write).
    pub leases: Store,
}

/// Declares and opens `config.group`'s buckets.
pub async fn declare_buckets(js: &Context, config: &NatsConfig) -> Result<Buckets, TransportError> {
    Ok(Buckets {
        watermarks: declare_bucket(
            js,
            &watermarks_bucket(&config.group),
            Duration::ZERO,
            config.replicas,
        )
        .await?,
        leases: declare_bucket(
            js,
            &leases_bucket(&config.group),
            config.lease_ttl(),
            config.replicas,
        )
        .await?,
    })
}

/// The watermarks bucket alone (reading or moving a group's positions from a tool or a test).
pub async fn open_watermarks(
    js: &Context,
    config: &NatsConfig,
    group: &str,
) -> Result<Store, TransportError> {
    declare_bucket(js, &watermarks_bucket(group), Duration::ZERO, config.replicas).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_entries_name_their_writer_and_stream() {
        let entry = WatermarkEntry {
            watermark: Some(41),
            writer: Some(0xa7),
            stream_created: Some(1_796_183_039_901_000_000),
            finished_above: vec![43, 44, 90],
        };
        assert_eq!(WatermarkEntry::decode(&entry.encode()), entry);
        let bare = WatermarkEntry {
            finished_above: Vec::new(),
            ..entry.clone()
        };
        assert_eq!(WatermarkEntry::decode(&bare.encode()), bare);
        assert_eq!(
            WatermarkEntry::decode(b"41@00000000000000a7@1796183039901000000"),
            bare,
            "the format without finished sequences"
        );
        let none = WatermarkEntry {
            watermark: None,
            finished_above: vec![3],
            ..entry
        };
        assert_eq!(WatermarkEntry::decode(&none.encode()), none);
        assert_eq!(
            WatermarkEntry::decode(b"17"),
            WatermarkEntry {
                watermark: Some(17),
                ..WatermarkEntry::default()
            },
            "the earlier format"
        );
        assert_eq!(WatermarkEntry::decode(b""), WatermarkEntry::default());
    }

    #[test]
    fn unlimited_and_one_replica_compare_as_the_server_stores_them() {
        let config = NatsConfig::new(&["127.0.0.1:4222"], "g", &["t"]);
        let wanted = stream_config("t".into(), vec!["t.0".into()], &config);
        let mut stored = wanted.clone();
        stored.max_messages_per_subject = -1;
        stored.max_bytes = -1;
        assert_eq!(wanted.max_messages_per_subject, 0);
        assert!(
            differences(&wanted, &stored).is_empty(),
            "{:?}",
            differences(&wanted, &stored)
        );
        stored.num_replicas = 3;
        stored.max_age = Duration::from_secs(60);
        assert_eq!(
            differences(&wanted, &stored),
            [
                "max_age 60s (convoy wants 604800s)",
                "replicas 3 (convoy wants 1)"
            ]
        );
    }

    #[test]
    fn names_follow_topic_group_and_partition() {
        assert_eq!(stream_name("orders"), "orders");
        assert_eq!(partition_subject("orders", 3), "orders.3");
        assert!(stream_name("orders.eu").starts_with("orders_eu-"));
        assert_ne!(stream_name("orders.eu"), stream_name("orders_eu"));
        assert_eq!(partition_key("orders", 2), "p.orders.2");
        assert_eq!(watermarks_bucket("billing"), "convoy_wm_billing");
        assert!(leases_bucket("a.b").starts_with("convoy_leases_a_b-"));
        assert!(member_key(7).starts_with(member_key_filter().trim_end_matches('>')));
        assert!(!token_key(0).starts_with(member_key_filter().trim_end_matches('>')));
        let subjects: Vec<String> = (0..3).map(|p| partition_subject("orders", p)).collect();
        assert_eq!(topic_of_subjects(&subjects).as_deref(), Some("orders"));
        assert_eq!(topic_of_subjects(&["orders.dlq".to_owned()]), None);
        assert_eq!(consumer_name(1, 4, 2), "cv-0000000000000001-4-2");
    }
}
