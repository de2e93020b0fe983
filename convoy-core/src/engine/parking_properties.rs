//! Property of parked keys: whatever fails (and fails again in replays before the fix), whatever
//! arrives while a replay runs and whenever the operator replays, a key's messages are handled
//! in the key's order, each once, once the cause is fixed and the key is replayed until it is
//! unparked — also when the replay tool dies part-way and the replay is resumed. The engine's
//! side is played step by step on a view (`Parking`) over an in-memory destination, with an
//! idempotency store; the operator's is `parking::replay_key` and `resume_replay` themselves.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use proptest::prelude::*;

use super::parking::{Gate, Parking};
use crate::dead_letter::{DeadLetter, DeadLetterCause, DeadLetterReason, DeadLetterSink};
use crate::header_names::EVENT_ID_HEADER;
use crate::message::{Headers, Message, OutgoingMessage, SourceId};
use crate::parking::{
    replay_key, resume_replay, ParkedKeys, ParkingChange, ReplayError, DL_PARK_ID, REPLAY, REPLAY_PART,
};
use crate::transport::{Publisher, Receipt, TransportError};

const KEY: &[u8] = b"acct";

/// An append-only log: the key's partition, or the dead-letter destination.
struct Log {
    source: &'static str,
    records: Mutex<Vec<Message>>,
}

impl Log {
    fn new(source: &'static str) -> Log {
        Log {
            source,
            records: Mutex::default(),
        }
    }

    fn append(&self, out: OutgoingMessage) -> Receipt {
        let mut records = self.records.lock().unwrap();
        let offset = records.len() as u64;
        records.push(Message {
            key: out.key,
            payload: out.payload,
            headers: out.headers,
            source: SourceId::new(self.source),
            offset,
        });
        Receipt {
            source: SourceId::new(self.source),
            offset,
        }
    }

    fn get(&self, offset: usize) -> Option<Message> {
        self.records.lock().unwrap().get(offset).cloned()
    }
}

#[async_trait]
impl Publisher for Log {
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        Ok(self.append(message))
    }
}

#[async_trait]
impl DeadLetterSink for Log {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.append(dead_letter.to_outgoing());
        Ok(())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        Ok(self.records.lock().unwrap().clone())
    }
}

fn reason(cause: DeadLetterCause, parks_key: bool) -> DeadLetterReason {
    let now = SystemTime::now();
    DeadLetterReason {
        cause,
        error_class: cause.as_str().to_owned(),
        error: String::new(),
        attempts: 1,
        first_failure: now,
        last_failure: now,
        group: "g".to_owned(),
        parks_key,
    }
}

/// The world: the key's partition, the destination, the engine's view and what it handled.
struct World {
    partition: Arc<Log>,
    destination: Log,
    parking: Parking,
    /// The next partition offset the engine takes.
    next: usize,
    /// Live messages published so far (their payload is their place in the key's order).
    published: u64,
    failing: HashSet<u64>,
    fixed: bool,
    handled: Vec<u64>,
    /// Event ids finished (handled or dead-lettered), as the engine's idempotency store keeps
    /// them: a resumed replay's messages that ran already are skipped.
    finished: HashSet<String>,
}

impl World {
    fn publish_live(&mut self) {
        let mut headers = Headers::new();
        headers.insert(EVENT_ID_HEADER, format!("ev-{}", self.published));
        self.partition.append(OutgoingMessage {
            key: Some(Bytes::from_static(KEY)),
            payload: Bytes::from(self.published.to_string()),
            headers,
        });
        self.published += 1;
    }

    /// The engine takes the next message of the partition, as a lane does; false when there is
    /// none.
    async fn process(&mut self) -> bool {
        let Some(message) = self.partition.get(self.next) else {
            return false;
        };
        self.next += 1;
        let id = message.headers.get_str(EVENT_ID_HEADER).map(str::to_owned);
        let mut gate = self.parking.gate(&message, id.as_deref(), false);
        if gate == Gate::ReadBack {
            self.parking.read_back(&self.destination).await;
            gate = self.parking.gate(&message, id.as_deref(), true);
        }
        match gate {
            Gate::Free | Gate::Replay => self.handle(&message, id),
            Gate::SetAside | Gate::ReadBack => {
                self.write(with_id(&message, &id), DeadLetterCause::Parked, false);
                self.parking.set_aside(&message, id, false);
            }
            Gate::AlreadySetAside | Gate::Duplicate => {}
        }
        // As the lane: the replay's last message ends it, however it ended.
        if let Some((tag, part)) = self.parking.ending_replay(&message) {
            let mut headers = Headers::new();
            headers.insert(REPLAY, tag.header_value());
            if let Some(part) = &part {
                headers.insert(REPLAY_PART, part.clone());
            }
            let marker = Message {
                headers,
                payload: Bytes::new(),
                ..message.clone()
            };
            self.write(marker, DeadLetterCause::ReplayDone, false);
            self.parking
                .record(Bytes::from_static(KEY), ParkingChange::ReplayDone(tag.id, part));
        }
        true
    }

