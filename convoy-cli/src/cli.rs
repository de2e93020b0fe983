//! The command line: global connection flags and one subcommand.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// convoy — per-key ordered message handling (the sequential convoy) over Kafka, RabbitMQ,
/// NATS JetStream or the embedded broker.
///
/// Every command talks to the broker named by --url: `memory://` (the embedded broker: zero
/// setup, lives inside this one process), `kafka://host:port`, `amqp://user:password@host:port/vhost`
/// or `nats://host:port`. Settings come from flags, then
/// CONVOY_* environment variables (CONVOY_URL, CONVOY_GROUP, CONVOY_TOPICS, CONVOY_DLQ_TOPIC,
/// CONVOY_PARTITIONS), then --config FILE (TOML with the same names); the parameters of a
/// --url count as flags. Without a group named, the group is `convoy`.
///
/// Logs go to stderr: lifecycle events of `consume` at INFO, warnings elsewhere (RUST_LOG
/// overrides), coloured only on a terminal and never with NO_COLOR set.
///
/// Start with `convoy bench`: it runs the default scenario on memory:// and prints a table.
#[derive(Parser, Debug)]
#[command(name = "convoy", version, max_term_width = 100, after_long_help = EXAMPLES)]
pub struct Cli {
    /// Broker URL, e.g. memory://, kafka://127.0.0.1:9092?group=billing&topics=ledger (any
    /// librdkafka property may be added as a parameter, e.g. &security.protocol=ssl),
    /// 'amqp://guest:guest@127.0.0.1:5672/%2f' or nats://127.0.0.1:4222.
    #[arg(long, global = true, help_heading = BROKER)]
    pub url: Option<String>,
    /// TOML file with url, group, topics, dlq_topic, partitions, [properties] and [engine]
    /// (the engine's settings, as in CONVOY_ENGINE_*).
    #[arg(long, global = true, help_heading = BROKER, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Consumer group (default: convoy).
    #[arg(long, global = true, help_heading = BROKER)]
    pub group: Option<String>,
    /// Topic to consume or publish to (repeat for several).
    #[arg(long = "topic", global = true, help_heading = BROKER, value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Dead-letter topic (default: <first topic>.dlq).
    #[arg(long, global = true, help_heading = BROKER, value_name = "TOPIC")]
    pub dlq_topic: Option<String>,
    /// Log lines as text, or as one JSON object each (for log collectors).
    #[arg(
        long,
        global = true,
        help_heading = "Logging",
        value_enum,
        default_value = "text",
        value_name = "FORMAT"
    )]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The heading of the broker connection's flags: given before or after the subcommand, they
/// show last in every subcommand's help, apart from its own options.
const BROKER: &str = "Broker connection (every command but lanes)";

const EXAMPLES: &str = "\
Examples:
  convoy bench                                              # default scenario, embedded broker
  convoy --url kafka://127.0.0.1:9092 bench --scenario seed-load --rate 20000 --duration 10
  printf 'acct-1\\t{\"cents\":500}\\n' | convoy --url kafka://127.0.0.1:9092 --topic ledger produce
  convoy --url kafka://127.0.0.1:9092 --topic ledger --group billing consume --metrics-addr 127.0.0.1:9898
  convoy --url 'amqp://guest:guest@127.0.0.1:5672/%2f' topic create ledger --partitions 8 --for-group billing
  convoy --url kafka://127.0.0.1:9092 topic list
  convoy --url kafka://127.0.0.1:9092 --topic ledger dlq list
  convoy --url kafka://127.0.0.1:9092 --topic ledger dlq replay --key acct-1 --dry-run
  convoy --url 'amqp://guest:guest@127.0.0.1:5672/%2f' --topic ledger --group billing consume
  convoy --url nats://127.0.0.1:4222 bench";

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    Text,
    /// One JSON object per event: timestamp, level, target, message and fields.
    Json,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a benchmark scenario on a fresh topic, verify per-key order for every key, and
    /// compare with a bare client draining the same topic.
    Bench(BenchArgs),
    /// Publish keyed messages: lines `KEY<TAB>PAYLOAD` from a file or stdin, or generated.
    Produce(ProduceArgs),
    /// Consume through lanes with a handler that prints source, offset, key and attempt.
    ///
    /// An offset is the message's position in its source: a Kafka offset, a RabbitMQ delivery
    /// tag (counting this consumer's deliveries), or on NATS the stream sequence, which the
    /// topic's partitions share — a partition's offsets skip the other partitions' messages,
    /// and the gaps are not missing messages.
    Consume(ConsumeArgs),
    /// Inspect and replay dead letters.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Create, list and delete topics.
    #[command(subcommand)]
    Topic(TopicCommand),
    /// The live view of a running `convoy consume --metrics-addr ADDR`: sources, watermarks,
    /// lag, held messages, the longest-running lanes (stuck keys) and the largest backlogs.
    Lanes(LanesArgs),
    /// Pause a key or a source of a running `convoy consume --metrics-addr ADDR --control`: a
    /// key's messages wait in order (the one in flight finishes), a source fetches nothing new.
    /// That consumer only, until resumed or stopped; to hold a key across the group and across
    /// restarts, park it.
    Pause(PauseArgs),
    /// Resume a key or a source paused with `convoy pause`.
    Resume(PauseArgs),
}

