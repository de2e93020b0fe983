//! A group's parked keys' checkpoint of a dead-letter stream (see `convoy_core::parking`): the
//! latest is kept in a durable classic queue of length one, where a newer one drops the older
//! from the head, and read with a get that hands it back. A reader that finds the queue empty
//! asks again for a moment: a save never empties it, so another reader holds the checkpoint
//! between its get and its hand-back (members read back at once on a rebalance), or a first
//! save is between its declare and its publish. Only then does it read the stream from its
//! start (slower, still right).

use std::time::Duration;

use bytes::Bytes;
use convoy_core::TransportError;
use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::config::AmqpConfig;
use crate::connect::{close, connect};
use crate::error::{answered, broker};
use crate::topology;

/// The queue keeping part `part` of `group`'s checkpoint of the dead-letter stream `stream`
/// (the part in the prefix: no group's name makes another's part).
pub fn queue(stream: &str, group: &str, part: u32) -> String {
    match part {
        0 => format!("convoy.parking.{stream}.{group}"),
        n => format!("convoy.parking-{n}.{stream}.{group}"),
    }
}

/// Saves `checkpoint` as the latest in `queue`, confirmed.
pub async fn save(config: &AmqpConfig, queue: &str, checkpoint: &[u8]) -> Result<(), TransportError> {
    let connection = connect(config, "checkpoint").await?;
    let result = async {
        let channel = channel(&connection).await?;
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(1));
        answered(
            format!("declaring {queue}"),
            channel.queue_declare(queue.into(), QueueDeclareOptions::durable(), args),
        )
        .await?
        .map_err(|e| broker(&format!("declaring {queue}"), e))?;
        topology::publish_confirmed(&channel, queue, checkpoint, "saving a checkpoint").await
    }
    .await;
    close(&connection, "done").await;
    result
}

/// The latest checkpoint in `queue`, if any (left in it).
pub async fn load(config: &AmqpConfig, queue: &str) -> Result<Option<Bytes>, TransportError> {
    let connection = connect(config, "checkpoint").await?;
    let result = async {
        if !topology::exists(&connection, false, queue).await? {
            return Ok(None);
        }
        let channel = channel(&connection).await?;
        let mut asked = 0;
        let got = loop {
            let got = answered(
                format!("reading {queue}"),
                channel.basic_get(queue.into(), BasicGetOptions { no_ack: false }),
            )
            .await?
            .map_err(|e| broker(&format!("reading {queue}"), e))?;
            match got {
                Some(got) => break got,
                None if asked < HELD_ASKS => {
                    asked += 1;
                    tokio::time::sleep(HELD_PAUSE * asked).await;
                }
                None => return Ok(None),
            }
        };
        let checkpoint = Bytes::from(got.delivery.data.clone());
        answered(
            format!("handing back {queue}'s checkpoint"),
            channel.basic_reject(got.delivery.delivery_tag, BasicRejectOptions { requeue: true }),
        )
        .await?
        .map_err(|e| broker(&format!("handing back {queue}'s checkpoint"), e))?;
        Ok(Some(checkpoint))
    }
    .await;
    close(&connection, "done").await;
    result
}

/// How often a reader asks again for a checkpoint another holds, pausing [`HELD_PAUSE`] times
/// the attempt in between: about two seconds in all.
const HELD_ASKS: u32 = 15;
const HELD_PAUSE: Duration = Duration::from_millis(20);

async fn channel(connection: &Connection) -> Result<Channel, TransportError> {
    answered("opening a channel", connection.create_channel())
        .await?
        .map_err(|e| broker("opening a channel", e))
}
