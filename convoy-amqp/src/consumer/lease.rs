//! The lease of a member's connection: how long this member may still start work on the
//! partitions it holds through it.
//!
//! A partition is this member's while its connection holds the partition's exclusive lock
//! queue; the broker deletes that queue when it considers the connection dead — closed, or
//! silent for a heartbeat timeout `T` (RabbitMQ checks every `T` for anything received since
//! the previous check, so never sooner than `T` after the last frame it got). The lease is the
//! member's own bound on that, kept on convoy-core's [`LeaseTerms`] with lifetime `T` like every
//! lease convoy keeps: every `T / 5` a round trip on a channel of its own (`basic.qos`, which
//! touches no queue) proves the broker heard from the connection at or after the time it was
//! sent, and the lease is extended to that time `+ T · 2/3` — always before the broker can hand
//! a partition on. A connection error ends it at once, and so does a renewal far later than
//! due (a frozen process, a suspended host). Every partition of the
//! connection shares the lease: the engine starts no attempt of them once it ran out, whatever
//! the partition tasks still had in hand, and the member rejoins on a new connection.

use std::time::Duration;

use convoy_core::transport::clock::Tick;
use convoy_core::transport::Lease;
use convoy_core::transport::{LeaseTerms, Renewal};
use convoy_core::TransportError;
use futures_util::StreamExt;
use lapin::options::BasicQosOptions;
use lapin::{Channel, Connection, ConnectionStatus, Event};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{answered, broker};

/// The lease of one connection, kept by a task of its own until it runs out or is ended.
pub(super) struct ConnectionLease {
    lease: Lease,
    /// Why the lease ran out, once it did.
    lost: oneshot::Receiver<String>,
}

impl ConnectionLease {
    /// Starts keeping the lease of `connection` (just opened: its handshake is the first proof),
    /// counting on its negotiated heartbeat (`heartbeat_s` if none was negotiated).
    pub async fn hold(connection: &Connection, heartbeat_s: u16) -> Result<Self, TransportError> {
        let negotiated = match connection.configuration().heartbeat() {
            0 => heartbeat_s,
            n => n,
        };
        let terms = LeaseTerms::new(Duration::from_secs(u64::from(negotiated.max(1))));
        let lease = terms.lease(Instant::now());
        let channel = answered("opening the lease channel", connection.create_channel())
            .await?
            .map_err(|e| broker("opening the lease channel", e))?;
        let (tx, lost) = oneshot::channel();
        let events = connection.events_listener();
        let status = connection.status().clone();
        tokio::spawn(keep(lease.clone(), terms, channel, (events, status), tx));
        Ok(ConnectionLease { lease, lost })
    }

    /// The lease, for every assignment made on this connection.
    pub fn lease(&self) -> Lease {
        self.lease.clone()
    }

    /// Resolves with the reason once the lease ran out.
    pub async fn lost(&mut self) -> String {
        (&mut self.lost)
            .await
            .unwrap_or_else(|_| "the lease keeper ended".into())
    }
}

impl Drop for ConnectionLease {
    /// The session is over (it left, or lost the connection): the lease ends with it, and its
    /// keeper with the next tick.
    fn drop(&mut self) {
        self.lease.expire();
    }
}

/// Renews `lease` until it runs out or is ended, then says why on `lost`.
async fn keep(
    lease: Lease,
    terms: LeaseTerms,
    channel: Channel,
    (mut events, status): (impl futures_util::Stream<Item = Event> + Unpin, ConnectionStatus),
    lost: oneshot::Sender<String>,
) {
    let mut renewals = terms.renewals();
    let why = loop {
        let tick = tokio::select! {
            tick = renewals.tick() => tick,
            event = events.next() => match event {
                // Channel errors come here too (a lock refused closes only its channel).
                Some(Event::Error(e)) if !status.connected() => break format!("the connection failed: {e}"),
                Some(_) => continue,
                None => break "the connection ended".to_owned(),
            },
        };
        if !lease.is_valid() {
            break "the connection's lease was not renewed in time".to_owned();
        }
        if let Tick::Late(gap) = tick {
            break format!("renewals stalled for {gap:?} (a frozen process or a suspended host)");
        }
        match terms
            .renew(&lease, channel.basic_qos(1, BasicQosOptions::default()))
            .await
        {
            Renewal::Renewed(()) => {}
            Renewal::Refused(e) => break format!("renewing the connection's lease failed: {e}"),
            Renewal::Expired => {
                break "the broker did not answer before the connection's lease ran out".to_owned()
            }
        }
    };
    lease.expire();
    if channel.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(1), channel.close(200, "lease ended".into())).await;
    }
    let _ = lost.send(why);
}
