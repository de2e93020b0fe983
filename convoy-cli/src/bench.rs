//! `convoy bench`: a scenario of convoy-bench's runner on a fresh topic of the URL's broker
//! (or on a Kafka topic filled beforehand, `--prefilled-topic`), a progress bar while it runs,
//! then the result table (or one JSON object).

use std::process::ExitCode;

use crate::bed::ConnectionBed;
use clap::ValueEnum;
use convoy::ConnectConfig;
use convoy_bench::probe::Latency;
use convoy_bench::scenario::{
    run as run_scenario, seed_load, seed_reference, seed_retry, Load, Scenario, ScenarioReport,
    SEED_HELD_RATE,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cli::{BenchArgs, ScenarioName};
use crate::out::{out, out_part};
use crate::settings::connect;

/// The scenario the arguments describe.
pub fn scenario(args: &BenchArgs) -> Result<Scenario, String> {
    let memory_bound = args.scenario == ScenarioName::MemoryBound;
    let prefilled = args.prefilled_topic.is_some();
    if prefilled && (args.scenario != ScenarioName::Custom || args.rate.is_some()) {
        return Err(
            "--prefilled-topic drains a filled topic: use it with --scenario custom, without --rate".into(),
        );
    }
    let (messages, keys, transient, load) = match args.scenario {
        ScenarioName::Seed => (50_000, 10, 0.1, Load::Live { rate: args.rate }),
        ScenarioName::SeedLoad => {
            let (messages, keys, load) = seed_load(args.rate.unwrap_or(20_000.0), args.duration)?;
            (messages, keys, 0.0, load)
        }
        ScenarioName::Custom => (
            100_000,
            1_000,
            0.0,
            match args.rate {
                Some(rate) => Load::Live { rate: Some(rate) },
                None if prefilled => Load::Prefilled,
                None => Load::Prefill,
            },
        ),
        ScenarioName::MemoryBound => (48_000, 480, 0.0, Load::Prefill),
    };
    let transient_rate = args.transient_rate.unwrap_or(transient);
    if !(0.0..=1.0).contains(&transient_rate) {
        return Err(format!(
            "--transient-rate must be between 0 and 1, got {transient_rate}"
        ));
    }
    let work_ms = args.work_ms.unwrap_or(if memory_bound { 5.0 } else { 0.0 });
    if !(0.0..=60_000.0).contains(&work_ms) {
        return Err(format!("--work-ms must be between 0 and 60000, got {work_ms}"));
    }
    let mut back_pressure = convoy::BackPressure::default();
    if memory_bound {
        back_pressure.window_high = 256;
        back_pressure.window_low = 128;
    }
    let messages = args.messages.unwrap_or(messages);
    let keys = args.keys.unwrap_or(keys);
    let partitions = args.partitions.unwrap_or(if memory_bound { 48 } else { 8 });
    if messages == 0 || keys == 0 || partitions == 0 {
        return Err(format!(
            "--messages, --keys and --partitions must each be at least 1 (got {messages}, {keys} and {partitions})"
        ));
    }
    if keys as u64 > messages {
        return Err(format!(
            "--keys {keys} is more than --messages {messages}: every key needs a message (use at most {messages} keys)"
        ));
    }
    // Refused here, naming the flag, rather than when the run starts.
    convoy_bench::KeySpread::new(keys, args.zipf).map_err(|e| format!("--zipf: {e}"))?;
    Ok(Scenario {
        name: args
            .scenario
            .to_possible_value()
            .map_or_else(|| "custom".to_owned(), |v| v.get_name().to_owned()),
        messages,
        keys,
        zipf: args.zipf,
        partitions,
        payload_bytes: args
            .payload_bytes
            .unwrap_or(if memory_bound { 16 << 10 } else { 0 }),
        hold_one_key: memory_bound,
        back_pressure,
        shards: args.shards,
        latency: Latency::work(work_ms, args.tokio_timer),
        transient_rate,
        seed: 7,
        retry: seed_retry(),
        load,
        baseline: !args.no_baseline,
        ..Scenario::default()
    })
}

/// Runs the benchmark; fails (exit 1) unless every message finished in per-key order.
///
/// `seed` runs twice: unthrottled for the throughput, then at the seed's own pace for the
/// latency (unless `--rate` already holds one), and shows the seed's figures beside both.
pub async fn run(config: &ConnectConfig, args: &BenchArgs) -> crate::outcome::CliResult {
    let scenario = scenario(args)?;
    let connection = connect(config).await?;
    let seed = args.scenario == ScenarioName::Seed;
    let mut report = run_once(&connection, args, &scenario, "").await?;
    if seed && args.rate.is_none() && report.passed() {
        let held = Scenario {
            load: Load::Live {
                rate: Some(SEED_HELD_RATE),
            },
            baseline: false,
            ..scenario.clone()
        };
        report.at_held_rate = Some(Box::new(
            run_once(&connection, args, &held, "at a held rate: ").await?,
        ));
    }
    if seed {
        report.reference = Some(seed_reference());
    }
    // A reader that closed stdout (`| head`) cuts the report, not the verdict: the exit status
    // still says whether every message finished in order.
    let _cut = if args.json {
        let line = serde_json::to_string(&report).map_err(|e| format!("cannot encode the report: {e}"))?;
        out!("{line}")
    } else {
        out_part!("{}", report.table())
    };
    let passed = report.passed() && report.at_held_rate.as_ref().is_none_or(|r| r.passed());
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One run of `scenario` on a fresh topic (or the prefilled one), with a progress bar.
async fn run_once(
    connection: &convoy::Connection,
    args: &BenchArgs,
    scenario: &Scenario,
    stage: &str,
) -> Result<ScenarioReport, String> {
    let bed = match &args.prefilled_topic {
        // A fresh group reads a Kafka topic from its start; RabbitMQ's queues belong to the
        // groups declared before publishing, and memory:// starts empty in every process.
        Some(_) if connection.endpoint().scheme != "kafka" => {
            return Err("--prefilled-topic needs a kafka:// URL".into())
        }
        Some(topic) => ConnectionBed::prefilled(connection, topic, scenario.partitions).await,
        None => ConnectionBed::new(connection, scenario.partitions).await,
    }
    .map_err(|e| e.to_string())?;
    let bar = ProgressBar::with_draw_target(Some(scenario.messages), ProgressDrawTarget::stderr());
    if args.json {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{stage}{{spinner}} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} finished ({{per_sec}})"
        ))
        .map_err(|e| e.to_string())?,
    );
    let progress = |finished: u64, _total: u64| bar.set_position(finished);
    let report = run_scenario(&bed, scenario, &progress).await;
    if let Err(e) = bed.clean_up().await {
        eprintln!("warning: cleaning up the benchmark topic failed: {e}");
    }
    bar.finish_and_clear();
    report
}
