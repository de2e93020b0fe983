//! The control of a member that balances partitions itself (RabbitMQ, NATS). What is the same
//! on every such broker lives here: each owned source's reader obeys a pause switch, and closing
//! asks the member to leave and waits until it has. What a commit is and how new the newest
//! offset is are the broker's: [`MemberSources`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use super::{Commit, Departure, SourceControl, TransportError};
use crate::message::{Offset, SourceId};

/// The longest a lag figure waits for the broker's answer about one source.
const NEWEST_TIMEOUT: Duration = Duration::from_secs(1);

/// What a self-balancing member's control asks of its broker adapter.
#[async_trait]
pub trait MemberSources: Send + Sync + 'static {
    /// The pause switch of `source` if the member owns it: `true` stops its reader.
    fn pause_switch(&self, source: &SourceId) -> Option<watch::Sender<bool>>;
    /// The member's leave request and answer.
    fn departure(&self) -> &Departure;
    /// Commits watermarks, as [`SourceControl::commit`].
    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError>;
    /// The newest offset of an owned source (`None` for another, or when the broker does not
    /// answer), for [`SourceControl::last_offsets`].
    async fn newest_offset(&self, source: &SourceId) -> Option<Offset>;
    /// How many messages of an owned source lie above `committed`, for
    /// [`SourceControl::backlogs`]; by default from [`newest_offset`](Self::newest_offset), as
    /// if offsets were dense.
    async fn backlog(&self, source: &SourceId, committed: Option<Offset>) -> Option<u64> {
        let newest = self.newest_offset(source).await?;
        Some(super::backlog_between(committed, newest))
    }
    /// How long a source being handed over waits for the engine to drain and commit.
    fn revoke_timeout(&self) -> Duration;
    /// As [`SourceControl::credit`].
    fn credit(&self) -> Option<u64> {
        None
    }
}

/// A [`SourceControl`] over a member's [`MemberSources`]. Dropped without
/// [`close`](SourceControl::close) (the engine crashed), it still asks the member to leave,
/// committing nothing more.
pub struct MemberControl<S: MemberSources>(Arc<S>);

impl<S: MemberSources> MemberControl<S> {
    /// The control of the member whose sources are `sources`.
    pub fn new(sources: Arc<S>) -> Self {
        MemberControl(sources)
    }

    fn switch(&self, sources: &[SourceId], paused: bool) {
        for switch in sources.iter().filter_map(|s| self.0.pause_switch(s)) {
            switch.send_replace(paused);
        }
    }
}

#[async_trait]
impl<S: MemberSources> SourceControl for MemberControl<S> {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.switch(sources, true);
        Ok(())
    }

    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.switch(sources, false);
        Ok(())
    }

    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        self.0.commit(commits).await
    }

    /// Asks the broker about one source after the other, each for at most a second: lag is
    /// reported while the broker is slow too, only without that source's figure.
    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        let mut newest = Vec::with_capacity(sources.len());
        for source in sources {
            let answer = tokio::time::timeout(NEWEST_TIMEOUT, self.0.newest_offset(source)).await;
            newest.push(answer.ok().flatten());
        }
        newest
    }

    /// As [`last_offsets`](Self::last_offsets): one source after the other, each for at most a
    /// second.
    async fn backlogs(&self, sources: &[(SourceId, Option<Offset>)]) -> Vec<Option<u64>> {
        let mut backlogs = Vec::with_capacity(sources.len());
        for (source, committed) in sources {
            let answer = tokio::time::timeout(NEWEST_TIMEOUT, self.0.backlog(source, *committed)).await;
            backlogs.push(answer.ok().flatten());
        }
        backlogs
    }

    fn revoke_timeout(&self) -> Option<Duration> {
        Some(self.0.revoke_timeout())
    }

    fn credit(&self) -> Option<u64> {
        self.0.credit()
    }

    /// Every self-balancing broker keeps what is finished above a watermark (RabbitMQ
    /// acknowledges it message by message, NATS stores it with the watermark), so a handover
    /// or a stop that leaves a gap does not hand finished messages to the next owner.
    fn wants_finished_above(&self) -> bool {
        true
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.0.departure().ask();
        self.0.departure().wait_left().await;
        Ok(())
    }
}

impl<S: MemberSources> Drop for MemberControl<S> {
    fn drop(&mut self) {
        self.0.departure().ask();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Member {
        switches: HashMap<SourceId, watch::Sender<bool>>,
        departure: Departure,
    }

    #[async_trait]
    impl MemberSources for Member {
        fn pause_switch(&self, source: &SourceId) -> Option<watch::Sender<bool>> {
            self.switches.get(source).cloned()
        }
        fn departure(&self) -> &Departure {
            &self.departure
        }
        async fn commit(&self, _: &[Commit]) -> Result<(), TransportError> {
            Ok(())
        }
        async fn newest_offset(&self, source: &SourceId) -> Option<Offset> {
            match source.topic_partition() {
                Some((_, 0)) => Some(41),
                Some((_, 2)) => std::future::pending().await,
                _ => None,
            }
        }
        fn revoke_timeout(&self) -> Duration {
            Duration::from_secs(7)
        }
    }

    fn member() -> (Arc<Member>, watch::Receiver<bool>) {
        let (tx, rx) = watch::channel(false);
        let member = Member {
            switches: HashMap::from([(SourceId::partition("t", 0), tx)]),
            departure: Departure::new(),
        };
        (Arc::new(member), rx)
    }

    #[tokio::test]
    async fn pausing_flips_the_owned_sources_switch_and_ignores_others() {
        let (member, reader) = member();
        let control = MemberControl::new(member);
        let not_owned = SourceId::partition("t", 1);
        control
            .pause(&[SourceId::partition("t", 0), not_owned.clone()])
            .unwrap();
        assert!(*reader.borrow());
        control.resume(&[SourceId::partition("t", 0)]).unwrap();
        assert!(!*reader.borrow());
        assert_eq!(control.revoke_timeout(), Some(Duration::from_secs(7)));
    }

    #[tokio::test(start_paused = true)]
    async fn newest_offsets_come_per_source_and_a_silent_broker_costs_one_figure() {
        let (member, _reader) = member();
        let control = MemberControl::new(member);
        let sources = [0, 1, 2].map(|p| SourceId::partition("t", p));
        assert_eq!(control.last_offsets(&sources).await, [Some(41), None, None]);
    }

    #[tokio::test]
    async fn close_returns_once_the_member_has_left_and_a_drop_asks_it_to_leave() {
        let (member, _reader) = member();
        let control = MemberControl::new(member.clone());
        let left = {
            let member = member.clone();
            tokio::spawn(async move {
                member.departure().asked().await;
                member.departure().left();
            })
        };
        control.close().await.unwrap();
        assert!(member.departure().is_asked());
        left.await.unwrap();

        let (member, _reader) = self::member();
        drop(MemberControl::new(member.clone()));
        assert!(
            member.departure().is_asked(),
            "a dropped control asks the member to leave"
        );
    }
}
