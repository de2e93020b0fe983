//! Batch handlers: one call for many messages, for bulk writes.
//!
//! [`Engine::batch_builder`](crate::Engine::batch_builder) runs a [`BatchHandler`]. Each lane
//! hands over a *run*: its key's head and the messages of the key queued behind it, up to
//! [`BatchConfig::per_key`] (and the batch's byte bound), consecutive and in order. The runs of
//! lanes that call within [`BatchConfig::max_wait`] of the first are gathered — up to
//! [`BatchConfig::max_messages`] messages or [`BatchConfig::max_bytes`] of payload — into one
//! call, each run kept whole. A run is what is queued when its lane starts: under load a key's
//! backlog goes in few calls; an idle key's message does not wait for later ones of its key.
//!
//! Every message gets its own result, and everything else stays per message: the watermark,
//! the retry budget, the duplicate check. Within a key's run, the first failure decides: the
//! messages before it are finished; a transient failure at index i retries the key from i (in
//! its lane, with backoff; the results after i are not taken, as the messages after it must not
//! count as done before it — a handler should stop applying a key's messages at its first
//! failure); a terminal failure dead-letters that message with its reason and the key goes on.
//! A batch holds no message whose key has an earlier unfinished message outside it.
//!
//! A batch call is given up as soon as one of its runs is cancelled by the engine (its source
//! revoked or lost, a stop, the stuck timeout, an attempt timeout): a cancelled message's
//! handling must end with its cancel, and one call cannot drop one message half way. The
//! batch's other messages then fail transiently and are retried in their lanes.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;
use tokio::sync::{oneshot, Notify};

use crate::config::ConfigError;
use crate::handler::{Delivery, Handler, HandlerError};

/// One result per message of a batch, in the batch's order.
pub type BatchResults = Vec<Result<(), HandlerError>>;

/// Handles many messages (of different keys) in one call. See the [module](self) docs.
#[async_trait]
pub trait BatchHandler: Send + Sync + 'static {
    /// Handles one attempt of each message of `batch`. `Ok(results)` gives each message its
    /// own result, in the batch's order (a result missing fails every message transiently);
    /// `Err(e)` fails the whole batch with `e`, as `?` does.
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError>;
}

#[async_trait]
impl<B: BatchHandler + ?Sized> BatchHandler for Arc<B> {
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
        (**self).handle_batch(batch).await
    }
}

/// A batch handler made from an async closure; see [`batch_fn`].
#[derive(Clone)]
pub struct BatchFn<F>(F);

/// Makes a batch handler from `Fn(Vec<Delivery>) -> impl Future<Output = Result<BatchResults, HandlerError>>`.
pub fn batch_fn<F, Fut>(f: F) -> BatchFn<F>
where
    F: Fn(Vec<Delivery>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<BatchResults, HandlerError>> + Send + 'static,
{
    BatchFn(f)
}

#[async_trait]
impl<F, Fut> BatchHandler for BatchFn<F>
where
    F: Fn(Vec<Delivery>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<BatchResults, HandlerError>> + Send + 'static,
{
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
        (self.0)(batch).await
    }
}

/// How batches are gathered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// The most messages in one batch (default 100).
    pub max_messages: usize,
    /// The most payload bytes in one batch (default 1 MiB); a larger message goes alone.
    pub max_bytes: usize,
    /// How long the first message of a batch waits for others (default 5 ms). A batch that
    /// fills sooner goes at once.
    pub max_wait: Duration,
    /// The most consecutive messages of one key in a batch (default 100); 1 for one message
    /// per key. At most `max_messages`.
    pub per_key: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_messages: 100,
            max_bytes: 1 << 20,
            max_wait: Duration::from_millis(5),
            per_key: 100,
        }
    }
}

impl BatchConfig {
    /// Batches of at most `max_messages`, waiting at most `max_wait` for them to fill; a key
    /// may fill a batch on its own.
    pub fn new(max_messages: usize, max_wait: Duration) -> Self {
        BatchConfig {
            max_messages,
            max_wait,
            per_key: max_messages,
            ..BatchConfig::default()
        }
    }

    /// The same, with at most `per_key` consecutive messages of one key per batch.
    pub fn per_key(mut self, per_key: usize) -> Self {
        self.per_key = per_key;
        self
    }