/// `convoy pause` and `convoy resume`.
#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("target").required(true).args(["key", "source", "list"]))]
pub struct PauseArgs {
    /// The consumer's --metrics-addr.
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: String,
    /// This key.
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// This source: `topic/partition` (a Kafka partition, a RabbitMQ partition queue, a NATS
    /// partition subject).
    #[arg(long, value_name = "TOPIC/PARTITION")]
    pub source: Option<String>,
    /// Only show what is paused.
    #[arg(long)]
    pub list: bool,
}

/// `convoy lanes`.
#[derive(Args, Debug)]
pub struct LanesArgs {
    /// The consumer's --metrics-addr.
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: String,
    /// Lanes of each kind shown.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Refresh every this many seconds (`--watch` alone: every 2 s; Ctrl-C to quit).
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<f64>,
    /// Print the endpoint's JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// The benchmark scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScenarioName {
    /// 50,000 messages over 10 keys, 10 % failing transiently once (backoff 1 ms ×2, cap
    /// 100 ms, full jitter), produced live; latency is produce → handled.
    Seed,
    /// 1,000 keys at an offered rate (--rate) for a duration (--duration): was the rate held,
    /// what is the latency tail.
    SeedLoad,
    /// Your numbers: --messages, --keys, --work-ms, --transient-rate, --payload-bytes, and
    /// --rate for a live producer (without it the topic is filled first, then drained).
    Custom,
    /// Memory bounds: 48,000 messages of 16 KiB on 48 partitions, 480 keys, 5 ms of work each,
    /// one key blocked until every other source is done, watermark windows bounded at 256:
    /// peak resident memory against the bound the back-pressure configuration implies.
    MemoryBound,
}

/// `convoy bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Which scenario.
    #[arg(long, value_enum, default_value = "seed")]
    pub scenario: ScenarioName,
    /// Messages (custom; overrides seed's 50,000).
    #[arg(long)]
    pub messages: Option<u64>,
    /// Distinct keys.
    #[arg(long)]
    pub keys: Option<usize>,
    /// Spread messages over the keys Zipf-skewed with this exponent (1.0: key-0 the hottest, a
    /// long tail) instead of round-robin: hot keys' lanes become the bottleneck, as in
    /// production. With --prefilled-topic, the topic must have been produced with the same value.
    #[arg(long, value_name = "S")]
    pub zipf: Option<f64>,
    /// Offered rate in messages per second (seed-load: default 20,000).
    #[arg(long)]
    pub rate: Option<f64>,
    /// seed-load: seconds to offer the rate for.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Partitions of the benchmark topic (memory-bound: 48).
    #[arg(long)]
    pub partitions: Option<u32>,
    /// Milliseconds of async work per message (a timer that ends on time, not CPU).
    #[arg(long)]
    pub work_ms: Option<f64>,
    /// Wait the work out on tokio's timer instead, which rounds each wait up to its next 1 ms
    /// tick (1 ms lasts 2.1–2.4 ms): how older `work` figures in BENCHMARKS.md were taken.
    #[arg(long)]
    pub tokio_timer: bool,
    /// Fraction of messages failing transiently once (retried in their lane).
    #[arg(long)]
    pub transient_rate: Option<f64>,
    /// Pad every payload to this many bytes.
    #[arg(long)]
    pub payload_bytes: Option<usize>,
    /// Engine shards (0: four per CPU).
    #[arg(long, default_value_t = 0)]
    pub shards: usize,
    /// Drain this existing Kafka topic with a fresh group instead of filling a fresh one (custom
    /// scenario, no --rate): it must hold what `convoy produce --generate N --keys K --probes`
    /// publishes, with N and K given here as --messages and --keys. Left in place afterwards.
    #[arg(long, value_name = "TOPIC")]
    pub prefilled_topic: Option<String>,
    /// Skip the bare-client baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `convoy produce`.
