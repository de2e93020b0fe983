//! The registry codecs against a stand-in registry (`support`): registration once per schema,
//! schema evolution, every failure classified, and an outage that stalls the keys it reaches
//! instead of dead-lettering their messages.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use convoy_codec::{
    wire, CodecError, ConfluentAvro, ConfluentJson, ConfluentProtobuf, Decoder, Encoder, SchemaRegistry,
};
use convoy_core::retry::{Backoff, Jitter, RetryPolicy};
use convoy_core::{typed_with, Delivery, Engine, EngineConfig, OutgoingMessage, Publisher};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
use serde::{Deserialize, Serialize};
use support::FakeRegistry;

const ENTRY_V1: &str = r#"{"type":"record","name":"Entry","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"}]}"#;
// v2 adds a field with a default: readers of v2 can read v1 (BACKWARD compatible).
const ENTRY_V2: &str = r#"{"type":"record","name":"Entry","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"},
    {"name":"memo","type":"string","default":"none"}]}"#;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct EntryV1 {
    account: String,
    seq: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct EntryV2 {
    account: String,
    seq: i64,
    memo: String,
}

#[tokio::test]
async fn avro_registers_once_frames_its_id_and_reads_across_versions() {
    let fake = FakeRegistry::start().await;
    let registry = SchemaRegistry::new(&fake.url).unwrap();
    let v1 = ConfluentAvro::<EntryV1>::new(registry.clone(), "ledger-value", ENTRY_V1).unwrap();
    let entry = EntryV1 {
        account: "a".into(),
        seq: 1,
    };
    let mut payloads = Vec::new();
    for _ in 0..3 {
        payloads.push(v1.encode(&entry).await.unwrap());
    }
    assert_eq!(
        fake.registered.load(Ordering::SeqCst),
        1,
        "registered once, then cached"
    );
    let framed = wire::unframe(&payloads[0]).unwrap();
    assert_eq!(framed.schema_id, 1);
    assert_eq!(&framed.body[..], &[2, b'a', 2], "Avro: string \"a\", long 1");

    // A v2 producer registers the evolved schema (id 2).
    let v2 = ConfluentAvro::<EntryV2>::new(registry.clone(), "ledger-value", ENTRY_V2).unwrap();
    let evolved = EntryV2 {
        account: "b".into(),
        seq: 2,
        memo: "refund".into(),
    };
    let v2_payload = v2.encode(&evolved).await.unwrap();
    assert_eq!(wire::unframe(&v2_payload).unwrap().schema_id, 2);

    // A v2 reader reads v1 payloads (memo defaulted) and its own.
    let read: EntryV2 = v2.decode(&payloads[0]).await.unwrap();
    assert_eq!(
        read,
        EntryV2 {
            account: "a".into(),
            seq: 1,
            memo: "none".into()
        }
    );
    assert_eq!(v2.decode(&v2_payload).await.unwrap(), evolved);
    // A v1 reader reads v2 payloads (memo dropped): consumers may upgrade after producers.
    let old: EntryV1 = v1.decode(&v2_payload).await.unwrap();
    assert_eq!(
        old,
        EntryV1 {
            account: "b".into(),
            seq: 2
        }
    );
    // Schema 1 was fetched by no one (the v1 codec registered it), schema 2 once by v1.
    let fetched = fake.fetched.load(Ordering::SeqCst);
    for _ in 0..10 {
        v1.decode(&v2_payload).await.unwrap();
    }
    assert_eq!(
        fake.fetched.load(Ordering::SeqCst),
        fetched,
        "writer schemas are cached"
    );
}

