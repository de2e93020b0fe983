// The Parallel Consumer side of scripts/bench/parallel-consumer: drains a topic that
// `convoy produce --generate N --keys K --probes` filled (key `key-<k>`, payload the message's
// per-key sequence number, in ASCII), with Confluent Parallel Consumer in ProcessingOrder.KEY,
// and checks per-key order the way convoy-testkit's OrderChecker does: per key, a message may
// finish only after every earlier one of its key finished; a later one first is a violation,
// one seen again is a duplicate, two calls of one key at once are an overlap, and whatever
// never finished is lost.
//
// Timing is convoy bench's for a pre-filled topic: the clock runs from the first finished
// message to the one that makes all N finished (group join and JVM start are not in it).
//
// Plain javac against Parallel Consumer 0.5.3.3 and its dependencies (kafka-clients 3.9.1),
// resolved from Maven Central by scripts/bench/parallel-consumer (pom.xml beside this file).
// Prints one JSON object per run on stdout.

import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.CommitMode;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.ParallelStreamProcessor;
import io.confluent.parallelconsumer.internal.AbstractParallelEoSStreamProcessor;
import java.time.Duration;
import java.util.List;
import java.util.Properties;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.StringDeserializer;

public final class ParallelConsumerBench {

    /** Command-line settings, with the defaults the BENCHMARKS.md section states. */
    static final class Settings {
        String bootstrap = "127.0.0.1:9092";
        String topic;
        String group = "pc-bench-" + ProcessHandle.current().pid() + "-" + System.currentTimeMillis();
        long messages = 100_000;
        int keys = 1_000;
        double workMs = 0;
        int maxConcurrency = 256;
        int batchSize = 1;
        CommitMode commitMode = CommitMode.PERIODIC_CONSUMER_ASYNCHRONOUS;
        int warmups = 3;
        long fetchMaxWaitMs = -1; // the client's default
        long limitS = 600;

        static Settings parse(String[] args) {
            Settings s = new Settings();
            for (int i = 0; i < args.length; i += 2) {
                if (i + 1 >= args.length) {
                    throw new IllegalArgumentException("missing value after " + args[i]);
                }
                String v = args[i + 1];
                switch (args[i]) {
                    case "--bootstrap": s.bootstrap = v; break;
                    case "--topic": s.topic = v; break;
                    case "--group": s.group = v; break;
                    case "--messages": s.messages = Long.parseLong(v); break;
                    case "--keys": s.keys = Integer.parseInt(v); break;
                    case "--work-ms": s.workMs = Double.parseDouble(v); break;
                    case "--max-concurrency": s.maxConcurrency = Integer.parseInt(v); break;
                    case "--batch-size": s.batchSize = Integer.parseInt(v); break;
                    case "--commit-mode": s.commitMode = CommitMode.valueOf(v); break;
                    case "--warmups": s.warmups = Integer.parseInt(v); break;
                    case "--fetch-max-wait-ms": s.fetchMaxWaitMs = Long.parseLong(v); break;
                    case "--limit-s": s.limitS = Long.parseLong(v); break;
                    default: throw new IllegalArgumentException("unknown option " + args[i]);
                }
            }
            if (s.topic == null) {
                throw new IllegalArgumentException("--topic is required");
            }
            if (s.messages < 1 || s.keys < 1 || s.maxConcurrency < 1 || s.batchSize < 1 || s.workMs < 0) {
                throw new IllegalArgumentException("--messages, --keys, --max-concurrency and --batch-size must be positive");
            }
            return s;
        }
    }

    /** One key's progress: every sequence number below the frontier finished. */
    static final class KeyState {
        long frontier;
        TreeSet<Long> ahead;
    }