#[derive(Args, Debug)]
pub struct ProduceArgs {
    /// Read lines from this file instead of stdin.
    #[arg(long, value_name = "FILE", conflicts_with = "generate")]
    pub file: Option<PathBuf>,
    /// Separator between key and payload on each line.
    #[arg(long, default_value = "\t")]
    pub separator: String,
    /// Lines are payloads only; publish them without a key.
    #[arg(long)]
    pub keyless: bool,
    /// Generate this many messages instead of reading lines: payload {"key":..,"seq":..}.
    #[arg(long, value_name = "COUNT")]
    pub generate: Option<u64>,
    /// Generated messages are spread over this many keys (key-0, key-1, …).
    #[arg(long, default_value_t = 10)]
    pub keys: usize,
    /// Generate benchmark probes instead: the payload is the message's per-key sequence number,
    /// what `convoy bench --prefilled-topic` checks.
    #[arg(long, requires = "generate", conflicts_with = "headers")]
    pub probes: bool,
    /// Probes: spread them over the keys Zipf-skewed with this exponent (as `convoy bench
    /// --zipf`) instead of round-robin.
    #[arg(long, value_name = "S", requires = "probes")]
    pub zipf: Option<f64>,
    /// Header added to every message, NAME=VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE", value_parser = parse_pair)]
    pub headers: Vec<(String, String)>,
    /// Skip lines that are not KEY<separator>PAYLOAD (or whose payload does not decode), naming
    /// each on stderr, instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// How each line's payload is written: as the text itself, or binary as base64 or hex.
    #[arg(long, value_enum, default_value_t = PayloadEncoding::Text)]
    pub payload_encoding: PayloadEncoding,
}

/// How a line's payload is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PayloadEncoding {
    /// The text as it is (UTF-8).
    Text,
    /// Standard base64 (with or without padding).
    Base64,
    /// Hexadecimal digits, two per byte.
    Hex,
}

/// `convoy topic …`.
#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Create a topic (unless it exists): its partitions, the consumer groups to receive it
    /// (RabbitMQ: a group receives only what is published once its queues exist), replication.
    Create {
        /// The topic.
        name: String,
        /// Partitions: every member and publisher of the topic must use the same count.
        #[arg(long, default_value_t = 8)]
        partitions: u32,
        /// A consumer group to declare (repeatable; RabbitMQ — Kafka and NATS groups read the
        /// whole log anyway).
        #[arg(long = "for-group", value_name = "GROUP")]
        groups: Vec<String>,
        /// Copies of each partition (Kafka's replication factor, NATS's replicas).
        #[arg(long)]
        replication: Option<u16>,
    },
    /// List the topics, their partitions and (RabbitMQ) the groups receiving each.
    List {
        /// One JSON object per topic.
        #[arg(long)]
        json: bool,
    },
    /// Delete a topic and every message in it (RabbitMQ: with every group's queues of it).
    Delete {
        /// The topic.
        name: String,
        /// A group whose state goes too (repeatable; NATS: its watermark and lease buckets).
        #[arg(long = "for-group", value_name = "GROUP")]
        groups: Vec<String>,
    },
}