#[tokio::test]
async fn every_failure_says_whether_retrying_helps() {
    let fake = FakeRegistry::start().await;
    let registry = SchemaRegistry::new(&fake.url).unwrap();
    let avro = ConfluentAvro::<EntryV1>::new(registry.clone(), "orders-value", ENTRY_V1).unwrap();

    // A schema id nobody registered: malformed (dead-lettered), with the registry's words.
    let err = avro
        .decode(&wire::frame(77, None, &[2, b'a', 2]))
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::Malformed(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("schema id 77 is not in the schema registry"),
        "{err}"
    );
    assert!(err.to_string().contains("40403"), "{err}");

    // A payload of another kind's schema, and a payload without the wire format.
    let proto_id = fake.seed(
        "other-value",
        Some("PROTOBUF"),
        "syntax = \"proto3\"; message M { string a = 1; }",
    );
    let err = avro.decode(&wire::frame(proto_id, None, b"")).await.unwrap_err();
    assert!(
        err.to_string().contains("is a Protobuf schema, not Avro"),
        "{err}"
    );
    let err = avro
        .decode(&Bytes::from_static(br#"{"account":"a"}"#))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("magic byte"), "{err}");

    // The registry down: transient, for decoding and encoding alike.
    fake.down.store(true, Ordering::SeqCst);
    let id = fake.seed("orders-value", None, ENTRY_V1);
    let err = avro
        .decode(&wire::frame(id, None, &[2, b'a', 2]))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("503"), "{err}");
    let err = avro
        .encode(&EntryV1 {
            account: "a".into(),
            seq: 1,
        })
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    fake.down.store(false, Ordering::SeqCst);
    assert_eq!(
        avro.decode(&wire::frame(id, None, &[2, b'a', 2]))
            .await
            .unwrap()
            .seq,
        1
    );

    // Nothing listening at all: transient too.
    let gone = SchemaRegistry::builder("http://127.0.0.1:9")
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let err = ConfluentAvro::<EntryV1>::new(gone, "x", ENTRY_V1)
        .unwrap()
        .decode(&wire::frame(1, None, &[]))
        .await
        .unwrap_err();
    assert!(
        err.is_transient() && err.to_string().contains("did not answer"),
        "{err}"
    );

    // Refused credentials: transient (a configuration fix must not cost the messages), named.
    fake.require_auth.store(true, Ordering::SeqCst);
    let err =
        ConfluentAvro::<EntryV1>::new(SchemaRegistry::new(&fake.url).unwrap(), "orders-value", ENTRY_V1)
            .unwrap()
            .decode(&wire::frame(id, None, &[2, b'a', 2]))
            .await
            .unwrap_err();
    assert!(
        err.is_transient() && err.to_string().contains("credentials"),
        "{err}"
    );
    let authorized = SchemaRegistry::builder(&fake.url)
        .basic_auth("key", "secret")
        .build()
        .unwrap();
    let with_auth = ConfluentAvro::<EntryV1>::new(authorized, "orders-value", ENTRY_V1).unwrap();
    assert_eq!(
        with_auth
            .decode(&wire::frame(id, None, &[2, b'a', 2]))
            .await
            .unwrap()
            .seq,
        1
    );
    fake.require_auth.store(false, Ordering::SeqCst);

    // An incompatible schema: unencodable, with the registry's reason.
    fake.strict.lock().unwrap().push("orders-value".into());
    // The same fields under another record name: Avro's resolution cannot match it to Entry.
    let changed = r#"{"type":"record","name":"Posting","fields":[
        {"name":"account","type":"string"},{"name":"seq","type":"long"}]}"#;
    let err = ConfluentAvro::<EntryV1>::new(registry, "orders-value", changed)
        .unwrap()
        .encode(&EntryV1 {
            account: "a".into(),
            seq: 1,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::Unencodable(_)), "{err:?}");
    assert!(err.to_string().contains("Incompatible schema"), "{err}");
}

#[derive(Clone, PartialEq, prost::Message)]
struct Reading {
    #[prost(string, tag = "1")]
    device: String,
    #[prost(double, tag = "2")]
    celsius: f64,
}

const READING_PROTO: &str = "syntax = \"proto3\";\nmessage Reading {\n  string device = 1;\n  double celsius = 2;\n}\nmessage Other {\n  string x = 1;\n}\n";

