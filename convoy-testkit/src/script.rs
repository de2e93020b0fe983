//! A hand-driven subscription for engine tests: the test sends the events a transport would
//! (assignments, messages, revokes with deadlines, losses, failures) and sees what the engine
//! did with them (commits, pauses, close). Its commits can be made to hang, as a broker without
//! a group coordinator does.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::transport::{event_channel, EventSender};
use convoy_core::transport::{Assignment, Commit, RevokeAck, SourceControl, SourceEvent, Subscription};
use convoy_core::{Headers, Message, Offset, SourceId, TransportError};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// What the engine did to the scripted transport.
#[derive(Default)]
struct Recorded {
    commits: Vec<Commit>,
    paused: Vec<SourceId>,
    closed: bool,
}

/// The test's end of a scripted subscription.
#[derive(Clone)]
pub struct Script {
    events: EventSender,
    recorded: Arc<Mutex<Recorded>>,
    hang_commits: Arc<AtomicBool>,
    changed: Arc<Notify>,
}

/// What a scripted transport's control reports to the engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reported {
    /// [`SourceControl::revoke_timeout`].
    pub revoke_timeout: Option<Duration>,
    /// [`SourceControl::credit`].
    pub credit: Option<u64>,
}

/// A scripted subscription and the script driving it; `revoke_timeout` is what its control
/// reports to the engine.
pub fn scripted(revoke_timeout: Option<Duration>) -> (Script, Subscription) {
    scripted_with(Reported {
        revoke_timeout,
        ..Reported::default()
    })
}

/// A scripted subscription whose control reports `reported`.
pub fn scripted_with(reported: Reported) -> (Script, Subscription) {
    let (events, rx) = event_channel(8);
    let script = Script {
        events,
        recorded: Arc::default(),
        hang_commits: Arc::default(),
        changed: Arc::default(),
    };
    let control = ScriptControl {
        script: script.clone(),
        reported,
    };
    (script, Subscription::new(rx, Box::new(control)))
}

/// A message with a key (`None`: keyless) and a payload.
pub fn message(source: &SourceId, offset: Offset, key: Option<&str>, payload: &str) -> Message {
    Message {
        key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
        headers: Headers::new(),
        source: source.clone(),
        offset,
    }
}

impl Script {
    fn recorded(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.recorded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Assigns `source` with nothing committed.
    pub fn assign(&self, source: &SourceId) {
        self.control(SourceEvent::Assigned(vec![Assignment::new(source.clone(), None)]));
    }

    /// Sends any control event.
    pub fn control(&self, event: SourceEvent) {
        if self.events.control(event).is_err() {
            tracing::debug!("the engine stopped listening to the script");
        }
    }

    /// Sends a batch of messages of one source.
    pub async fn messages(&self, source: &SourceId, messages: Vec<Message>) {
        if self.events.messages(source.clone(), messages).await.is_err() {
            tracing::debug!("the engine stopped listening to the script");
        }
    }

    /// Revokes `sources`, to be acknowledged by `deadline`; the receiver completes on the ack.
    pub fn revoke(&self, sources: &[SourceId], deadline: Instant) -> oneshot::Receiver<()> {
        let (ack, done) = RevokeAck::new();
        self.control(SourceEvent::Revoked {
            sources: sources.to_vec(),
            deadline,
            ack,
        });
        done
    }

    /// From now on commits never return (until the engine gives up on them).
    pub fn hang_commits(&self) {
        self.hang_commits.store(true, SeqCst);
    }

    /// Every commit the transport confirmed, in order.
    pub fn commits(&self) -> Vec<Commit> {
        self.recorded().commits.clone()
    }

    /// Sources the engine paused, in order (repeats included).
    pub fn paused(&self) -> Vec<SourceId> {
        self.recorded().paused.clone()
    }

    /// True once the engine closed the subscription.
    pub fn closed(&self) -> bool {
        self.recorded().closed
    }

    /// Waits until `condition` holds of what was recorded (re-checked on every change).
    pub async fn wait_for(&self, condition: impl Fn(&Script) -> bool) {
        loop {
            let changed = self.changed.notified();
            if condition(self) {
                return;
            }
            changed.await;
        }
    }
}

struct ScriptControl {
    script: Script,
    reported: Reported,
}

#[async_trait]
impl SourceControl for ScriptControl {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.script.recorded().paused.extend_from_slice(sources);
        self.script.changed.notify_waiters();
        Ok(())
    }

    fn resume(&self, _sources: &[SourceId]) -> Result<(), TransportError> {
        Ok(())
    }

    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        if self.script.hang_commits.load(SeqCst) {
            std::future::pending::<()>().await;
        }
        self.script.recorded().commits.extend_from_slice(commits);
        self.script.changed.notify_waiters();
        Ok(())
    }

    fn wants_finished_above(&self) -> bool {
        true
    }

    fn revoke_timeout(&self) -> Option<Duration> {
        self.reported.revoke_timeout
    }

    fn credit(&self) -> Option<u64> {
        self.reported.credit
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.script.recorded().closed = true;
        self.script.changed.notify_waiters();
        Ok(())
    }
}