/// `convoy consume`.
#[derive(Args, Debug)]
pub struct ConsumeArgs {
    /// Create the topics if they do not exist (with the connection's partitions, 8 unless
    /// set): without it, a topic that does not exist is an error, so that a typo creates nothing.
    #[arg(long)]
    pub create: bool,
    /// Handle exactly this many messages (the first ones each partition holds past its
    /// committed position), commit them, and stop: nothing after them is handled or committed.
    #[arg(long, value_name = "COUNT")]
    pub max_messages: Option<u64>,
    /// What a stop (SIGINT, SIGTERM, the end of --max-messages) waits for: the messages being
    /// handled, leaving what is queued to the next consumer (the default), or everything
    /// already fetched.
    #[arg(long, value_enum)]
    pub drain: Option<DrainArg>,
    /// The longest a stop may take, drain, final commit and leaving the group together
    /// (seconds; by default 25, which fits Kubernetes' 30 s grace period).
    #[arg(long, value_name = "SECONDS")]
    pub shutdown_timeout_s: Option<u64>,
    /// Serve Prometheus metrics on this address, e.g. 127.0.0.1:9898 or localhost:9898
    /// (GET /metrics).
    #[arg(long, value_name = "HOST:PORT", value_parser = socket_addr)]
    pub metrics_addr: Option<SocketAddr>,
    /// Also take `convoy pause` and `convoy resume` on --metrics-addr (POST /pause, /resume):
    /// whoever reaches that address can pause keys, so keep it on 127.0.0.1 or a private network.
    #[arg(long, requires = "metrics_addr")]
    pub control: bool,
    /// Do not print each message.
    #[arg(long)]
    pub quiet: bool,
    /// How each printed payload is written: text (its first 120 characters, control
    /// characters escaped), or the whole payload in base64 or hex — what `produce
    /// --payload-encoding` reads back.
    #[arg(long, value_enum, default_value_t = PayloadEncoding::Text)]
    pub payload_encoding: PayloadEncoding,
    /// Commit the watermarks at least this often (milliseconds; by default 500).
    #[arg(long, value_name = "MS")]
    pub commit_interval_ms: Option<u64>,
    /// Each message takes this many milliseconds of (async) work before it is printed: to watch
    /// lanes, back-pressure and drains at work.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub work_ms: u64,
    /// A message whose payload contains this text fails with a terminal error (it is
    /// dead-lettered): to try dead letters, parked keys and replays.
    #[arg(long, value_name = "TEXT")]
    pub fail_on: Option<String>,
    /// This fraction of probe messages (payload: the key's sequence number, as `produce
    /// --probes` and the interop producers write) fails transiently on its first attempt and is
    /// retried in its lane: for soaks and demos. Which ones is a function of --fault-seed, key
    /// and sequence number, so a verifier can recompute it.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = fraction)]
    pub transient_rate: f64,
    /// This fraction of probe messages fails terminally (dead-lettered), chosen the same way;
    /// a replayed one (`convoy dlq replay`) does not, as though its cause had been fixed
    /// before the replay.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = fraction)]
    pub terminal_rate: f64,
    /// The seed of --transient-rate's and --terminal-rate's choices.
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub fault_seed: u64,
    /// Park a key whose message is dead-lettered: its later messages are set aside until
    /// `convoy dlq replay --key` (the same as `park_keys = true` in `[engine]`).
    #[arg(long)]
    pub park_keys: bool,
    /// Forward every handled message (key, payload, headers; its event id derived from the
    /// input's) to this topic. On Kafka with `transactional_id` in the URL (or config) the
    /// copies and the commit that covers their inputs go into one transaction: exactly once
    /// for `read_committed` readers. Elsewhere: at least once, deduplicated by event id.
    #[arg(long, value_name = "TOPIC")]
    pub forward_to: Option<String>,
}

/// What a stop drains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DrainArg {
    /// The messages being handled; what is queued goes to the next consumer.
    InFlight,
    /// Everything fetched (bounded by the shutdown timeout).
    Buffered,
}

