//! The engine's metrics as OpenTelemetry instruments, for an OTLP exporter (feature
//! `opentelemetry-metrics`).
//!
//! convoy records through the [`metrics`] facade; [`OtelRecorder`] is a recorder that turns
//! each metric into an instrument of an OpenTelemetry [`Meter`], so an application that
//! exports with `opentelemetry-otlp` (or any OpenTelemetry exporter) gets convoy's metrics
//! beside its own:
//!
//! ```no_run
//! # fn demo() -> Result<(), convoy::otel_metrics::InstallError> {
//! // The meter of the application's provider (`SdkMeterProvider` with an OTLP exporter), or
//! // the global one. Install it before the engine is built: its handles are registered then.
//! let meter = opentelemetry::global::meter("convoy");
//! convoy::otel_metrics::install(meter)?;
//! # Ok(()) }
//! ```
//!
//! The repository's `examples/otlp.rs` exports them over OTLP/HTTP and checks what a collector
//! receives.
//!
//! - Counters are observable counters: the hot path adds to an atomic, and the exporter reads
//!   the totals when it collects.
//! - Gauges are observable gauges read the same way. A gauge nobody has set for
//!   [`GAUGE_IDLE_AFTER`] (a source this member handed over) is no longer reported.
//! - Histograms are histograms, with [`SECONDS_BUCKETS`] for durations.
//! - Names and labels are the Prometheus ones (`convoy_handled_total{group, outcome}`), so the
//!   dashboards and alerts under `deploy/` read them after a collector's Prometheus exporter.
//!   Units are OpenTelemetry's (`s`, `By`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, SharedString, Unit,
};
use opentelemetry::metrics::{AsyncInstrumentBuilder, Meter, ObservableCounter, ObservableGauge};
use opentelemetry::KeyValue;

use crate::metrics::{BATCH_BUCKETS, BATCH_MESSAGES, GAUGE_IDLE_AFTER, SECONDS_BUCKETS};

/// Installs an [`OtelRecorder`] on `meter` as the process's metrics recorder. Call it before
/// the engine is built; a process has one recorder (an error if one is installed already).
pub fn install(meter: Meter) -> Result<(), InstallError> {
    metrics::set_global_recorder(OtelRecorder::new(meter)).map_err(|_| InstallError)
}

/// A metrics recorder was installed already: a process has one. Install this one first, or
/// compose both with `metrics-util`'s fanout.
#[derive(Debug, thiserror::Error)]
#[error("a metrics recorder is installed already (a process has one): install convoy's OpenTelemetry recorder first, or fan out to both with metrics-util")]
pub struct InstallError;

/// A [`metrics::Recorder`] that records into OpenTelemetry instruments of one [`Meter`].
pub struct OtelRecorder {
    meter: Meter,
    idle_after: Duration,
    state: Mutex<Instruments>,
}

/// Every instrument created so far, by metric name, and what `describe_*` said of each.
#[derive(Default)]
struct Instruments {
    descriptions: HashMap<String, (Option<Unit>, SharedString)>,
    counters: HashMap<String, Observed<CounterCell, ObservableCounter<u64>>>,
    gauges: HashMap<String, Observed<GaugeCell, ObservableGauge<f64>>>,
    histograms: HashMap<String, opentelemetry::metrics::Histogram<f64>>,
}

/// An observable instrument and its series (one per label set), read by its callback.
struct Observed<C, I> {
    series: Arc<Mutex<HashMap<Key, Arc<C>>>>,
    /// Kept so the callback stays registered for as long as the recorder lives.
    _instrument: I,
}

impl OtelRecorder {
    /// A recorder creating its instruments on `meter` (`provider.meter("convoy")`).
    pub fn new(meter: Meter) -> Self {
        OtelRecorder {
            meter,
            idle_after: GAUGE_IDLE_AFTER,
            state: Mutex::new(Instruments::default()),
        }
    }

    /// Stops reporting a gauge nobody has set for `idle` ([`GAUGE_IDLE_AFTER`] unless set).
    pub fn with_gauge_idle_after(mut self, idle: Duration) -> Self {
        self.idle_after = idle;
        self
    }

