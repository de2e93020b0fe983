//! Emptied batch buffers, shared between who fills and who empties them: a transport's event
//! channel and the intake, the intake and the shards. The intake sends messages to a shard in
//! one vector and the shard reports completions in another; whoever empties a
//! buffer puts it here and whoever fills the next takes it, so no side grows a fresh vector per
//! batch (that growth — realloc after realloc, then freeing large blocks — was ~10 % of the
//! engine's instructions per message). One lock per batch, not per message.

use std::sync::{Arc, Mutex, MutexGuard};

/// Buffers larger than this many items are not kept: a rare burst does not pin its memory.
const MOST_ITEMS: usize = 4096;

pub(crate) struct Spares<T> {
    kept: Arc<Mutex<Vec<Vec<T>>>>,
    most: usize,
}

impl<T> Clone for Spares<T> {
    fn clone(&self) -> Self {
        Spares {
            kept: self.kept.clone(),
            most: self.most,
        }
    }
}

impl<T> Spares<T> {
    /// Keeps at most `most` buffers.
    pub fn new(most: usize) -> Self {
        Spares {
            kept: Arc::default(),
            most,
        }
    }

    fn kept(&self) -> MutexGuard<'_, Vec<Vec<T>>> {
        // Nothing panics while holding it; a poisoned list is still a valid list.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An empty buffer: a kept one if there is one.
    pub fn take(&self) -> Vec<T> {
        self.kept().pop().unwrap_or_default()
    }

    /// Keeps `buffer`, emptied, unless it has no allocation, is too large, or enough are kept.
    pub fn keep(&self, mut buffer: Vec<T>) {
        let capacity = buffer.capacity();
        if capacity == 0 || capacity > MOST_ITEMS {
            return;
        }
        buffer.clear();
        let mut kept = self.kept();
        if kept.len() < self.most {
            kept.push(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_buffers_come_back_empty_and_large_or_surplus_ones_are_dropped() {
        let spares = Spares::new(1);
        let mut a = Vec::with_capacity(8);
        a.push(1u32);
        spares.keep(a);
        spares.clone().keep(Vec::with_capacity(8)); // one is enough
        let back = spares.take();
        assert!(back.is_empty() && back.capacity() >= 8);
        assert_eq!(spares.take().capacity(), 0, "the surplus one was dropped");
        spares.keep(Vec::with_capacity(MOST_ITEMS + 1));
        assert_eq!(spares.take().capacity(), 0, "too large to keep");
    }
}