#[tokio::test]
async fn protobuf_and_json_frame_their_ids_and_check_them() {
    let fake = FakeRegistry::start().await;
    let registry = SchemaRegistry::new(&fake.url).unwrap();

    let readings = ConfluentProtobuf::<Reading>::new(registry.clone(), "readings-value", READING_PROTO);
    let reading = Reading {
        device: "d1".into(),
        celsius: 21.5,
    };
    let payload = readings.encode(&reading).await.unwrap();
    assert_eq!(
        &payload[..6],
        &[0, 0, 0, 0, 1, 0],
        "magic, id 1, message index [0]"
    );
    assert_eq!(readings.decode(&payload).await.unwrap(), reading);
    // The same file's second message is not a Reading.
    let other = readings
        .clone()
        .message_indexes([1])
        .encode(&reading)
        .await
        .unwrap();
    let err = readings.decode(&other).await.unwrap_err();
    assert!(
        err.to_string().contains("message [1] of schema id 1, not [0]"),
        "{err}"
    );

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Order {
        qty: u32,
    }
    let orders = ConfluentJson::<Order>::new(registry, "orders-value", r#"{"type":"object"}"#);
    let payload = orders.encode(&Order { qty: 3 }).await.unwrap();
    assert_eq!(&payload[..], b"\0\0\0\0\x02{\"qty\":3}");
    assert_eq!(orders.decode(&payload).await.unwrap(), Order { qty: 3 });
    // A JSON payload under the Protobuf schema's id: the kinds differ.
    let err = orders.decode(&wire::frame(1, None, b"{}")).await.unwrap_err();
    assert!(err.to_string().contains("not Json"), "{err}");
}

/// While the registry is down, a message whose writer's schema is not cached yet is retried in
/// its lane: its key waits (and the keys behind it in order), nothing is dead-lettered, and once
/// the registry answers every message is handled, in order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_outage_stalls_keys_and_dead_letters_nothing() {
    let fake = FakeRegistry::start().await;
    let id = fake.seed("ledger-value", None, ENTRY_V1);
    fake.down.store(true, Ordering::SeqCst);

    let broker = MemoryBroker::new();
    broker.create_topic("ledger", 2);
    let publisher = MemoryPublisher::new(&broker, "ledger");
    let plain = convoy_codec::avro::Avro::<EntryV1>::new(ENTRY_V1).unwrap();
    for seq in 0..40 {
        let account = format!("acct-{}", seq % 4);
        let datum = plain
            .encode(&EntryV1 {
                account: account.clone(),
                seq,
            })
            .await
            .unwrap();
        publisher
            .publish(OutgoingMessage::new(account, wire::frame(id, None, &datum)))
            .await
            .unwrap();
    }

    let seen = Arc::new(Mutex::new(Vec::<(String, i64)>::new()));
    let handler = {
        let seen = seen.clone();
        let codec =
            ConfluentAvro::<EntryV1>::new(SchemaRegistry::new(&fake.url).unwrap(), "ledger-value", ENTRY_V1)
                .unwrap();
        typed_with(codec, move |e: EntryV1, _d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((e.account, e.seq));
                Ok(())
            }
        })
    };
    let mut config = EngineConfig::for_group("ledger-readers");
    // What a service on a registry should set: an outage is waited out however long it lasts
    // (with a limit, the messages it outlasts are dead-lettered as retries-exhausted).
    config.retry = RetryPolicy::with_backoff(Backoff::new(
        Duration::from_millis(20),
        2.0,
        Duration::from_millis(100),
        Jitter::Full,
    ))
    .with_unlimited_attempts();
    let running = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(MemoryDeadLetterSink::new(&broker, "ledger.dlq"))
        .build()
        .unwrap()
        .start(&MemoryTransport::new(&broker, "ledger-readers", &["ledger"]))
        .await
        .unwrap();

    // Wait until the registry refused a retry of some lane (its first attempt and a retry).
    while fake.refused.load(Ordering::SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        seen.lock().unwrap().is_empty(),
        "nothing decodes without the writer's schema"
    );
    assert_eq!(running.stats().dead_lettered, 0);
    fake.down.store(false, Ordering::SeqCst);

    while running.stats().finished() < 40 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = running.stop().await.unwrap();
    assert_eq!(report.stats.dead_lettered, 0, "an outage dead-letters nothing");
    assert!(
        report.stats.retries >= 1,
        "the outage was retried: {:?}",
        report.stats
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 40);
    for account in 0..4 {
        let seqs: Vec<i64> = seen
            .iter()
            .filter(|(a, _)| *a == format!("acct-{account}"))
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(
            seqs,
            (0..10).map(|n| n * 4 + account).collect::<Vec<_>>(),
            "acct-{account} in order"
        );
    }
    assert!(
        fake.fetched.load(Ordering::SeqCst) <= 4,
        "the schema is fetched once per lane at most, then cached: {}",
        fake.fetched.load(Ordering::SeqCst)
    );
}