    fn state(&self) -> MutexGuard<'_, Instruments> {
        // The state is a set of maps that every step leaves whole: a panic elsewhere does not
        // make it wrong.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn describe(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.state()
            .descriptions
            .insert(key.as_str().to_owned(), (unit, description));
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn attributes(key: &Key) -> Vec<KeyValue> {
    key.labels()
        .map(|label| KeyValue::new(label.key().to_owned(), label.value().to_owned()))
        .collect()
}

/// OpenTelemetry's spelling of a unit (UCUM): seconds `s`, bytes `By`, counts none.
fn unit_of(unit: Option<Unit>) -> Option<&'static str> {
    match unit? {
        Unit::Count => None,
        Unit::Seconds => Some("s"),
        Unit::Milliseconds => Some("ms"),
        Unit::Microseconds => Some("us"),
        Unit::Nanoseconds => Some("ns"),
        Unit::Bytes => Some("By"),
        Unit::Percent => Some("%"),
        other => Some(other.as_canonical_label()),
    }
}

/// An observable instrument's `builder` with what `describe_*` said of its metric.
fn described<'a, I, M>(
    mut builder: AsyncInstrumentBuilder<'a, I, M>,
    said: Option<(Option<Unit>, SharedString)>,
) -> AsyncInstrumentBuilder<'a, I, M> {
    if let Some((unit, description)) = said {
        builder = builder.with_description(description.to_string());
        if let Some(unit) = unit_of(unit) {
            builder = builder.with_unit(unit);
        }
    }
    builder
}

/// The series of `key` in `series`, created on first use.
fn series_of<C: Default>(series: &Mutex<HashMap<Key, Arc<C>>>, key: &Key) -> Arc<C> {
    lock(series).entry(key.clone()).or_default().clone()
}

impl metrics::Recorder for OtelRecorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(key, unit, description);
    }

    fn register_counter(&self, key: &Key, _metadata: &Metadata<'_>) -> Counter {
        let mut state = self.state();
        let name = key.name().to_owned();
        let said = state.descriptions.get(&name).cloned();
        let observed = state.counters.entry(name.clone()).or_insert_with(|| {
            let series: Arc<Mutex<HashMap<Key, Arc<CounterCell>>>> = Arc::default();
            let read = series.clone();
            let builder = self
                .meter
                .u64_observable_counter(name)
                .with_callback(move |observer| {
                    for (key, cell) in lock(&read).iter() {
                        observer.observe(cell.total.load(Ordering::Relaxed), &attributes(key));
                    }
                });
            Observed {
                series,
                _instrument: described(builder, said).build(),
            }
        });
        Counter::from_arc(series_of(&observed.series, key))
    }

    fn register_gauge(&self, key: &Key, _metadata: &Metadata<'_>) -> Gauge {
        let mut state = self.state();
        let name = key.name().to_owned();
        let said = state.descriptions.get(&name).cloned();
        let idle_after = self.idle_after;
        let observed = state.gauges.entry(name.clone()).or_insert_with(|| {
            let series: Arc<Mutex<HashMap<Key, Arc<GaugeCell>>>> = Arc::default();
            let read = series.clone();
            let builder = self
                .meter
                .f64_observable_gauge(name)
                .with_callback(move |observer| {
                    for (key, cell) in lock(&read).iter() {
                        if let Some(value) = cell.value_if_set_within(idle_after) {
                            observer.observe(value, &attributes(key));
                        }
                    }
                });
            Observed {
                series,
                _instrument: described(builder, said).build(),
            }
        });
        Gauge::from_arc(series_of(&observed.series, key))
    }

    fn register_histogram(&self, key: &Key, _metadata: &Metadata<'_>) -> Histogram {
        let mut state = self.state();
        let name = key.name().to_owned();
        let (unit, description) = state.descriptions.get(&name).cloned().unzip();
        let histogram = state
            .histograms
            .entry(name.clone())
            .or_insert_with(|| {
                let unit = unit.flatten();
                let buckets = if unit == Some(Unit::Seconds) || name.ends_with("_seconds") {
                    Some(SECONDS_BUCKETS)
                } else if name == BATCH_MESSAGES {
                    Some(BATCH_BUCKETS)
                } else {
                    None
                };
                let mut builder = self.meter.f64_histogram(name);
                if let Some(description) = description {
                    builder = builder.with_description(description.to_string());
                }
                if let Some(unit) = unit_of(unit) {
                    builder = builder.with_unit(unit);
                }
                if let Some(buckets) = buckets {
                    builder = builder.with_boundaries(buckets.to_vec());
                }
                builder.build()
            })
            .clone();
        Histogram::from_arc(Arc::new(HistogramCell {
            histogram,
            attributes: attributes(key),
        }))
    }
}

