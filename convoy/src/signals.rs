//! Stopping on the process's signals: SIGINT (Ctrl-C) and SIGTERM (what `docker stop`,
//! Kubernetes and systemd send) both ask for a graceful stop; a second one aborts the drain.

use std::future::Future;

use convoy_core::{EngineError, EngineHandle, EngineReport};

/// The process's stop requests, listened for from the moment this is made: a signal arriving
/// between two waits is not lost (a listener made afresh per wait misses it, and once one was
/// registered the signal no longer ends the process by itself).
pub struct StopSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(not(unix))]
    ctrl_c: tokio::signal::windows::CtrlC,
}

impl StopSignals {
    /// Starts listening for SIGINT and SIGTERM (Ctrl-C elsewhere).
    pub fn listen() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(StopSignals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(StopSignals {
                ctrl_c: tokio::signal::windows::ctrl_c()?,
            })
        }
    }

    /// The next stop request (at once if one arrived since the last): its signal's name.
    pub async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        let which = tokio::select! {
            Some(()) = self.interrupt.recv() => Some("SIGINT"),
            Some(()) = self.terminate.recv() => Some("SIGTERM"),
            else => None,
        };
        #[cfg(not(unix))]
        let which = self.ctrl_c.recv().await.map(|()| "Ctrl-C");
        match which {
            Some(name) => name,
            // The runtime's signal driver is gone: no signal can come any more.
            None => std::future::pending().await,
        }
    }
}

/// Completes at the process's first SIGINT or SIGTERM: give it to
/// [`EngineHandle::run_until`]. (Use [`run_until_signalled`] to also abort the drain on a
/// second signal.)
pub async fn shutdown_signal() -> std::io::Result<()> {
    StopSignals::listen()?.next().await;
    Ok(())
}

/// Runs `engine` until SIGINT or SIGTERM (or until it ends by itself), then stops it
/// gracefully — the drain bounded by its shutdown timeout — and aborts the drain on a second
/// signal. Returns the engine's report.
pub async fn run_until_signalled(engine: EngineHandle) -> Result<EngineReport, EngineError> {
    run_until_signalled_or(engine, std::future::pending()).await
}

/// As [`run_until_signalled`], also stopping when `done` completes (the application's own
/// reason to stop: a `CancellationToken`, the work being done). The first *signal* asks for a
/// graceful stop (nothing more if `done` asked already); only a second signal aborts the drain.
pub async fn run_until_signalled_or(
    engine: EngineHandle,
    done: impl Future<Output = ()>,
) -> Result<EngineReport, EngineError> {
    match StopSignals::listen() {
        Ok(signals) => drive(engine, signals, done).await,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGINT/SIGTERM; stopping only when done");
            engine.run_until(done).await
        }
    }
}

/// Where stop requests come from (the process's signals; a test's channel).
trait StopRequests {
    /// The next request's name.
    async fn next(&mut self) -> &'static str;
}

impl StopRequests for StopSignals {
    async fn next(&mut self) -> &'static str {
        StopSignals::next(self).await
    }
}

async fn drive(
    engine: EngineHandle,
    mut signals: impl StopRequests,
    done: impl Future<Output = ()>,
) -> Result<EngineReport, EngineError> {
    let stopper = engine.stopper();
    let join = engine.join();
    tokio::pin!(join, done);
    let mut done_fired = false;
    let mut signalled = 0u32;
    loop {
        tokio::select! {
            report = &mut join => return report,
            name = signals.next() => {
                signalled += 1;
                if signalled == 1 {
                    tracing::info!(signal = name, "stop requested: finishing what is in flight (again to abort)");
                    if stopper.requests() == 0 {
                        stopper.shutdown();
                    }
                } else {
                    tracing::warn!(signal = name, "second stop signal: aborting the drain");
                    // The application's own stop counts as the first request, never as the second.
                    while stopper.requests() < 2 {
                        stopper.shutdown();
                    }
                }
            }
            () = &mut done, if !done_fired => {
                done_fired = true;
                if stopper.requests() == 0 {
                    stopper.shutdown();
                }
            }
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::time::Duration;

    use convoy_core::{handler_fn, Delivery, Engine, EngineConfig, HandlerError, OutgoingMessage};
    use convoy_memory::{MemoryBroker, MemoryDeadLetterSink, MemoryTransport};
    use tokio::sync::mpsc;

    use super::*;

    /// Stop requests a test sends.
    struct Requests(mpsc::UnboundedReceiver<&'static str>);

    impl StopRequests for Requests {
        async fn next(&mut self) -> &'static str {
            match self.0.recv().await {
                Some(name) => name,
                None => std::future::pending().await,
            }
        }
    }

    /// An engine whose one message takes `work` to handle, already handling it.
    async fn busy_engine(work: Duration) -> EngineHandle {
        let broker = MemoryBroker::new();
        broker.create_topic("t", 1);
        let handler = handler_fn(move |_: Delivery| async move {
            tokio::time::sleep(work).await;
            Ok::<(), HandlerError>(())
        });
        let mut config = EngineConfig::for_group("g");
        config.drain_timeout = Duration::from_secs(30);
        config.shutdown_timeout = Duration::from_secs(50);
        let engine = Engine::builder(handler)
            .config(config)
            .dead_letter_sink(MemoryDeadLetterSink::new(&broker, "t.dlq"))
            .build()
            .expect("a valid configuration");
        broker.set_faults(|f| f.rebalance_timeout = Duration::from_secs(60));
        let running = engine
            .start(&MemoryTransport::new(&broker, "g", &["t"]))
            .await
            .expect("started");
        broker
            .publish("t", OutgoingMessage::new("k", "v"))
            .expect("published");
        while running.stats().held == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        running
    }

    /// Fails before the fix: the application's stop and then the first SIGTERM (a pod being
    /// stopped) counted as two requests, and the drain was aborted: the message in flight was
    /// cancelled instead of finishing.
    #[tokio::test(start_paused = true)]
    async fn the_first_signal_after_the_applications_stop_does_not_abort_the_drain() {
        let running = busy_engine(Duration::from_secs(5)).await;
        let (send, requests) = mpsc::unbounded_channel();
        let report = tokio::spawn(drive(running, Requests(requests), async {}));
        tokio::time::sleep(Duration::from_millis(10)).await;
        send.send("SIGTERM").expect("the driver listens");
        let report = report.await.expect("joined").expect("a clean stop");
        assert_eq!(report.cancelled, 0, "the drain finished the message in flight");
        assert_eq!(report.stats.handled, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_signal_aborts_the_drain() {
        let running = busy_engine(Duration::from_secs(20)).await;
        let (send, requests) = mpsc::unbounded_channel();
        let report = tokio::spawn(drive(running, Requests(requests), std::future::pending()));
        send.send("SIGTERM").expect("the driver listens");
        tokio::time::sleep(Duration::from_millis(10)).await;
        send.send("SIGINT").expect("the driver listens");
        let report = report.await.expect("joined").expect("a clean stop");
        assert_eq!(report.cancelled, 1, "the drain was aborted");
        assert_eq!(report.stats.handled, 0);
    }
}