/// `convoy dlq …`.
#[derive(Subcommand, Debug)]
pub enum DlqCommand {
    /// Show dead letters with their reasons, then the group's parked keys.
    List {
        /// Which ones.
        #[command(flatten)]
        selection: SelectionArgs,
        /// One JSON object per dead letter.
        #[arg(long)]
        json: bool,
        /// Purged dead letters too.
        #[arg(long)]
        purged: bool,
    },
    /// Publish selected dead letters again to the topic they came from, with their original
    /// key and headers, so they are handled after the cause is fixed. A parked key named with
    /// --key is replayed whole (its failed and set-aside messages, in order) and unparked once
    /// they are handled; other selections leave parked keys' messages alone. Dead letters
    /// replayed before are skipped (`dlq list` marks them) unless --force.
    Replay {
        /// Which ones (at least one condition, or --all).
        #[command(flatten)]
        selection: SelectionArgs,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
        /// Publish to this topic instead of each message's original one.
        #[arg(long, value_name = "TOPIC")]
        to: Option<String>,
        /// Show what would be replayed, publish nothing.
        #[arg(long)]
        dry_run: bool,
        /// Publish again the replay of the parked --key that is under way (its publishing
        /// stopped part-way), instead of starting one.
        #[arg(long, requires = "keys")]
        resume: bool,
        /// Replay dead letters that were replayed before, or passed over by `dlq unpark`, too
        /// (their messages run again).
        #[arg(long)]
        force: bool,
    },
    /// Unpark a parked key without replaying its failed message: an audit record in the
    /// dead-letter topic names the message passed over and why; the messages set aside behind
    /// it are replayed in order. The failed message stays a dead letter, marked skipped.
    Unpark {
        /// The parked key.
        #[arg(long, value_name = "KEY")]
        key: String,
        /// Why (kept in the audit record), e.g. "corrected by hand in the ledger, ticket 4711".
        #[arg(long, value_name = "TEXT")]
        note: String,
    },
    /// Purge dead letters: an audit record names them and why, and listings and replays leave
    /// them out from then on (the broker's retention deletes them, as every dead letter). A
    /// parked key's dead letters are refused: replay or unpark the key first.
    Purge {
        /// Which ones (at least one condition, or --all).
        #[command(flatten)]
        selection: SelectionArgs,
        /// Purge every dead letter.
        #[arg(long)]
        all: bool,
        /// Why (kept in the audit record).
        #[arg(long, value_name = "TEXT")]
        note: String,
        /// Show what would be purged, write nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Dead-letter selection; conditions combine.
#[derive(Args, Debug, Default)]
pub struct SelectionArgs {
    /// Only this key (repeatable).
    #[arg(long = "key", value_name = "KEY")]
    pub keys: Vec<String>,
    /// Only dead letters whose cause, error class or error contains this text.
    #[arg(long)]
    pub reason: Option<String>,
    /// Only these offsets of the dead-letter topic: A..B (inclusive) or one offset.
    #[arg(long, value_name = "A..B", value_parser = convoy::dlq::parse_offsets)]
    pub offsets: Option<std::ops::RangeInclusive<u64>>,
    /// Only dead letters dead-lettered longer ago than this (e.g. 30d, 12h).
    #[arg(long, value_name = "AGE")]
    pub older_than: Option<humantime::Duration>,
}

impl SelectionArgs {
    /// True when no condition was given.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.reason.is_none() && self.offsets.is_none() && self.older_than.is_none()
    }
}

fn parse_pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected NAME=VALUE, got {text:?}"))
}

/// `HOST:PORT` (a name such as `localhost` is looked up): the first address it names.
/// A fraction between 0 and 1.
fn fraction(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "{text:?} is not a fraction: give a number from 0 to 1, e.g. 0.01"
        )),
    }
}

fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let text = text.trim();
    let text = text.strip_prefix("http://").unwrap_or(text).trim_end_matches('/');
    text.to_socket_addrs()
        .map_err(|e| format!("{e}: give HOST:PORT, e.g. 127.0.0.1:9898"))?
        .next()
        .ok_or_else(|| format!("{text} names no address: give HOST:PORT, e.g. 127.0.0.1:9898"))
}