/// One counter series: its total since the recorder began. Its attributes are made when the
/// exporter collects (a few times a minute), not per increment.
#[derive(Default)]
struct CounterCell {
    total: AtomicU64,
}

impl CounterFn for CounterCell {
    fn increment(&self, value: u64) {
        self.total.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.total.fetch_max(value, Ordering::Relaxed);
    }
}

/// One gauge series: its value (an `f64`'s bits) and when it was last set.
struct GaugeCell {
    bits: AtomicU64,
    /// Milliseconds after `born` of the last change.
    set_at_ms: AtomicU64,
    born: Instant,
}

impl Default for GaugeCell {
    fn default() -> Self {
        GaugeCell {
            bits: AtomicU64::new(0f64.to_bits()),
            set_at_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }
}

impl GaugeCell {
    fn touch(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.set_at_ms.store(ms, Ordering::Relaxed);
    }

    fn update(&self, change: impl Fn(f64) -> f64) {
        let mut current = self.bits.load(Ordering::Relaxed);
        loop {
            let next = change(f64::from_bits(current)).to_bits();
            match self
                .bits
                .compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        self.touch();
    }

    fn value_if_set_within(&self, idle: Duration) -> Option<f64> {
        let set_at = Duration::from_millis(self.set_at_ms.load(Ordering::Relaxed));
        let idle_for = self.born.elapsed().saturating_sub(set_at);
        (idle_for <= idle).then(|| f64::from_bits(self.bits.load(Ordering::Relaxed)))
    }
}

impl GaugeFn for GaugeCell {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }

    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }

    fn set(&self, value: f64) {
        self.bits.store(value.to_bits(), Ordering::Relaxed);
        self.touch();
    }
}

/// A histogram series: the shared instrument and this series' attributes, made once.
struct HistogramCell {
    histogram: opentelemetry::metrics::Histogram<f64>,
    attributes: Vec<KeyValue>,
}

