//! The engine's metrics through OpenTelemetry (`convoy::otel_metrics`): an engine on
//! `memory://` handles and dead-letters messages, and an OpenTelemetry export shows what it did.

#![cfg(feature = "opentelemetry-metrics")]
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use convoy::prelude::*;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

fn metric<'a>(export: &'a ResourceMetrics, name: &str) -> &'a Metric {
    export
        .scope_metrics()
        .flat_map(|scope| scope.metrics())
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("{name} was not exported"))
}

fn labels<'a>(attributes: impl Iterator<Item = &'a KeyValue>) -> Vec<(String, String)> {
    let mut labels: Vec<(String, String)> = attributes
        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
        .collect();
    labels.sort();
    labels
}

fn label(labels: &[(String, String)], key: &str) -> Option<String> {
    labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

#[tokio::test(start_paused = true)]
async fn an_engine_s_counts_durations_and_sources_reach_an_opentelemetry_exporter() {
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .build();
    convoy::otel_metrics::install(provider.meter("convoy")).unwrap();
    let refused = convoy::otel_metrics::install(provider.meter("convoy")).unwrap_err();
    assert!(refused.to_string().contains("installed already"), "{refused}");

    let connection = convoy::connect("memory://otel-metrics?topics=orders&partitions=2")
        .await
        .unwrap();
    let handler = handler_fn(|d: Delivery| async move {
        match d.payload_str()? {
            "refuse" => Err(HandlerError::terminal("refused")),
            _ => Ok(()),
        }
    });
    let mut config = EngineConfig::default();
    config.group = "billing".into();
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(connection.dead_letter_sink().unwrap())
        .build()
        .unwrap();
    let running = engine.start(&connection).await.unwrap();
    let publisher = connection.publisher("orders").unwrap();
    for i in 0..20 {
        let payload = if i == 7 { "refuse" } else { "ok" };
        publisher
            .publish(OutgoingMessage::new(format!("k{}", i % 5), payload))
            .await
            .unwrap();
    }
    while running.stats().finished() < 20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The sources' gauges are set on the engine's ticks: export until a tick set both.
    let export = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        exporter.reset();
        provider.force_flush().unwrap();
        let export = exporter.get_finished_metrics().unwrap().pop().expect("an export");
        let watermarks = export
            .scope_metrics()
            .flat_map(|scope| scope.metrics())
            .find(|m| m.name() == "convoy_watermark")
            .map_or(0, |m| match m.data() {
                AggregatedMetrics::F64(MetricData::Gauge(gauge)) => gauge.data_points().count(),
                _ => 0,
            });
        if watermarks == 2 {
            break export;
        }
    };
    running.stop().await.unwrap();

    let handled = metric(&export, "convoy_handled_total");
    let AggregatedMetrics::U64(MetricData::Sum(sum)) = handled.data() else {
        panic!("convoy_handled_total is a sum: {:?}", handled.data())
    };
    assert!(
        handled.description().starts_with("Messages finished"),
        "{}",
        handled.description()
    );
    let mut outcomes: Vec<(String, u64)> = sum
        .data_points()
        .map(|p| {
            let labels = labels(p.attributes());
            assert_eq!(label(&labels, "group").as_deref(), Some("billing"));
            (label(&labels, "outcome").unwrap(), p.value())
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    outcomes.sort();
    assert_eq!(
        outcomes,
        [("dead_lettered".to_owned(), 1), ("handled".to_owned(), 19)]
    );

    let causes = metric(&export, "convoy_dead_lettered_total");
    let AggregatedMetrics::U64(MetricData::Sum(sum)) = causes.data() else {
        panic!("convoy_dead_lettered_total is a sum")
    };
    let terminal: u64 = sum
        .data_points()
        .filter(|p| label(&labels(p.attributes()), "cause").as_deref() == Some("terminal"))
        .map(|p| p.value())
        .sum();
    assert_eq!(terminal, 1);
    assert!(
        sum.data_points().count() >= 5,
        "every cause is a series from the start"
    );

    let durations = metric(&export, "convoy_handler_duration_seconds");
    assert_eq!(durations.unit(), "s");
    let AggregatedMetrics::F64(MetricData::Histogram(histogram)) = durations.data() else {
        panic!("convoy_handler_duration_seconds is a histogram")
    };
    let attempts: u64 = histogram.data_points().map(|p| p.count()).sum();
    assert_eq!(
        attempts, 20,
        "one attempt per message (a terminal error is not retried)"
    );
    let point = histogram.data_points().next().unwrap();
    assert_eq!(
        point.bounds().collect::<Vec<_>>(),
        convoy::metrics::SECONDS_BUCKETS
    );

    let watermarks = metric(&export, "convoy_watermark");
    let AggregatedMetrics::F64(MetricData::Gauge(gauge)) = watermarks.data() else {
        panic!("convoy_watermark is a gauge")
    };
    let mut partitions: Vec<(String, String)> = gauge
        .data_points()
        .map(|p| {
            let labels = labels(p.attributes());
            (
                label(&labels, "topic").unwrap(),
                label(&labels, "partition").unwrap(),
            )
        })
        .collect();
    partitions.sort();
    assert_eq!(
        partitions,
        [
            ("orders".to_owned(), "0".to_owned()),
            ("orders".to_owned(), "1".to_owned())
        ],
        "a watermark per partition, labelled as on Prometheus"
    );
    let consumed = metric(&export, "convoy_consumed_total");
    let AggregatedMetrics::U64(MetricData::Sum(sum)) = consumed.data() else {
        panic!("convoy_consumed_total is a sum")
    };
    assert_eq!(sum.data_points().map(|p| p.value()).sum::<u64>(), 20);
}
