//! What tools need besides consuming: declaring topics, reading a stream without consuming it
//! (dead letters), a group's committed watermarks, deleting what tests declared.

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::kv::Operation;
use convoy_core::{Message, Offset, SourceId, TransportError};
use futures_util::StreamExt;

use crate::config::NatsConfig;
use crate::connect::{connect, Connected};
use crate::convert::to_message;
use crate::error::nats_error;
use crate::topology;

/// Checks that the server answers and has JetStream.
pub async fn check_reachable(config: &NatsConfig) -> Result<(), TransportError> {
    let connected = connect(config, "check").await?;
    // A stream lookup answers "not found" from JetStream, or times out without it.
    match connected.js.get_stream("convoy-reachability-probe").await {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("not found") => Ok(()),
        Err(e) => Err(nats_error(
            "asking JetStream (is the server started with -js?)",
            e,
        )),
    }
}

/// Declares each `(topic, partitions)` stream (idempotent; one with another configuration is
/// an error naming what differs).
pub async fn create_topics(config: &NatsConfig, topics: &[(&str, u32)]) -> Result<(), TransportError> {
    let connected = connect(config, "admin").await?;
    for (topic, partitions) in topics {
        topology::declare_topic(&connected.js, config, topic, *partitions).await?;
    }
    Ok(())
}

/// The topics convoy's streams hold — a stream whose subjects are `T.0 … T.{N-1}` is topic `T`
/// of N partitions — by name. (Dead-letter streams, one subject each, are not listed.)
pub async fn list_topics(config: &NatsConfig) -> Result<Vec<(String, usize)>, TransportError> {
    let connected = connect(config, "admin").await?;
    let mut streams = connected.js.streams();
    let mut topics = Vec::new();
    while let Some(info) = streams.next().await {
        let info = info.map_err(|e| nats_error("listing the streams", e))?;
        if let Some(topic) = topology::topic_of_subjects(&info.config.subjects) {
            topics.push((topic, info.config.subjects.len()));
        }
    }
    topics.sort();
    Ok(topics)
}

/// Declares the dead-letter stream `topic`.
pub async fn create_dead_letters(config: &NatsConfig, topic: &str) -> Result<(), TransportError> {
    let connected = connect(config, "admin").await?;
    topology::declare_dead_letters(&connected.js, config, topic).await
}

/// Every message of `topic`'s stream, oldest first, without consuming anything: a stream keeps
/// what is read. Each message's offset is its stream sequence, its source `topic/<partition>`
/// (the subject's last token; 0 for a dead-letter stream). A stream that does not exist reads
/// as empty.
pub async fn read_stream(config: &NatsConfig, topic: &str) -> Result<Vec<Message>, TransportError> {
    let connected = connect(config, "admin").await?;
    read_with(&connected, topic).await
}

pub(crate) async fn read_with(connected: &Connected, topic: &str) -> Result<Vec<Message>, TransportError> {
    Ok(read_from(connected, topic, 1).await?.messages)
}

/// What [`read_from`] read.
pub(crate) struct Read {
    pub messages: Vec<Message>,
    /// The sequence after the last message (`start` when there were none).
    pub next: u64,
    /// When the stream was created (unix nanoseconds): what tells it from one of the same name
    /// deleted and created again. `None` when there is no stream.
    pub created: Option<i128>,
}

