//! An operator's pause or resume of a key or a source (see `engine::pause`).

use std::hash::BuildHasher;

use tokio::sync::oneshot;

use super::Intake;
use crate::engine::pause::{PauseRequest, PauseTarget, Paused};
use crate::engine::shard::{shard_of, ShardCommand};

impl Intake {
    pub(super) fn on_pause(&mut self, request: PauseRequest) {
        match request {
            PauseRequest::List { reply } => {
                let mut keys: Vec<_> = self.paused_keys.iter().cloned().collect();
                keys.sort();
                let mut sources: Vec<_> = self.paused_sources.iter().cloned().collect();
                sources.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                let _ = reply.send(Paused { keys, sources });
            }
            PauseRequest::Set { target, pause, reply } => match target {
                PauseTarget::Key(key) => {
                    let hash = self.shard_hasher.hash_one(&key);
                    match pause {
                        true => self.paused_keys.insert(key.clone()),
                        false => self.paused_keys.remove(&key),
                    };
                    tracing::info!(key = %String::from_utf8_lossy(&key), pause, "an operator's pause of a key");
                    // The key's shard answers once the lane is paused: after that no message of
                    // it starts (the shard takes commands in order, work routed before included).
                    let shard = shard_of(hash, self.shards.len());
                    let command = ShardCommand::PauseKey {
                        key,
                        hash,
                        pause,
                        reply,
                    };
                    // A shard gone (the engine is stopping) drops the reply: the call says so.
                    let _ = self.shards[shard].send(command);
                }
                PauseTarget::Source(source) => {
                    tracing::info!(%source, pause, "an operator's pause of a source");
                    match pause {
                        true => self.paused_sources.insert(source.clone()),
                        false => self.paused_sources.remove(&source),
                    };
                    if let (false, Some(&slot)) = (pause, self.by_id.get(&source)) {
                        self.release_unrouted(slot);
                    }
                    self.apply_flow();
                    answered(reply);
                }
            },
        }
    }
}

fn answered(reply: oneshot::Sender<()>) {
    let _ = reply.send(());
}