    /// The same, with at most `max_bytes` of payload per batch.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Rejects settings no batch can be gathered with.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_messages == 0 {
            return Err(ConfigError::invalid("batch.max_messages", "must be at least 1"));
        }
        if self.max_bytes == 0 {
            return Err(ConfigError::invalid("batch.max_bytes", "must be at least 1"));
        }
        if self.per_key == 0 || self.per_key > self.max_messages {
            return Err(ConfigError::invalid(
                "batch.per_key",
                format!("must be between 1 and max_messages ({})", self.max_messages),
            ));
        }
        Ok(())
    }
}

/// Gathers the calls of many lanes into batch calls. The engine makes one for
/// [`Engine::batch_builder`](crate::Engine::batch_builder): lanes of single messages call it as
/// their [`Handler`], lanes of a key's runs through [`Batched::call`].
pub(crate) struct Batched {
    handler: Arc<dyn BatchHandler>,
    config: BatchConfig,
    /// The batch gathering now, if any.
    open: Mutex<Option<Arc<Gathering>>>,
    /// Messages per call.
    sizes: metrics::Histogram,
}

/// A batch being gathered. Its first caller leads it: waits for it to fill, calls the batch
/// handler and hands every other caller its results.
struct Gathering {
    state: Mutex<Gathered>,
    /// Tells the leader the batch is full.
    full: Notify,
}

/// Where a caller other than the leader waits for the results of its messages.
type Reply = oneshot::Sender<BatchResults>;

#[derive(Default)]
struct Gathered {
    /// The leader's messages first, then each other caller's, each caller's together.
    deliveries: Vec<Delivery>,
    /// How many messages the leader brought.
    leader: usize,
    /// Each other caller's reply and how many messages it brought, in `deliveries`' order.
    replies: Vec<(Reply, usize)>,
    bytes: usize,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere cannot leave these half-updated: every update is a push or a take.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A caller's place in a batch.
enum Joined {
    /// Leads this batch; `open` if others may still join it (else it goes at once).
    Leads {
        gathering: Arc<Gathering>,
        open: bool,
    },
    Waits(oneshot::Receiver<BatchResults>),
}

fn bytes_of(deliveries: &[Delivery]) -> usize {
    deliveries.iter().map(|d| d.payload().len()).sum()
}

/// `count` copies of `error`, one per message.
fn failed(error: HandlerError, count: usize) -> BatchResults {
    vec![Err(error); count]
}

impl Batched {
    /// Checks `config` (naming a wrong field) and gathers for `handler`.
    pub(crate) fn new(handler: Arc<dyn BatchHandler>, config: BatchConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        crate::metrics::describe();
        Ok(Batched {
            handler,
            config,
            open: Mutex::new(None),
            sizes: metrics::histogram!(crate::metrics::BATCH_MESSAGES),
        })
    }

    /// How batches are gathered.
    pub(crate) fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// Handles `deliveries` (consecutive messages of one key, or one message) in a batch with
    /// other callers': one result per delivery, in order.
    pub(crate) async fn call(&self, deliveries: Vec<Delivery>) -> BatchResults {
        let count = deliveries.len();
        match self.join(deliveries) {
            Joined::Leads { gathering, open } => self.lead(gathering, open).await,
            Joined::Waits(results) => results.await.unwrap_or_else(|_| {
                failed(
                    HandlerError::transient(
                        "its batch was given up with the messages that led it (cancelled: revoked, stopped or stuck)",
                    ),
                    count,
                )
            }),
        }
    }

    fn join(&self, deliveries: Vec<Delivery>) -> Joined {
        let (size, count) = (bytes_of(&deliveries), deliveries.len());
        let mut open = lock(&self.open);
        if let Some(gathering) = open.as_ref() {
            let mut state = lock(&gathering.state);
            let fits = state.deliveries.len() + count <= self.config.max_messages
                && state.bytes + size <= self.config.max_bytes;
            if fits {
                let (reply, results) = oneshot::channel();
                state.deliveries.extend(deliveries);
                state.replies.push((reply, count));
                state.bytes += size;
                if state.deliveries.len() >= self.config.max_messages || state.bytes >= self.config.max_bytes
                {
                    drop(state);
                    if let Some(full) = open.take() {
                        full.full.notify_one();
                    }
                }
                return Joined::Waits(results);
            }
            // Too many or too big to join: the open batch goes as it is, these lead the next.
            drop(state);
            if let Some(full) = open.take() {
                full.full.notify_one();
            }
        }
        let gathering = Arc::new(Gathering {
            state: Mutex::new(Gathered {
                deliveries,
                leader: count,
                bytes: size,
                replies: Vec::new(),
            }),
            full: Notify::new(),
        });
        let room = count < self.config.max_messages && size < self.config.max_bytes;
        if room {
            *open = Some(gathering.clone());
        }
        Joined::Leads {
            gathering,
            open: room,
        }
    }

