//! The names of the headers convoy writes, in one place: a leaf every layer may name (messages
//! recognise them, dead letters and parked keys write them, tracing reads one). Each is also
//! exported beside what it belongs to (e.g. [`crate::dead_letter::DL_CAUSE`]).

// Identity.

/// Header carrying a stable event id; when absent the id is derived from source and offset.
pub const EVENT_ID_HEADER: &str = "convoy-event-id";

// Tracing.

/// The header name defined by W3C Trace Context.
pub const TRACEPARENT: &str = "traceparent";

// A dead letter's reason ([`crate::dead_letter`]).

/// Header: why the message was dead-lettered (see [`DeadLetterCause`](crate::dead_letter::DeadLetterCause)).
pub const DL_CAUSE: &str = "convoy-dl-cause";

/// Header: the handler's error class (`transient`, `terminal`, `malformed`, `panic`, `stuck`).
pub const DL_ERROR_CLASS: &str = "convoy-dl-error-class";

/// Header: the last error's text.
pub const DL_ERROR: &str = "convoy-dl-error";

/// Header: how many attempts were made.
pub const DL_ATTEMPTS: &str = "convoy-dl-attempts";

/// Header: first failure, milliseconds since the Unix epoch.
pub const DL_FIRST_FAILURE_MS: &str = "convoy-dl-first-failure-ms";

/// Header: last failure, milliseconds since the Unix epoch.
pub const DL_LAST_FAILURE_MS: &str = "convoy-dl-last-failure-ms";

/// Header: the source the message was read from.
pub const DL_SOURCE: &str = "convoy-dl-source";

/// Header: its offset there.
pub const DL_OFFSET: &str = "convoy-dl-offset";

/// Header: the consumer group that gave up on it.
pub const DL_GROUP: &str = "convoy-dl-group";

/// Header on a replayed message: the dead letter it came from (`source@offset`).
pub const REPLAYED_FROM: &str = "convoy-replayed-from";

// Parked keys and their replays ([`crate::parking`]).

/// Header on a dead letter that parked its key (value `key`).
pub const DL_PARKS: &str = "convoy-dl-parks";

/// Header on a replayed message, `<replay id> <index>/<count>` (index from 1); on a replay
/// marker, `<replay id> 0/<count>`.
pub const REPLAY: &str = "convoy-replay";

/// Header on a replay marker: where the destination holds the records it re-publishes
/// (`source@offset`, comma-separated), in order.
pub const REPLAY_OF: &str = "convoy-replay-of";

/// Header on a replay marker written in several records (a key with more records than one
/// header holds): this record's place, `<part>/<parts>` (from 1); the replay starts once its
/// last part is read, each part naming the next of its records in [`REPLAY_OF`].
pub const REPLAY_OF_PART: &str = "convoy-replay-of-part";

/// Header on a skip marker (a parked key's failed head passed over by `unpark`) or a purge
/// marker: where the destination holds the records it concerns (`source@offset`,
/// comma-separated).
pub const DL_OF: &str = "convoy-dl-of";

/// Header on a record of a parked key: what its message is known by (its event id, or
/// `source@offset` where offsets are positions); absent when nothing identifies it.
pub const DL_PARK_ID: &str = "convoy-dl-park-id";

/// Header on a replay-done marker: the topic whose part of the replay ended (a key's messages
/// on several topics are replayed to each, and each topic's copies end in their own order).
pub const REPLAY_PART: &str = "convoy-replay-part";
