//! convoy's metrics over OTLP. The engine records through the `metrics` facade;
//! `convoy::otel_metrics` (feature `opentelemetry-metrics`) turns them into OpenTelemetry
//! instruments, and `opentelemetry-otlp` exports them over HTTP (protobuf) to a collector.
//!
//! So that it checks what a collector receives, the example runs a small one of its own on
//! 127.0.0.1 (a free port): an HTTP endpoint that decodes each export. A service points the
//! exporter at its real collector instead (`http://collector:4318/v1/metrics`, or
//! `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`), and builds the provider the same way.

use std::future::IntoFuture;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use convoy::{handler_fn, Delivery, HandlerError, OutgoingMessage};
use convoy_examples::{main_of, verdict, Error, Example};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_otlp::{MetricExporter, Protocol, WithExportConfig};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point, Metric};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use prost::Message as _;

const ORDERS: u64 = 100;

/// What the collector received: every export, decoded.
type Received = Arc<Mutex<Vec<ExportMetricsServiceRequest>>>;

/// The collector's OTLP/HTTP endpoint: `POST /v1/metrics` with a protobuf body.
fn collector(received: Received) -> Router {
    Router::new()
        .route(
            "/v1/metrics",
            post(|State(received): State<Received>, body: Bytes| async move {
                match ExportMetricsServiceRequest::decode(body) {
                    Ok(export) => {
                        received.lock().unwrap_or_else(|e| e.into_inner()).push(export);
                        (axum::http::StatusCode::OK, Vec::new())
                    }
                    Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string().into_bytes()),
                }
            }),
        )
        .with_state(received)
}

/// The metrics named `name` of every export, oldest first.
fn named(received: &[ExportMetricsServiceRequest], name: &str) -> Vec<Metric> {
    received
        .iter()
        .flat_map(|export| &export.resource_metrics)
        .flat_map(|resource| &resource.scope_metrics)
        .flat_map(|scope| &scope.metrics)
        .filter(|m| m.name == name)
        .cloned()
        .collect()
}

fn label(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match &kv.value {
            Some(v) => match &v.value {
                Some(any_value::Value::StringValue(s)) => Some(s.clone()),
                _ => None,
            },
            None => None,
        })
}

/// The newest total of a counter's series whose `key` label is `value` (0 if none arrived).
fn counter_total(received: &[ExportMetricsServiceRequest], name: &str, key: &str, value: &str) -> i64 {
    named(received, name)
        .iter()
        .filter_map(|m| match &m.data {
            Some(metric::Data::Sum(sum)) => Some(&sum.data_points),
            _ => None,
        })
        .flatten()
        .filter(|p| label(&p.attributes, key).as_deref() == Some(value))
        .filter_map(|p| match p.value {
            Some(number_data_point::Value::AsInt(n)) => Some(n),
            _ => None,
        })
        .next_back()
        .unwrap_or(0)
}

async fn run() -> Result<ExitCode, Error> {
    let received = Received::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}/v1/metrics", listener.local_addr()?);
    let server = tokio::spawn(axum::serve(listener, collector(received.clone())).into_future());

    // What a service does at startup, before it builds the engine.
    let exporter = MetricExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(&endpoint)
        .build()?;
    let provider = SdkMeterProvider::builder()
        .with_reader(
            PeriodicReader::builder(exporter)
                .with_interval(Duration::from_secs(1))
                .build(),
        )
        .build();
    convoy::otel_metrics::install(provider.meter("convoy"))?;
    println!("otlp: exporting to {endpoint}");

    let example = Example::setup("otlp").await?;
    let handler = handler_fn(|d: Delivery| async move {
        match d.payload_str()? {
            "refuse" => Err(HandlerError::terminal("refused")),
            _ => Ok(()),
        }
    });
    let running = example.start(handler, |_| {}).await?;
    example
        .publish(
            (0..ORDERS)
                .map(|i| {
                    let payload = if i == 41 {
                        "refuse".to_owned()
                    } else {
                        format!("item {i}")
                    };
                    OutgoingMessage::new(format!("order-{}", i % 10), payload)
                })
                .collect(),
        )
        .await?;
    running
        .wait_for("every order finished", |s| s.finished() >= ORDERS)
        .await?;
    // The sources' gauges are set on the engine's ticks: wait for an export that has them.
    let mut waited = Duration::ZERO;
    while named(
        &received.lock().unwrap_or_else(|e| e.into_inner()),
        "convoy_source_lag",
    )
    .is_empty()
    {
        if waited > Duration::from_secs(60) {
            return Err("otlp: no export with convoy_source_lag within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    let stats = running.stop().await?;
    // The last export (a blocking HTTP call, off the runtime's threads).
    let flushed = tokio::task::spawn_blocking(move || provider.shutdown()).await?;
    server.abort();
    example.clean_up().await?;

    let received = received.lock().unwrap_or_else(|e| e.into_inner());
    let handled = counter_total(&received, "convoy_handled_total", "outcome", "handled");
    let dead_lettered = counter_total(&received, "convoy_handled_total", "outcome", "dead_lettered");
    let terminal = counter_total(&received, "convoy_dead_lettered_total", "cause", "terminal");
    let attempts: u64 = named(&received, "convoy_handler_duration_seconds")
        .last()
        .and_then(|m| match &m.data {
            Some(metric::Data::Histogram(h)) => Some(h.data_points.iter().map(|p| p.count).sum()),
            _ => None,
        })
        .unwrap_or(0);
    let lag_partitions: std::collections::BTreeSet<String> = named(&received, "convoy_source_lag")
        .iter()
        .filter_map(|m| match &m.data {
            Some(metric::Data::Gauge(g)) => Some(&g.data_points),
            _ => None,
        })
        .flatten()
        .filter_map(|p| label(&p.attributes, "partition"))
        .collect();
    println!(
        "otlp: {} exports received; handled {handled}, dead-lettered {dead_lettered} (terminal {terminal}), \
         {attempts} handler attempts, lag of partitions {lag_partitions:?}; engine: {} handled",
        received.len(),
        stats.handled
    );
    Ok(verdict(
        "otlp",
        &[
            ("the exporter's last flush went through", flushed.is_ok()),
            (
                "the collector received every handled order",
                handled == (ORDERS - 1) as i64,
            ),
            (
                "and the dead-lettered one, with its cause",
                dead_lettered == 1 && terminal == 1,
            ),
            ("a handler duration for every attempt", attempts == ORDERS),
            (
                "a lag per source, labelled by partition",
                !lag_partitions.is_empty(),
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("otlp", run())
}