    /// Leads `gathering`: waits for it to fill (or `max_wait`) if it is `open`, then runs it.
    async fn lead(&self, gathering: Arc<Gathering>, open: bool) -> BatchResults {
        let mut guard = Leading {
            batched: self,
            gathering: Some(gathering.clone()),
        };
        if open && self.config.max_wait.is_zero() {
            // Let the lanes polled in the same round join.
            tokio::task::yield_now().await;
        } else if open {
            tokio::select! {
                () = gathering.full.notified() => {}
                () = tokio::time::sleep(self.config.max_wait) => {}
            }
        }
        let gathered = guard.seal();
        self.run(gathered).await
    }

    /// Calls the batch handler and hands out the results; the leader's own are returned.
    async fn run(&self, gathered: Gathered) -> BatchResults {
        let Gathered {
            deliveries,
            leader,
            replies,
            ..
        } = gathered;
        // Callers that left while the batch gathered (cancelled) are not handled.
        let mut rest = deliveries.into_iter();
        let mut kept: Vec<Delivery> = rest.by_ref().take(leader).collect();
        let mut waiting = Vec::with_capacity(replies.len());
        for (reply, count) in replies {
            let theirs: Vec<Delivery> = rest.by_ref().take(count).collect();
            if !reply.is_closed() {
                kept.extend(theirs);
                waiting.push((reply, count));
            }
        }
        let count = kept.len();
        self.sizes.record(count as f64);

        let call = AssertUnwindSafe(self.handler.handle_batch(kept)).catch_unwind();
        let results: BatchResults = tokio::select! {
            outcome = call => match outcome {
                Ok(Ok(results)) if results.len() == count => results,
                Ok(Ok(results)) => failed(
                    HandlerError::transient(format!(
                        "the batch handler returned {} results for {count} messages; it must return one per message, in order",
                        results.len()
                    )),
                    count,
                ),
                Ok(Err(error)) => failed(error, count),
                Err(panic) => {
                    let text = crate::handler::panic_text(panic.as_ref());
                    failed(HandlerError::terminal(format!("batch {text}")), count)
                }
            },
            () = any_left(&mut waiting) => {
                tracing::debug!(messages = count, "batch call given up: a message of it was cancelled");
                failed(
                    HandlerError::transient(
                        "its batch's call was given up because another message of the batch was cancelled (revoked, stopped or stuck)",
                    ),
                    count,
                )
            }
        };
        let mut results = results.into_iter();
        let own: BatchResults = results.by_ref().take(leader).collect();
        for (reply, n) in waiting {
            // A caller gone meanwhile needs no answer.
            let _ = reply.send(results.by_ref().take(n).collect());
        }
        own
    }
}

/// Ends when any caller waiting on `waiting` is gone; never if there are none.
async fn any_left(waiting: &mut [(Reply, usize)]) {
    if waiting.is_empty() {
        return std::future::pending().await;
    }
    futures_util::future::select_all(waiting.iter_mut().map(|(r, _)| Box::pin(r.closed()))).await;
}

/// The leader's hold on its batch. Dropped before sealing (the leader's lane was cancelled while
/// the batch gathered), it closes the batch: the other callers' replies are dropped, so each
/// fails transiently and is retried in its lane, instead of waiting for a leader that is gone.
struct Leading<'a> {
    batched: &'a Batched,
    gathering: Option<Arc<Gathering>>,
}

impl Leading<'_> {
    /// Takes the batch: nothing joins it any more.
    fn seal(&mut self) -> Gathered {
        let Some(gathering) = self.gathering.take() else {
            return Gathered::default();
        };
        let mut open = lock(&self.batched.open);
        if open.as_ref().is_some_and(|o| Arc::ptr_eq(o, &gathering)) {
            *open = None;
        }
        let taken = std::mem::take(&mut *lock(&gathering.state));
        taken
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        if self.gathering.is_some() {
            drop(self.seal());
        }
    }
}