impl HistogramFn for HistogramCell {
    fn record(&self, value: f64) {
        self.histogram.record(value, &self.attributes);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

    use super::*;

    /// A recorder on a provider whose exports the test reads.
    fn recorder() -> (OtelRecorder, SdkMeterProvider, InMemoryMetricExporter) {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        (OtelRecorder::new(provider.meter("convoy")), provider, exporter)
    }

    /// What an export taken now holds.
    fn exported(provider: &SdkMeterProvider, exporter: &InMemoryMetricExporter) -> ResourceMetrics {
        exporter.reset();
        provider.force_flush().unwrap();
        exporter
            .get_finished_metrics()
            .unwrap()
            .pop()
            .expect("one export")
    }

    fn metric<'a>(export: &'a ResourceMetrics, name: &str) -> &'a Metric {
        export
            .scope_metrics()
            .flat_map(|scope| scope.metrics())
            .find(|m| m.name() == name)
            .unwrap_or_else(|| panic!("{name} was not exported"))
    }

    fn label(attributes: impl Iterator<Item = impl std::borrow::Borrow<KeyValue>>, key: &str) -> String {
        attributes
            .filter(|kv| kv.borrow().key.as_str() == key)
            .map(|kv| kv.borrow().value.to_string())
            .collect()
    }

    #[test]
    fn counters_export_their_totals_per_label_set_with_their_description() {
        let (recorder, provider, exporter) = recorder();
        metrics::with_local_recorder(&recorder, || {
            metrics::describe_counter!("jobs_total", Unit::Count, "Jobs done.");
            metrics::counter!("jobs_total", "group" => "a").increment(2);
            // A second handle of the same series adds to the same total.
            metrics::counter!("jobs_total", "group" => "a").increment(3);
            metrics::counter!("jobs_total", "group" => "b").absolute(7);
            metrics::counter!("jobs_total", "group" => "b").absolute(4); // never goes back
        });
        let metrics = exported(&provider, &exporter);
        let jobs = metric(&metrics, "jobs_total");
        assert_eq!(jobs.description(), "Jobs done.");
        let AggregatedMetrics::U64(MetricData::Sum(sum)) = jobs.data() else {
            panic!("a counter is a u64 sum: {:?}", jobs.data())
        };
        assert!(sum.is_monotonic());
        let mut totals: Vec<(String, u64)> = sum
            .data_points()
            .map(|p| (label(p.attributes(), "group"), p.value()))
            .collect();
        totals.sort();
        assert_eq!(totals, [("a".to_owned(), 5), ("b".to_owned(), 7)]);
    }

    #[test]
    fn gauges_export_their_value_after_increments_decrements_and_sets() {
        let (recorder, provider, exporter) = recorder();
        metrics::with_local_recorder(&recorder, || {
            metrics::describe_gauge!("held_bytes", Unit::Bytes, "Bytes held.");
            let held = metrics::gauge!("held_bytes", "group" => "a");
            held.increment(300.0);
            held.decrement(120.0);
            metrics::gauge!("held_bytes", "group" => "a").increment(1.0);
            metrics::gauge!("held_bytes", "group" => "b").set(9.0);
        });
        let metrics = exported(&provider, &exporter);
        let held = metric(&metrics, "held_bytes");
        assert_eq!(held.unit(), "By");
        let AggregatedMetrics::F64(MetricData::Gauge(gauge)) = held.data() else {
            panic!("a gauge is an f64 gauge: {:?}", held.data())
        };
        let mut values: Vec<(String, f64)> = gauge
            .data_points()
            .map(|p| (label(p.attributes(), "group"), p.value()))
            .collect();
        values.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(values, [("a".to_owned(), 181.0), ("b".to_owned(), 9.0)]);
    }

    #[test]
    fn a_gauge_nobody_set_for_its_idle_time_is_no_longer_reported() {
        let cell = GaugeCell::default();
        cell.set(4.0);
        assert_eq!(cell.value_if_set_within(GAUGE_IDLE_AFTER), Some(4.0));
        let minute_ago = Instant::now().checked_sub(Duration::from_secs(60)).unwrap();
        let stale = GaugeCell {
            born: minute_ago,
            ..GaugeCell::default()
        };
        stale.set_at_ms.store(0, Ordering::Relaxed); // set when it was born, a minute ago
        assert_eq!(stale.value_if_set_within(GAUGE_IDLE_AFTER), None);
        stale.set(1.0);
        assert_eq!(stale.value_if_set_within(GAUGE_IDLE_AFTER), Some(1.0));
    }

    #[test]
    fn durations_are_histograms_in_seconds_with_convoys_buckets() {
        let (recorder, provider, exporter) = recorder();
        metrics::with_local_recorder(&recorder, || {
            metrics::describe_histogram!("step_seconds", Unit::Seconds, "Step duration.");
            let step = metrics::histogram!("step_seconds", "group" => "a");
            step.record(0.002);
            step.record(0.2);
            metrics::histogram!(BATCH_MESSAGES, "group" => "a").record(40.0);
        });
        let metrics = exported(&provider, &exporter);
        let step = metric(&metrics, "step_seconds");
        assert_eq!(step.unit(), "s");
        let AggregatedMetrics::F64(MetricData::Histogram(histogram)) = step.data() else {
            panic!("a histogram: {:?}", step.data())
        };
        let point = histogram.data_points().next().unwrap();
        assert_eq!(point.count(), 2);
        assert!((point.sum() - 0.202).abs() < 1e-9);
        assert_eq!(point.bounds().collect::<Vec<_>>(), SECONDS_BUCKETS);
        assert_eq!(label(point.attributes(), "group"), "a");
        let batch = metric(&metrics, BATCH_MESSAGES);
        let AggregatedMetrics::F64(MetricData::Histogram(histogram)) = batch.data() else {
            panic!("a histogram: {:?}", batch.data())
        };
        let point = histogram.data_points().next().unwrap();
        assert_eq!(point.bounds().collect::<Vec<_>>(), BATCH_BUCKETS);
    }
}
