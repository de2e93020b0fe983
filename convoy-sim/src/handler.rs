//! The simulated handler: records every call in the ledger (its start checks ownership and
//! order), then acts as the seed says — succeed, fail transiently or terminally, panic, or hang
//! until the world heals. A call that is cancelled (its future dropped) ends in the ledger too.

use std::sync::Arc;

use async_trait::async_trait;
use convoy_core::transform::{Output, Transform};
use convoy_core::{Delivery, Handler, HandlerError, OutgoingMessage};

use crate::faults::Act;
use crate::ledger::{Call, Identity};
use crate::plan::OUT;
use crate::shared::Shared;

/// The text of a panic the simulator plans (its panic hook keeps it quiet).
pub const PLANNED_PANIC: &str = "simulated handler panic";

/// One member's handler.
pub struct SimHandler {
    pub member: usize,
    pub shared: Arc<Shared>,
}

/// Ends the call in the ledger however it ends (a cancel drops it mid-call).
struct Running {
    shared: Arc<Shared>,
    call: Option<Call>,
    outcome: &'static str,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            self.shared.ledger().end(&call, self.outcome);
        }
    }
}

#[async_trait]
impl Handler for SimHandler {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        self.call(&delivery).await
    }
}

/// In a transforming world the same handler is a transform: each input it handles has one
/// output, which names the input record (`n|source@offset`), so the oracle can tell which
/// handling it came from.
#[async_trait]
impl Transform for SimHandler {
    async fn transform(&self, delivery: Delivery) -> Result<Vec<Output>, HandlerError> {
        self.call(&delivery).await?;
        let message = delivery.message();
        let payload = format!(
            "{}|{}@{}",
            String::from_utf8_lossy(&message.payload),
            message.source,
            message.offset
        );
        let out = match message.key.clone() {
            Some(key) => OutgoingMessage::new(key, payload),
            None => OutgoingMessage::keyless(payload),
        };
        Ok(vec![Output::new(OUT, out)])
    }
}

impl SimHandler {
    async fn call(&self, delivery: &Delivery) -> Result<(), HandlerError> {
        let message = delivery.message();
        let Some(identity) = Identity::of(message) else {
            self.shared.ledger().violation(format!(
                "m{} got a message the world never sent: {message:?}",
                self.member
            ));
            return Ok(());
        };
        let copy = identity.replay.as_ref().map_or(0, |(_, index)| *index);
        let act = self.shared.behaviour.act(identity.n, copy, delivery.attempt());
        let call = self
            .shared
            .ledger_now()
            .start(self.member, message, identity, delivery.attempt());
        let mut running = Running {
            shared: self.shared.clone(),
            call: Some(call),
            outcome: "cancelled",
        };
        match act {
            Act::Succeed => {}
            Act::Transient => {
                running.outcome = "transient";
                return Err(HandlerError::transient("simulated transient failure"));
            }
            Act::Terminal => {
                running.outcome = "terminal";
                return Err(HandlerError::terminal("simulated poison message"));
            }
            Act::Panic => {
                running.outcome = "panic";
                std::panic::panic_any(PLANNED_PANIC);
            }
            Act::Hang => loop {
                // Until the world heals (or the engine cancels the call).
                let healed = self.shared.behaviour.heal.notified();
                tokio::pin!(healed);
                healed.as_mut().enable();
                if self.shared.behaviour.healed() {
                    break;
                }
                healed.await;
            },
        }
        running.outcome = "ok";
        if let Some(call) = running.call.as_ref() {
            self.shared.ledger_now().succeeded(call);
        }
        Ok(())
    }
}