/// The messages of `topic`'s stream from sequence `start` on (what it holds now).
pub(crate) async fn read_from(
    connected: &Connected,
    topic: &str,
    start: u64,
) -> Result<Read, TransportError> {
    let name = topology::stream_name(topic);
    let mut stream = match connected.js.get_stream(&name).await {
        Ok(stream) => stream,
        Err(e) if e.to_string().contains("not found") => {
            return Ok(Read {
                messages: Vec::new(),
                next: start,
                created: None,
            })
        }
        Err(e) => return Err(nats_error(&format!("opening the stream of {topic}"), e)),
    };
    let created = stream
        .info()
        .await
        .map_err(|e| nats_error(&format!("opening the stream of {topic}"), e))?
        .created
        .unix_timestamp_nanos();
    let deliver_policy = match start {
        0 | 1 => DeliverPolicy::All,
        start_sequence => DeliverPolicy::ByStartSequence { start_sequence },
    };
    let consumer = stream
        .create_consumer(pull::Config {
            deliver_policy,
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..pull::Config::default()
        })
        .await
        .map_err(|e| nats_error(&format!("reading the stream of {topic}"), e))?;
    // What the stream holds now; messages published later are not waited for.
    let total = consumer.cached_info().num_pending;
    if total == 0 {
        return Ok(Read {
            messages: Vec::new(),
            next: start,
            created: Some(created),
        });
    }
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(500)
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await
        .map_err(|e| nats_error(&format!("reading the stream of {topic}"), e))?;
    let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    while let Some(next) = tokio::time::timeout(Duration::from_secs(15), messages.next())
        .await
        .map_err(|_| TransportError::Unavailable(format!("reading the stream of {topic} timed out")))?
    {
        let message = next.map_err(|e| nats_error(&format!("reading the stream of {topic}"), e))?;
        let sequence = message
            .info()
            .map_err(|e| TransportError::broker(format!("reading the stream of {topic}"), e.to_string()))?
            .stream_sequence;
        let partition = message
            .subject
            .as_str()
            .strip_prefix(topic)
            .and_then(|rest| rest.strip_prefix('.'))
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        out.push(to_message(
            message.headers.as_ref(),
            message.payload.clone(),
            &SourceId::partition(topic, partition),
            sequence,
        ));
        if out.len() as u64 >= total {
            break;
        }
    }
    let next = out.last().map_or(start, |m| m.offset + 1);
    Ok(Read {
        messages: out,
        next,
        created: Some(created),
    })
}

/// `config.group`'s committed watermark of each partition of `topic` that has one.
pub async fn committed(config: &NatsConfig, topic: &str) -> Result<Vec<(u32, Offset)>, TransportError> {
    let connected = connect(config, "admin").await?;
    let store = topology::open_watermarks(&connected.js, config, &config.group).await?;
    let mut out = Vec::new();
    for p in 0..config.partitions {
        let key = topology::partition_key(topic, p);
        let entry = store
            .entry(key.as_str())
            .await
            .map_err(|e| nats_error("reading a watermark", e))?;
        if let Some(entry) = entry.filter(|e| e.operation == Operation::Put) {
            if let Some(w) = topology::WatermarkEntry::decode(&entry.value).watermark {
                out.push((p, w));
            }
        }
    }
    Ok(out)
}

/// True if the stream of `topic` (a topic's, or a dead-letter topic's) exists.
pub async fn stream_exists(config: &NatsConfig, topic: &str) -> Result<bool, TransportError> {
    let connected = connect(config, "admin").await?;
    let name = topology::stream_name(topic);
    match connected.js.get_stream(&name).await {
        Ok(_) => Ok(true),
        Err(e) if e.to_string().contains("not found") => Ok(false),
        Err(e) => Err(nats_error(&format!("looking up the stream {name}"), e)),
    }
}

/// Deletes `topic`'s stream alone (a group's buckets stay: they hold its state for every topic
/// it reads). One that does not exist is skipped.
pub async fn delete_stream_of(config: &NatsConfig, topic: &str) -> Result<(), TransportError> {
    let connected = connect(config, "admin").await?;
    let name = topology::stream_name(topic);
    match connected.js.delete_stream(&name).await {
        Err(e) if !e.to_string().contains("not found") => {
            Err(nats_error(&format!("deleting the stream {name}"), e))
        }
        _ => Ok(()),
    }
}

/// Deletes `topic`'s stream, and `also` streams (dead letters) if given, and `config.group`'s
/// buckets. What does not exist is skipped.
pub async fn delete_topic(config: &NatsConfig, topic: &str, also: &[&str]) -> Result<(), TransportError> {
    let connected = connect(config, "admin").await?;
    let streams = std::iter::once(topology::stream_name(topic))
        .chain(also.iter().map(|t| topology::stream_name(t)))
        .chain([
            format!("KV_{}", topology::watermarks_bucket(&config.group)),
            format!("KV_{}", topology::leases_bucket(&config.group)),
        ]);
    for name in streams {
        if let Err(e) = connected.js.delete_stream(&name).await {
            if !e.to_string().contains("not found") {
                return Err(nats_error(&format!("deleting the stream {name}"), e));
            }
        }
    }
    Ok(())
}
