//! What an operator does to dead letters besides replaying them: pass over a parked key's
//! failed head ([`unpark`]) and purge dead letters ([`purge`]). Both leave an audit record in
//! the dead-letter topic with the operator's reason; neither deletes a record (a broker's
//! retention does that, as for every dead letter).

use convoy_core::parking::{self, Unparked, DL_OF};
use convoy_core::{ConfigError, DeadLetterCause};

use super::{parked_by_group, record_marks, refused, DeadLetterRecord, Partitions};
use crate::connection::Connection;
use crate::error::ConnectError;

/// Unparks parked key `key` of `connection`'s group without replaying its failed head
/// ([`parking::unpark_key`]): an audit record names the head and `reason`, and the messages set
/// aside behind it are replayed in their order. The head stays a dead letter, marked skipped.
pub async fn unpark(connection: &Connection, key: &[u8], reason: &str) -> Result<Unparked, ConnectError> {
    let group = &connection.endpoint().group;
    let sink = connection.dead_letter_sink()?;
    let partitions = Partitions::of(connection).await?;
    let publisher = partitions.publisher_for(connection);
    parking::unpark_key(group, key, reason, &*sink, &publisher)
        .await
        .map_err(refused)
}

/// Purges `records` (from [`list`](super::list)): an audit record per 500 names them and
/// `reason`; listings leave them out from then on (unless asked for purged ones) and replays
/// never pick them. Refused, purging nothing, when one belongs to a key parked in its group: a
/// parked key's records are its history, replayed or passed over by [`unpark`].
pub async fn purge(
    connection: &Connection,
    records: &[DeadLetterRecord],
    reason: &str,
) -> Result<usize, ConnectError> {
    let by_group = parked_by_group(connection).await?;
    if let Some(parked) = records.iter().find(|r| {
        let key = r.message.key.as_ref();
        by_group
            .get(&r.group)
            .is_some_and(|keys| key.is_some_and(|k| keys.get(k).is_some()))
    }) {
        return Err(ConfigError::invalid(
            "key",
            format!(
                "{} is parked in group {}: its dead letters are purged only once it is unparked \
                 (replay it, or `dlq unpark` it to pass over its failed message); nothing was purged",
                parked.message.key_display(),
                parked.group
            ),
        )
        .into());
    }
    record_marks(connection, records, DL_OF, DeadLetterCause::Purged, |n| {
        format!("purged {n} dead letters ({reason})")
    })
    .await?;
    Ok(records.len())
}