    /// Handles `message`: a duplicate skipped, a failure until the fix, else done.
    fn handle(&mut self, message: &Message, id: Option<String>) {
        let seq: u64 = String::from_utf8_lossy(&message.payload).parse().unwrap();
        if let Some(id) = &id {
            if !self.finished.insert(id.clone()) {
                return;
            }
        }
        if !self.fixed && self.failing.contains(&seq) {
            self.write(with_id(message, &id), DeadLetterCause::Terminal, true);
            self.parking.set_aside(message, id, true);
        } else {
            self.handled.push(seq);
        }
    }

    fn write(&self, message: Message, cause: DeadLetterCause, parks_key: bool) {
        let reason = reason(cause, parks_key);
        self.destination
            .append(DeadLetter { message, reason }.to_outgoing());
    }

    /// The operator replays the key (refused while it is not parked or a replay is under way);
    /// with `stop_after`, the tool dies after publishing that many of the replay's messages.
    async fn replay(&self, stop_after: Option<usize>) {
        let publisher = self.publisher(stop_after);
        match replay_key("g", KEY, &self.destination, &publisher).await {
            Ok(_)
            | Err(ReplayError::NotParked { .. } | ReplayError::UnderWay { .. } | ReplayError::Transport(_)) =>
                {}
            Err(e) => panic!("{e}"),
        }
    }

    /// The operator publishes the replay under way again (refused when there is none).
    async fn resume(&self) {
        match resume_replay("g", KEY, &self.destination, &self.publisher(None)).await {
            Ok(_) | Err(ReplayError::NoneUnderWay(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }

    /// A publisher to the partition that fails after `stop_after` messages, if given.
    fn publisher(
        &self,
        stop_after: Option<usize>,
    ) -> impl Fn(&str) -> Result<Arc<dyn Publisher>, TransportError> + Sync {
        let partition: Arc<dyn Publisher> = match stop_after {
            None => self.partition.clone(),
            Some(n) => Arc::new(Dying {
                partition: self.partition.clone(),
                left: Mutex::new(n),
            }),
        };
        move |_: &str| Ok(partition.clone())
    }

    fn replaying(&self) -> bool {
        let records = self.destination.records.lock().unwrap().clone();
        ParkedKeys::read("g", &records)
            .get(KEY)
            .is_some_and(|p| p.replaying().is_some())
    }

    fn parked(&self) -> bool {
        let records = self.destination.records.lock().unwrap().clone();
        ParkedKeys::read("g", &records).get(KEY).is_some()
    }
}

/// A publisher that dies after some messages (the replay tool killed part-way).
struct Dying {
    partition: Arc<Log>,
    left: Mutex<usize>,
}

#[async_trait]
impl Publisher for Dying {
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        let mut left = self.left.lock().unwrap();
        if *left == 0 {
            return Err(TransportError::Closed);
        }
        *left -= 1;
        Ok(self.partition.append(message))
    }
}

fn with_id(message: &Message, id: &Option<String>) -> Message {
    let mut message = message.clone();
    if let Some(id) = id {
        message.headers.insert(DL_PARK_ID, id.clone());
    }
    message
}

/// What the world does next.
#[derive(Clone, Copy, Debug)]
enum Step {
    Publish,
    Process,
    Replay,
    /// The tool dies after publishing this many of the replay's messages.
    ReplayPartly(usize),
    Resume,
    Fix,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::Publish),
        4 => Just(Step::Process),
        2 => Just(Step::Replay),
        1 => (0usize..4).prop_map(Step::ReplayPartly),
        1 => Just(Step::Resume),
        1 => Just(Step::Fix),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn a_parked_key_ends_handled_in_its_order_each_once(
        messages in 1u64..16,
        failing in proptest::collection::hash_set(0u64..16, 0..5),
        steps in proptest::collection::vec(step(), 0..80),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let handled = runtime.block_on(async {
            let mut world = World {
                partition: Arc::new(Log::new("t/0")),
                destination: Log::new("t.dlq/0"),
                parking: Parking::new("g", crate::parking::CHECKPOINT_AFTER),
                next: 0,
                published: 0,
                failing,
                fixed: false,
                handled: Vec::new(),
                finished: HashSet::new(),
            };
            for step in steps {
                match step {
                    Step::Publish if world.published < messages => world.publish_live(),
                    Step::Publish => {}
                    Step::Process => {
                        world.process().await;
                    }
                    Step::Replay => world.replay(None).await,
                    Step::ReplayPartly(n) => world.replay(Some(n)).await,
                    Step::Resume => world.resume().await,
                    Step::Fix => world.fixed = true,
                }
            }
            // The end: the fix, everything published and taken, replays until unparked.
            world.fixed = true;
            while world.published < messages {
                world.publish_live();
            }
            for _ in 0..50 {
                while world.process().await {}
                if !world.parked() {
                    break;
                }
                match world.replaying() {
                    true => world.resume().await,
                    false => world.replay(None).await,
                }
            }
            assert!(!world.parked(), "still parked after the replays");
            world.handled
        });
        prop_assert_eq!(handled, (0..messages).collect::<Vec<_>>());
    }
}
