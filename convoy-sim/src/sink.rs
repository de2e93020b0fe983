//! The dead-letter destination under faults: publishes and read-backs that fail or hang for a
//! while, in windows the seed opens.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::{DeadLetter, DeadLetterSink, Message, TransportError};
use convoy_memory::MemoryDeadLetterSink;
use tokio::time::Instant;

use crate::shared::Shared;

/// A window of time during which a fault holds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    until: Option<Instant>,
}

impl Window {
    pub fn open_until(&mut self, until: Instant) {
        self.until = Some(self.until.map_or(until, |u| u.max(until)));
    }

    pub fn close(&mut self) {
        self.until = None;
    }

    /// The end of the window, if it holds now.
    pub fn holds(&self) -> Option<Instant> {
        self.until.filter(|&u| Instant::now() < u)
    }
}

/// The dead-letter destination's faults, shared by every member's sink.
#[derive(Default)]
pub struct SinkFaults {
    pub publish_fails: Window,
    pub publish_hangs: Window,
    pub read_back_fails: Window,
    pub read_back_hangs: Window,
}

/// A member's dead-letter sink: the memory broker's, behind the world's faults.
pub struct FaultySink {
    pub inner: MemoryDeadLetterSink,
    pub faults: Arc<Mutex<SinkFaults>>,
    /// The member, and the trace its publishes go to.
    pub member: usize,
    pub shared: Arc<Shared>,
}

impl FaultySink {
    fn faults(&self) -> std::sync::MutexGuard<'_, SinkFaults> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hangs while `window` holds, fails while `fails` holds.
    async fn pass(
        &self,
        hangs: impl Fn(&SinkFaults) -> Window,
        fails: impl Fn(&SinkFaults) -> Window,
        what: &str,
    ) -> Result<(), TransportError> {
        loop {
            let hang = hangs(&self.faults()).holds();
            match hang {
                Some(until) => tokio::time::sleep_until(until).await,
                None => break,
            }
        }
        if fails(&self.faults()).holds().is_some() {
            return Err(TransportError::Unavailable(format!(
                "simulated: the dead-letter destination refuses {what}"
            )));
        }
        Ok(())
    }
}

#[async_trait]
impl DeadLetterSink for FaultySink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.pass(|f| f.publish_hangs, |f| f.publish_fails, "publishes")
            .await?;
        self.inner.publish(dead_letter).await?;
        let m = &dead_letter.message;
        let what = crate::ledger::Identity::of(m).map_or_else(|| "a marker".to_owned(), |i| i.to_string());
        self.shared.ledger().trace.event(format_args!(
            "m{} dead-letters {what} from {}@{} ({})",
            self.member,
            m.source,
            m.offset,
            dead_letter.reason.cause.as_str()
        ));
        Ok(())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.read_back().await
    }

    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.read_back_after(mark).await
    }

    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.load_checkpoint(group, part).await
    }

    /// A checkpoint is a write: it fails (and hangs) when publishing does.
    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        self.pass(|f| f.publish_hangs, |f| f.publish_fails, "writes")
            .await?;
        self.inner.save_checkpoint(group, part, checkpoint).await?;
        self.shared.ledger().trace.event(format_args!(
            "m{} saves part {part} of a parked keys' checkpoint",
            self.member
        ));
        Ok(())
    }
}
