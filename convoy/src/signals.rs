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
/// reason to stop: a `CancellationToken`, the work being done).
pub async fn run_until_signalled_or(
    engine: EngineHandle,
    done: impl Future<Output = ()>,
) -> Result<EngineReport, EngineError> {
    let mut signals = match StopSignals::listen() {
        Ok(signals) => signals,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGINT/SIGTERM; stopping only when done");
            return engine.run_until(done).await;
        }
    };
    let stopper = engine.stopper();
    let join = engine.join();
    tokio::pin!(join, done);
    let mut done_fired = false;
    loop {
        tokio::select! {
            report = &mut join => return report,
            name = signals.next() => {
                match stopper.requests() {
                    0 => tracing::info!(signal = name, "stop requested: finishing what is in flight (again to abort)"),
                    _ => tracing::warn!(signal = name, "second stop request: aborting the drain"),
                }
                stopper.shutdown();
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