    /** The per-key order check and the clock of one drain. */
    static final class Checker {
        final long messages;
        final ConcurrentHashMap<String, KeyState> keys = new ConcurrentHashMap<>();
        final Set<String> active = ConcurrentHashMap.newKeySet();
        final AtomicLong finished = new AtomicLong();
        final AtomicLong violations = new AtomicLong();
        final AtomicLong duplicates = new AtomicLong();
        final AtomicLong overlaps = new AtomicLong();
        final AtomicLong malformed = new AtomicLong();
        final AtomicLong firstNanos = new AtomicLong();
        final CountDownLatch done = new CountDownLatch(1);
        volatile long lastNanos;

        Checker(long messages) {
            this.messages = messages;
        }

        void handle(ConsumerRecord<String, byte[]> record, long workNanos) throws InterruptedException {
            String key = record.key() == null ? "" : record.key();
            long seq = decodeSeq(record.value());
            if (!active.add(key)) {
                overlaps.incrementAndGet();
            }
            try {
                if (workNanos > 0) {
                    Thread.sleep(workNanos / 1_000_000, (int) (workNanos % 1_000_000));
                }
                if (seq < 0) {
                    malformed.incrementAndGet();
                    return;
                }
                finish(key, seq);
            } finally {
                active.remove(key);
            }
        }

        private void finish(String key, long seq) {
            KeyState state = keys.computeIfAbsent(key, k -> new KeyState());
            long advanced = 0;
            synchronized (state) {
                if (seq < state.frontier || (state.ahead != null && state.ahead.contains(seq))) {
                    duplicates.incrementAndGet();
                } else if (seq == state.frontier) {
                    state.frontier++;
                    advanced = 1;
                    while (state.ahead != null && state.ahead.remove(state.frontier)) {
                        state.frontier++;
                        advanced++;
                    }
                } else {
                    if (state.ahead == null) {
                        state.ahead = new TreeSet<>();
                    }
                    state.ahead.add(seq);
                    violations.incrementAndGet();
                }
            }
            if (advanced == 0) {
                return;
            }
            long now = System.nanoTime();
            firstNanos.compareAndSet(0, now);
            if (finished.addAndGet(advanced) >= messages) {
                lastNanos = now;
                done.countDown();
            }
        }

        /**
         * Messages of the load never finished: each (key, sequence number) is distinct, so the
         * distinct ones seen, whatever the keys' spread (round-robin or Zipf), count against
         * the load's size.
         */
        long lost() {
            long seen = 0;
            for (KeyState state : keys.values()) {
                synchronized (state) {
                    seen += state.frontier + (state.ahead == null ? 0 : state.ahead.size());
                }
            }
            return Math.max(0, messages - seen);
        }
    }

    /** The payload's decimal sequence number (trailing spaces allowed), or -1. */
    static long decodeSeq(byte[] payload) {
        if (payload == null) {
            return -1;
        }
        int end = payload.length;
        while (end > 0 && payload[end - 1] == ' ') {
            end--;
        }
        if (end == 0 || end > 18) {
            return -1;
        }
        long seq = 0;
        for (int i = 0; i < end; i++) {
            int digit = payload[i] - '0';
            if (digit < 0 || digit > 9) {
                return -1;
            }
            seq = seq * 10 + digit;
        }
        return seq;
    }

