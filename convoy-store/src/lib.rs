//! # convoy-store
//!
//! Idempotency stores that survive a restart, behind convoy's
//! [`IdempotencyStore`](convoy_core::IdempotencyStore) trait. The in-memory store forgets every
//! finished id when its process ends, so a message redelivered after a crash or a rebalance —
//! or a dead letter replayed twice — runs again; these remember.
//! - [`redb`](mod@redb): [`RedbIdempotencyStore`], an embedded store in one file, for a
//!   single-node service (one process at a time opens the file);
//! - [`postgres`](mod@postgres) (feature `postgres`): [`PostgresIdempotencyStore`], one store
//!   for every member of a consumer group, in PostgreSQL;
//! - [`retention`]: [`Retention`], how long and how many ids a store keeps;
//! - [`key`]: an event id as the bytes a store keys it by.

pub mod key;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod redb;
pub mod retention;

#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresIdempotencyStore, SharedStoreError};
pub use self::redb::{RedbIdempotencyStore, StoreError};
pub use retention::Retention;
