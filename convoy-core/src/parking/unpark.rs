//! An operator's unpark: a parked key goes on without its failed head. The head stays in the
//! dead-letter destination, marked as passed over by an audit record (cause `skipped`, with the
//! operator's reason); the messages set aside behind it are replayed in their order.

use bytes::Bytes;

use super::{
    format_position, idle_parking, marker, replay_key, KeyReplay, ParkedKeys, PublisherFor, ReplayError,
    DL_OF,
};
use crate::dead_letter::{DeadLetterCause, DeadLetterSink};
use crate::message::{Headers, Message};

/// What an unpark did.
#[derive(Debug)]
pub struct Unparked {
    /// The failed record passed over, as the destination holds it.
    pub skipped: Message,
    /// The replay of the messages set aside behind it, if there were any.
    pub replay: Option<KeyReplay>,
}

/// Unparks key `key` of `group` without replaying its failed head: writes the skip marker
/// (naming the head, with `reason`) to the destination through `sink`, then replays the
/// key's other records as [`replay_key`] does. With nothing else waiting, the key is unparked
/// by the marker alone; otherwise once the replay's last message is handled.
///
/// Refused while a replay of the key is under way, and for a key with no failed message
/// waiting (only set-aside ones: replay it).
pub async fn unpark_key(
    group: &str,
    key: &[u8],
    reason: &str,
    sink: &dyn DeadLetterSink,
    publisher: &PublisherFor<'_>,
) -> Result<Unparked, ReplayError> {
    let shown = String::from_utf8_lossy(key).into_owned();
    let keys = ParkedKeys::read_back(group, sink).await?;
    let parking = idle_parking(group, key, &keys)?;
    let in_order = parking.to_replay();
    // The head: the first failed record in the order a replay would publish them.
    let head = in_order.iter().find(|r| r.failed);
    let (Some(skipped), Some(stored)) = (
        head.and_then(|r| r.record.as_deref().cloned()),
        head.and_then(|r| r.stored.as_ref()),
    ) else {
        return Err(ReplayError::NothingToSkip(shown));
    };
    let others = in_order.len() - 1;
    let mut headers = Headers::new();
    headers.insert(DL_OF, format_position(stored));
    let audit = marker(
        group,
        Some(Bytes::copy_from_slice(key)),
        Some(skipped.source.clone()),
        DeadLetterCause::Skipped,
        format!(
            "unparked without replaying {} ({reason}); {others} messages behind it replayed",
            format_position(stored)
        ),
        headers,
    );
    sink.publish(&audit).await?;
    let replay = match others {
        0 => None,
        _ => Some(replay_key(group, key, sink, publisher).await?),
    };
    Ok(Unparked { skipped, replay })
}