    static KafkaConsumer<String, byte[]> consumer(Settings s, String group) {
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, s.bootstrap);
        props.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        props.put(ConsumerConfig.CLIENT_ID_CONFIG, group);
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false"); // Parallel Consumer commits
        // The client's defaults otherwise, as convoy's side uses librdkafka's.
        if (s.fetchMaxWaitMs >= 0) {
            props.put(ConsumerConfig.FETCH_MAX_WAIT_MS_CONFIG, Long.toString(s.fetchMaxWaitMs));
        }
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        return new KafkaConsumer<>(props);
    }

    /** What one drain measured. */
    record Run(Settings s, String group, boolean warmup, boolean completed, double elapsedS, long violations,
            long overlaps, long duplicates, long malformed, long lost, String error) {

        boolean clean() {
            return completed && violations == 0 && overlaps == 0 && lost == 0 && error == null;
        }

        String json() {
            return "{\"side\":\"parallel-consumer\",\"warmup\":" + warmup
                    + ",\"group\":\"" + group + "\""
                    + ",\"messages\":" + s.messages
                    + ",\"keys\":" + s.keys
                    + ",\"work_ms\":" + s.workMs
                    + ",\"max_concurrency\":" + s.maxConcurrency
                    + ",\"batch_size\":" + s.batchSize
                    + ",\"commit_mode\":\"" + s.commitMode + "\""
                    + ",\"completed\":" + completed
                    + ",\"elapsed_s\":" + elapsedS
                    + ",\"throughput_msg_s\":" + (elapsedS > 0 ? s.messages / elapsedS : 0)
                    + ",\"order_violations\":" + violations
                    + ",\"overlaps\":" + overlaps
                    + ",\"duplicates\":" + duplicates
                    + ",\"malformed\":" + malformed
                    + ",\"lost\":" + lost
                    + (error == null ? "" : ",\"error\":\"" + error.replace("\\", "/").replace("\"", "'") + "\"")
                    + "}";
        }
    }

    /** Drains the topic once with the group `group`, from its start. */
    static Run drain(Settings s, String group, boolean warmup) throws InterruptedException {
        Checker checker = new Checker(s.messages);
        long workNanos = Math.round(s.workMs * 1_000_000);
        ParallelConsumerOptions<String, byte[]> options = ParallelConsumerOptions.<String, byte[]>builder()
                .consumer(consumer(s, group))
                .ordering(ProcessingOrder.KEY)
                .commitMode(s.commitMode)
                .maxConcurrency(s.maxConcurrency)
                .batchSize(s.batchSize)
                .build();
        ParallelStreamProcessor<String, byte[]> processor = ParallelStreamProcessor.createEosStreamProcessor(options);
        processor.subscribe(List.of(s.topic));
        // A batch (batchSize > 1) holds records of distinct keys or a key's records in order; each
        // is handled in turn, and the work is per record.
        processor.poll(context -> {
            try {
                for (ConsumerRecord<String, byte[]> record : context.getConsumerRecordsFlattened()) {
                    checker.handle(record, workNanos);
                }
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        });
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(s.limitS);
        String error = null;
        while (!checker.done.await(50, TimeUnit.MILLISECONDS)) {
            if (processor.isClosedOrFailed()) {
                Exception cause = ((AbstractParallelEoSStreamProcessor<?, ?>) processor).getFailureCause();
                error = "Parallel Consumer stopped: " + cause;
                break;
            }
            if (System.nanoTime() > deadline) {
                error = "not every message finished within " + s.limitS + " s";
                break;
            }
        }
        boolean completed = checker.finished.get() >= s.messages;
        double elapsedS = completed ? (checker.lastNanos - checker.firstNanos.get()) / 1e9 : 0;
        processor.closeDontDrainFirst(Duration.ofSeconds(30));
        return new Run(s, group, warmup, completed, elapsedS, checker.violations.get(), checker.overlaps.get(),
                checker.duplicates.get(), checker.malformed.get(), checker.lost(), error);
    }

    public static void main(String[] args) throws Exception {
        Settings s;
        try {
            s = Settings.parse(args);
        } catch (IllegalArgumentException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(2);
            return;
        }
        // Warm-up drains (reported, not compared; each with a group of its own) let the JIT
        // compile the hot paths first, as in a long-running service.
        for (int i = 0; i < s.warmups; i++) {
            System.out.println(drain(s, s.group + "-warmup-" + i, true).json());
        }
        Run run = drain(s, s.group, false);
        System.out.println(run.json());
        System.out.flush();
        // Exit explicitly: the exit status says whether the run was complete and in order.
        System.exit(run.clean() ? 0 : 1);
    }
}
