//! One trace across the broker, in OpenTelemetry (the facade's `opentelemetry` feature): each
//! order is published inside the checkout's span, and the consumer's per-message span
//! (`convoy.message`) is that span's child — with the handler's own span under it — whichever
//! broker carried the message. The spans go to an in-memory exporter here; a service installs
//! its OTLP exporter the same way.
//!
//! Invariant: every checkout span has a `convoy.message` child in its trace, every
//! `convoy.message` span has a checkout span as its parent, and every handler span is the child
//! of a `convoy.message` span.

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;

use convoy::{Delivery, HandlerError, OutgoingMessage, RetryPolicy};
use convoy_examples::{main_of, verdict, Error, Example};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing::Instrument;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

const ORDERS: usize = 20;

async fn run() -> Result<ExitCode, Error> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    // convoy's per-message span is at DEBUG (an application's INFO logging never formats it):
    // the OpenTelemetry layer asks for it by name.
    let spans = Targets::new()
        .with_target("convoy_core", LevelFilter::DEBUG)
        .with_target("trace", LevelFilter::INFO);
    let subscriber = tracing_subscriber::registry().with(
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("convoy-example"))
            .with_filter(spans),
    );
    tracing::subscriber::set_global_default(subscriber)?;

    let example = Example::setup("trace").await?;
    for order in 0..ORDERS {
        let checkout = tracing::info_span!("checkout", order);
        let message = OutgoingMessage::new(format!("order-{order}"), format!("order {order}"));
        example.publish(vec![message]).instrument(checkout).await?;
    }
    let handler = convoy::handler_fn(|d: Delivery| async move {
        let reserve = tracing::info_span!("reserve stock", key = %d.message().key_display());
        async {
            if d.message().payload.is_empty() {
                return Err(HandlerError::malformed("an order without a body"));
            }
            Ok(())
        }
        .instrument(reserve)
        .await
    });
    let stats = example
        .run(handler, RetryPolicy::default(), ORDERS as u64)
        .await?;
    example.clean_up().await?;
    provider.force_flush()?;

    let finished = exporter.get_finished_spans()?;
    let ids = |name: &str| -> HashMap<SpanId, (TraceId, SpanId)> {
        finished
            .iter()
            .filter(|s| s.name == name)
            .map(|s| {
                (
                    s.span_context.span_id(),
                    (s.span_context.trace_id(), s.parent_span_id),
                )
            })
            .collect()
    };
    let checkouts = ids("checkout");
    let messages = ids("convoy.message");
    let handlers = ids("reserve stock");
    let children = |parents: &HashMap<SpanId, (TraceId, SpanId)>, of: &HashMap<SpanId, (TraceId, SpanId)>| {
        of.values()
            .filter(|(trace, parent)| parents.get(parent).is_some_and(|(t, _)| t == trace))
            .count()
    };
    let checkouts_followed: HashSet<SpanId> = messages
        .values()
        .filter(|(trace, parent)| checkouts.get(parent).is_some_and(|(t, _)| t == trace))
        .map(|(_, parent)| *parent)
        .collect();
    println!(
        "trace: {} orders handled; {} checkout, {} convoy.message and {} handler spans exported",
        stats.handled,
        checkouts.len(),
        messages.len(),
        handlers.len()
    );
    Ok(verdict(
        "trace",
        &[
            ("every order was handled", stats.handled == ORDERS as u64),
            (
                "every checkout span has a convoy.message child in its trace",
                checkouts.len() == ORDERS && checkouts_followed.len() == ORDERS,
            ),
            (
                "every convoy.message span is a checkout's child",
                !messages.is_empty() && children(&checkouts, &messages) == messages.len(),
            ),
            (
                "every handler span is a convoy.message span's child",
                !handlers.is_empty() && children(&messages, &handlers) == handlers.len(),
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("trace", run())
}
