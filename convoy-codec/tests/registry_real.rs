//! The registry codecs against a real registry: Apicurio Registry 3.3.3's Confluent API
//! (`scripts/brokers/registry up`, schemas kept in Kafka, compatibility BACKWARD), at
//! `CONVOY_SCHEMA_REGISTRY`. Each test registers under subjects of its own.

#![allow(clippy::unwrap_used)]

use convoy_codec::{
    wire, CodecError, ConfluentAvro, ConfluentJson, ConfluentProtobuf, Decoder, Encoder, SchemaKind,
    SchemaRegistry,
};
use convoy_testkit::support::{required, unique};
use serde::{Deserialize, Serialize};

const ENTRY_V1: &str = r#"{"type":"record","name":"Entry","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"}]}"#;
const ENTRY_V2: &str = r#"{"type":"record","name":"Entry","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"},
    {"name":"memo","type":"string","default":"none"}]}"#;
// `seq` as a string: a v2 reader cannot read v1's longs, so BACKWARD refuses it.
const ENTRY_TEXT_SEQ: &str = r#"{"type":"record","name":"Entry","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"string"}]}"#;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct EntryV1 {
    account: String,
    seq: i64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct EntryV2 {
    account: String,
    seq: i64,
    memo: String,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct EntryTextSeq {
    account: String,
    seq: String,
}

fn registry() -> Option<SchemaRegistry> {
    let url = required("CONVOY_SCHEMA_REGISTRY")?;
    Some(SchemaRegistry::new(&url).unwrap())
}

#[tokio::test]
async fn avro_evolves_within_the_registrys_compatibility_and_is_refused_outside_it() {
    let Some(registry) = registry() else { return };
    let subject = format!("{}-value", unique("ledger"));
    let v1 = ConfluentAvro::<EntryV1>::new(registry.clone(), &subject, ENTRY_V1).unwrap();
    let v1_payload = v1
        .encode(&EntryV1 {
            account: "a".into(),
            seq: 1,
        })
        .await
        .unwrap();
    let v1_id = wire::unframe(&v1_payload).unwrap().schema_id;

    // The registry holds what the codec registered, as the codec registered it.
    let held = registry.schema(v1_id).await.unwrap();
    assert_eq!(held.kind, SchemaKind::Avro);
    assert!(held.text.contains("\"seq\""), "{}", held.text);

    let v2 = ConfluentAvro::<EntryV2>::new(registry.clone(), &subject, ENTRY_V2).unwrap();
    let v2_payload = v2
        .encode(&EntryV2 {
            account: "b".into(),
            seq: 2,
            memo: "refund".into(),
        })
        .await
        .unwrap();
    let v2_id = wire::unframe(&v2_payload).unwrap().schema_id;
    assert_ne!(v1_id, v2_id, "an evolved schema is a new id");

    // A fresh client (nothing cached) reads both with v2, and v2's payload with v1.
    let fresh = SchemaRegistry::new(registry.url()).unwrap();
    let reader = ConfluentAvro::<EntryV2>::new(fresh.clone(), &subject, ENTRY_V2).unwrap();
    assert_eq!(
        reader.decode(&v1_payload).await.unwrap(),
        EntryV2 {
            account: "a".into(),
            seq: 1,
            memo: "none".into()
        }
    );
    assert_eq!(reader.decode(&v2_payload).await.unwrap().memo, "refund");
    let old_reader = ConfluentAvro::<EntryV1>::new(fresh, &subject, ENTRY_V1).unwrap();
    assert_eq!(
        old_reader.decode(&v2_payload).await.unwrap(),
        EntryV1 {
            account: "b".into(),
            seq: 2
        }
    );

    // BACKWARD refuses a change that v1's data cannot be read with.
    let refused = ConfluentAvro::<EntryTextSeq>::new(registry.clone(), &subject, ENTRY_TEXT_SEQ).unwrap();
    let err = refused
        .encode(&EntryTextSeq {
            account: "c".into(),
            seq: "3".into(),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::Unencodable(_)), "{err:?}");
    assert!(err.to_string().contains(&subject), "{err}");
}

#[tokio::test]
async fn an_id_the_registry_does_not_hold_is_malformed() {
    let Some(registry) = registry() else { return };
    let avro = ConfluentAvro::<EntryV1>::new(registry, "unused-value", ENTRY_V1).unwrap();
    let err = avro
        .decode(&wire::frame(2_000_000_000, None, &[2, b'a', 2]))
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::Malformed(_)), "{err:?}");
    assert!(err.to_string().contains("40403"), "{err}");
}

#[derive(Clone, PartialEq, prost::Message)]
struct Reading {
    #[prost(string, tag = "1")]
    device: String,
    #[prost(double, tag = "2")]
    celsius: f64,
}

#[tokio::test]
async fn protobuf_and_json_schemas_register_and_frame() {
    let Some(registry) = registry() else { return };
    let proto = "syntax = \"proto3\";\npackage convoy.test;\n\nmessage Reading {\n  string device = 1;\n  double celsius = 2;\n}\n";
    let readings =
        ConfluentProtobuf::<Reading>::new(registry.clone(), format!("{}-value", unique("readings")), proto);
    let reading = Reading {
        device: "d1".into(),
        celsius: -4.25,
    };
    let payload = readings.encode(&reading).await.unwrap();
    let framed = wire::unframe(&payload).unwrap();
    assert_eq!(
        registry.schema(framed.schema_id).await.unwrap().kind,
        SchemaKind::Protobuf
    );
    assert_eq!(framed.body[0], 0, "message indexes [0]");
    let fresh = SchemaRegistry::new(registry.url()).unwrap();
    let reader = ConfluentProtobuf::<Reading>::new(fresh, "any-value", proto);
    assert_eq!(reader.decode(&payload).await.unwrap(), reading);

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Order {
        qty: u32,
    }
    let schema = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object","properties":{"qty":{"type":"integer"}}}"#;
    let orders = ConfluentJson::<Order>::new(registry.clone(), format!("{}-value", unique("orders")), schema);
    let payload = orders.encode(&Order { qty: 9 }).await.unwrap();
    let id = wire::unframe(&payload).unwrap().schema_id;
    assert_eq!(registry.schema(id).await.unwrap().kind, SchemaKind::Json);
    assert_eq!(orders.decode(&payload).await.unwrap(), Order { qty: 9 });
    // The JSON codec refuses the Protobuf schema's id.
    let err = orders
        .decode(&wire::frame(framed.schema_id, None, b"{\"qty\":1}"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not Json"), "{err}");
}