#[async_trait]
impl Handler for Batched {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let mut results = self.call(vec![delivery]).await;
        results
            .pop()
            .unwrap_or_else(|| Err(HandlerError::transient("no result for the message")))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

    use bytes::Bytes;
    use tokio::task::JoinHandle;
    use tokio::time::Instant;

    use super::*;
    use crate::handler::ErrorClass;
    use crate::message::{Headers, Message, SourceId};

    fn delivery(key: &str, payload: &str) -> Delivery {
        let message = Message {
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            payload: Bytes::copy_from_slice(payload.as_bytes()),
            headers: Headers::new(),
            source: SourceId::new("t/0"),
            offset: 0,
        };
        Delivery::new(Arc::new(message), 1)
    }

    /// Records each call's payloads; answers with `answer`.
    struct Recorder<F> {
        calls: Mutex<Vec<Vec<String>>>,
        answer: F,
    }

    #[async_trait]
    impl<F> BatchHandler for Recorder<F>
    where
        F: Fn(&[Delivery]) -> Result<BatchResults, HandlerError> + Send + Sync + 'static,
    {
        async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
            let payloads = batch
                .iter()
                .map(|d| String::from_utf8_lossy(d.payload()).into_owned())
                .collect();
            lock(&self.calls).push(payloads);
            (self.answer)(&batch)
        }
    }

    fn recorder<F>(answer: F) -> Arc<Recorder<F>>
    where
        F: Fn(&[Delivery]) -> Result<BatchResults, HandlerError> + Send + Sync + 'static,
    {
        Arc::new(Recorder {
            calls: Mutex::new(Vec::new()),
            answer,
        })
    }

    fn all_ok(batch: &[Delivery]) -> Result<BatchResults, HandlerError> {
        Ok(batch.iter().map(|_| Ok(())).collect())
    }

    fn handler<B: BatchHandler>(b: B, config: BatchConfig) -> Arc<Batched> {
        Arc::new(Batched::new(Arc::new(b), config).expect("valid config"))
    }

    /// Calls `handler` for `delivery` on a task of its own, as a lane does.
    fn spawn_call(handler: &Arc<Batched>, delivery: Delivery) -> JoinHandle<Result<(), HandlerError>> {
        let h = handler.clone();
        tokio::spawn(async move { h.handle(delivery).await })
    }

    /// [`spawn_call`] for a message whose key and payload are `key`.
    fn spawn_handle(handler: &Arc<Batched>, key: &str) -> JoinHandle<Result<(), HandlerError>> {
        spawn_call(handler, delivery(key, key))
    }

    /// Calls `handler` for each of `deliveries` at once (each on its own task, like lanes).
    async fn call_all(handler: &Arc<Batched>, deliveries: Vec<Delivery>) -> Vec<Result<(), HandlerError>> {
        let tasks: Vec<_> = deliveries.into_iter().map(|d| spawn_call(handler, d)).collect();
        let mut results = Vec::new();
        for task in tasks {
            results.push(task.await.expect("call task"));
        }
        results
    }

    #[tokio::test(start_paused = true)]
    async fn calls_arriving_together_go_in_one_batch_and_a_full_batch_goes_at_once() {
        let rec = recorder(all_ok);
        let h = handler(rec.clone(), BatchConfig::new(4, Duration::from_secs(60)));
        let start = Instant::now();
        let deliveries = (0..8)
            .map(|i| delivery(&format!("k{i}"), &i.to_string()))
            .collect();
        let results = call_all(&h, deliveries).await;
        assert!(results.iter().all(|r| r.is_ok()));
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "full batches never wait out max_wait"
        );
        let calls = lock(&rec.calls).clone();
        assert_eq!(calls, vec![vec!["0", "1", "2", "3"], vec!["4", "5", "6", "7"]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_message_waits_max_wait_then_goes_alone() {
        let rec = recorder(all_ok);
        let h = handler(rec.clone(), BatchConfig::new(10, Duration::from_millis(5)));
        let start = Instant::now();
        assert!(h.handle(delivery("k", "a")).await.is_ok());
        assert_eq!(start.elapsed(), Duration::from_millis(5));
        assert_eq!(lock(&rec.calls).clone(), vec![vec!["a"]]);
        // A batch of one message never waits.
        let h = handler(rec.clone(), BatchConfig::new(1, Duration::from_secs(60)));
        let start = Instant::now();
        assert!(h.handle(delivery("k", "b")).await.is_ok());
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn payload_bytes_bound_a_batch_and_a_larger_message_goes_alone() {
        let rec = recorder(all_ok);
        let config = BatchConfig::new(100, Duration::from_millis(5)).max_bytes(10);
        let h = handler(rec.clone(), config);
        let deliveries = ["aaaa", "bbbb", "cccc", "dddddddddddd", "ee"]
            .iter()
            .enumerate()
            .map(|(i, p)| delivery(&format!("k{i}"), p))
            .collect();
        assert!(call_all(&h, deliveries).await.iter().all(|r| r.is_ok()));
        let mut calls = lock(&rec.calls).clone();
        calls.sort();
        assert_eq!(
            calls,
            vec![
                vec!["aaaa", "bbbb"],
                vec!["cccc"],
                vec!["dddddddddddd"],
                vec!["ee"]
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_joins_whole_and_gets_its_results_in_order() {
        let rec = recorder(|batch: &[Delivery]| {
            Ok(batch
                .iter()
                .map(|d| match d.payload().as_ref() {
                    b"a2" => Err(HandlerError::transient("busy")),
                    _ => Ok(()),
                })
                .collect())
        });
        let h = handler(rec.clone(), BatchConfig::new(5, Duration::from_secs(1)));
        let run = |key: &str, n: usize| -> Vec<Delivery> {
            (1..=n).map(|i| delivery(key, &format!("{key}{i}"))).collect()
        };
        let (a, b, c) = {
            let (h1, h2, h3) = (h.clone(), h.clone(), h.clone());
            let (ra, rb, rc) = (run("a", 3), run("b", 2), run("c", 2));
            let a = tokio::spawn(async move { h1.call(ra).await });
            let b = tokio::spawn(async move { h2.call(rb).await });
            // "c" does not fit in the 5 left by a and b: it leads the next batch.
            let c = tokio::spawn(async move { h3.call(rc).await });
            (a, b, c)
        };
        let a = a.await.expect("task");
        assert_eq!(a.len(), 3);
        assert!(a[0].is_ok() && a[1].is_err() && a[2].is_ok());
        assert!(b.await.expect("task").iter().all(|r| r.is_ok()));
        assert!(c.await.expect("task").iter().all(|r| r.is_ok()));
        assert_eq!(
            lock(&rec.calls).clone(),
            vec![vec!["a1", "a2", "a3", "b1", "b2"], vec!["c1", "c2"]]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn each_message_gets_its_own_result() {
        let rec = recorder(|batch: &[Delivery]| {
            Ok(batch
                .iter()
                .map(|d| match d.payload().as_ref() {
                    b"busy" => Err(HandlerError::transient("row locked")),
                    b"bad" => Err(HandlerError::terminal("constraint violated")),
                    _ => Ok(()),
                })
                .collect())
        });
        let h = handler(rec, BatchConfig::new(3, Duration::from_secs(1)));
        let results = call_all(
            &h,
            vec![delivery("a", "ok"), delivery("b", "busy"), delivery("c", "bad")],
        )
        .await;
        assert!(results[0].is_ok());
        let busy = results[1].as_ref().expect_err("transient");
        assert_eq!(
            (busy.class(), busy.message()),
            (ErrorClass::Transient, "row locked")
        );
        let bad = results[2].as_ref().expect_err("terminal");
        assert_eq!(
            (bad.class(), bad.message()),
            (ErrorClass::Terminal, "constraint violated")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_error_a_wrong_count_and_a_panic_fail_every_message() {
        let h = handler(
            recorder(|_: &[Delivery]| Err(HandlerError::transient("database down"))),
            BatchConfig::new(2, Duration::from_secs(1)),
        );
        for r in call_all(&h, vec![delivery("a", "1"), delivery("b", "2")]).await {
            assert_eq!(r.expect_err("failed").message(), "database down");
        }
        let h = handler(
            recorder(|_: &[Delivery]| Ok(vec![Ok(())])),
            BatchConfig::new(2, Duration::from_secs(1)),
        );
        for r in call_all(&h, vec![delivery("a", "1"), delivery("b", "2")]).await {
            let e = r.expect_err("a result was missing");
            assert_eq!(e.class(), ErrorClass::Transient);
            assert!(e.message().contains("returned 1 results for 2 messages"), "{e}");
        }
        let h = handler(
            recorder(|_: &[Delivery]| panic!("boom")),
            BatchConfig::new(2, Duration::from_secs(1)),
        );
        for r in call_all(&h, vec![delivery("a", "1"), delivery("b", "2")]).await {
            let e = r.expect_err("panicked");
            assert_eq!(e.class(), ErrorClass::Terminal);
            assert_eq!(e.message(), "batch handler panicked: boom");
        }
    }

    /// A batch call that never ends by itself, and says when it started and when it was dropped.
    struct Hanging {
        started: Notify,
        dropped: Arc<AtomicBool>,
    }

    struct SetOnDrop(Arc<AtomicBool>);

    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }

    #[async_trait]
    impl BatchHandler for Hanging {
        async fn handle_batch(&self, _batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
            let _guard = SetOnDrop(self.dropped.clone());
            self.started.notify_one();
            std::future::pending().await
        }
    }

    fn hanging() -> Arc<Hanging> {
        Arc::new(Hanging {
            started: Notify::new(),
            dropped: Arc::new(AtomicBool::new(false)),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn cancelling_one_message_gives_up_the_call_and_the_others_retry() {
        let hang = hanging();
        let h = handler(hang.clone(), BatchConfig::new(3, Duration::from_secs(1)));
        let tasks: Vec<_> = ["a", "b", "c"].iter().map(|k| spawn_handle(&h, k)).collect();
        hang.started.notified().await;
        assert!(!hang.dropped.load(SeqCst));
        // "b" is cancelled (its source revoked): the call ends with it, not after it.
        let mut tasks = tasks.into_iter();
        let (a, b, c) = (tasks.next(), tasks.next(), tasks.next());
        let (Some(a), Some(b), Some(c)) = (a, b, c) else {
            unreachable!("three tasks")
        };
        b.abort();
        for task in [a, c] {
            let e = task.await.expect("task").expect_err("given up");
            assert_eq!(e.class(), ErrorClass::Transient);
            assert!(e.message().contains("given up"), "{e}");
        }
        assert!(hang.dropped.load(SeqCst), "the batch call was dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_leader_frees_the_others_at_once_and_the_gone_are_left_out() {
        let rec = recorder(all_ok);
        let h = handler(rec.clone(), BatchConfig::new(10, Duration::from_secs(60)));
        let leader = spawn_handle(&h, "a");
        tokio::task::yield_now().await;
        let follower = spawn_handle(&h, "b");
        tokio::task::yield_now().await;
        let start = Instant::now();
        leader.abort();
        let e = follower.await.expect("task").expect_err("its leader is gone");
        assert_eq!(e.class(), ErrorClass::Transient);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "no wait for a leader that is gone"
        );
        assert!(lock(&rec.calls).is_empty(), "nothing was called");

        // A caller gone while its batch gathers is left out of the call.
        let leads = spawn_handle(&h, "c");
        tokio::task::yield_now().await;
        let cancelled = spawn_handle(&h, "d");
        let joins = spawn_handle(&h, "e");
        tokio::task::yield_now().await;
        cancelled.abort();
        assert!(leads.await.expect("task").is_ok());
        assert!(joins.await.expect("task").is_ok());
        assert_eq!(lock(&rec.calls).clone(), vec![vec!["c", "e"]]);
    }

    #[test]
    fn settings_no_batch_can_be_made_with_are_refused_naming_the_field() {
        let refused = |config: BatchConfig| {
            Batched::new(recorder(all_ok), config)
                .err()
                .expect("refused")
                .field()
                .to_owned()
        };
        assert_eq!(refused(BatchConfig::new(0, Duration::ZERO)), "batch.max_messages");
        assert_eq!(refused(BatchConfig::default().max_bytes(0)), "batch.max_bytes");
        assert_eq!(
            refused(BatchConfig::new(10, Duration::ZERO).per_key(11)),
            "batch.per_key"
        );
        assert_eq!(
            refused(BatchConfig::new(10, Duration::ZERO).per_key(0)),
            "batch.per_key"
        );
    }
}
