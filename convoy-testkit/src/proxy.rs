//! A TCP proxy on the loopback for the tests that cut a client off its broker: every connection
//! made to the proxy is forwarded to the target. [`Proxy::cut`] closes every connection at once
//! (the client sees the broker go away and reconnects — through the proxy again);
//! [`Proxy::stall`] stops forwarding without closing anything (a silent network partition: both
//! sides keep their sockets and hear nothing) until [`Proxy::resume`];
//! [`Proxy::stall_replies`] stops only what the broker sends, so requests are carried out and
//! their answers lost (a write whose outcome the client cannot know). Works for any broker.
//! A proxy started with [`Proxy::start_amqp`] knows AMQP 0-9-1 frames and can also hold back
//! every answer but the broker's heartbeats ([`Proxy::stall_answers_keep_heartbeats`]): the
//! client's connection looks alive while none of its calls is ever answered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A forwarding proxy; stops (closing every connection) when dropped.
pub struct Proxy {
    address: SocketAddr,
    /// Bumped by `cut`: connections opened before the current value close.
    generation: watch::Sender<u64>,
    stalled: watch::Sender<bool>,
    /// Only the broker-to-client direction stalled.
    replies_stalled: watch::Sender<bool>,
    /// Only the broker's answers held back, its heartbeats forwarded (AMQP proxies).
    answers_stalled: watch::Sender<bool>,
    /// Forwarding AMQP frames one by one.
    amqp: bool,
    accepted: Arc<AtomicU64>,
    held: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> std::io::Result<Proxy> {
        Self::start_framed(target, false).await
    }

    /// As [`start`](Self::start), for an AMQP 0-9-1 broker: what the broker sends is forwarded
    /// frame by frame, so its heartbeats can pass while its answers are held.
    pub async fn start_amqp(target: &str) -> std::io::Result<Proxy> {
        Self::start_framed(target, true).await
    }

    async fn start_framed(target: &str, amqp: bool) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let (generation, _) = watch::channel(0u64);
        let (stalled, _) = watch::channel(false);
        let (replies_stalled, _) = watch::channel(false);
        let (answers_stalled, _) = watch::channel(false);
        let accepted = Arc::new(AtomicU64::new(0));
        let held = Arc::new(AtomicU64::new(0));
        let accept = {
            let (generation, stalled, replies_stalled, answers_stalled, accepted, held) = (
                generation.clone(),
                stalled.clone(),
                replies_stalled.clone(),
                answers_stalled.clone(),
                accepted.clone(),
                held.clone(),
            );
            let target = target.to_owned();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Relaxed);
                    let born = *generation.borrow();
                    let link = Link {
                        target: target.clone(),
                        born,
                        generation: generation.subscribe(),
                        stalled: stalled.subscribe(),
                        replies_stalled: replies_stalled.subscribe(),
                        answers_stalled: amqp.then(|| answers_stalled.subscribe()),
                        held: held.clone(),
                    };
                    tokio::spawn(forward(client, link));
                }
            })
        };
        Ok(Proxy {
            address,
            generation,
            stalled,
            replies_stalled,
            answers_stalled,
            amqp,
            accepted,
            held,
            accept,
        })
    }

    /// `127.0.0.1:<port>`: where clients connect instead of the target.
    pub fn address(&self) -> String {
        self.address.to_string()
    }

    /// Closes every connection open now (what a stall held back is lost with them); new ones
    /// are forwarded as before.
    pub fn cut(&self) {
        self.generation.send_modify(|g| *g += 1);
        self.held.store(0, Relaxed);
    }

    /// Stops forwarding in both directions, closing nothing.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// Stops forwarding what the broker sends, closing nothing; requests still reach it.
    pub fn stall_replies(&self) {
        self.replies_stalled.send_replace(true);
    }

    /// Holds back every frame the broker sends but its heartbeats, closing nothing: the
    /// client's connection stays alive by every measure it has, and no call of it is answered.
    /// Only a proxy started with [`start_amqp`](Self::start_amqp) can tell heartbeats apart.
    pub fn stall_answers_keep_heartbeats(&self) {
        assert!(
            self.amqp,
            "only an AMQP proxy (Proxy::start_amqp) knows heartbeats"
        );
        self.answers_stalled.send_replace(true);
    }

    /// Forwards again what a stall held back.
    pub fn resume(&self) {
        self.stalled.send_replace(false);
        self.replies_stalled.send_replace(false);
        self.answers_stalled.send_replace(false);
    }

    /// How many connections the proxy has accepted so far (a reconnect is one more).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Relaxed)
    }

    /// Bytes read from either side and held back by a stall (lost if the connection is cut
    /// now): in flight between broker and client.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// What one forwarded connection shares with the proxy.
struct Link {
    target: String,
    /// The cut generation it was opened in.
    born: u64,
    generation: watch::Receiver<u64>,
    stalled: watch::Receiver<bool>,
    replies_stalled: watch::Receiver<bool>,
    /// Set for AMQP proxies, which forward the broker's frames one by one.
    answers_stalled: Option<watch::Receiver<bool>>,
    held: Arc<AtomicU64>,
}

/// One client connection, forwarded until either side closes or the proxy cuts it.
async fn forward(client: TcpStream, link: Link) {
    let Ok(server) = TcpStream::connect(&link.target).await else {
        return; // the client sees its connection close, as with a broker that is down
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let born = link.born;
    let up = pump(client_read, server_write, &link, link.stalled.clone(), born);
    let down = async {
        match link.answers_stalled.clone() {
            Some(answers) => pump_amqp_frames(server_read, client_write, &link, answers).await,
            None => {
                pump(
                    server_read,
                    client_write,
                    &link,
                    link.replies_stalled.clone(),
                    born,
                )
                .await
            }
        }
    };
    let mut generation = link.generation.clone();
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = generation.wait_for(|g| *g != born) => {}
    }
    // Dropping both halves of both sockets closes them.
}

/// Copies bytes from `from` to `to`, holding each read back while stalled; what a cut caught
/// held back is never written.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    link: &Link,
    mut direction: watch::Receiver<bool>,
    born: u64,
) {
    let mut stalled = link.stalled.clone();
    let (held, generation) = (&link.held, &link.generation);
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let holding = *stalled.borrow() || *direction.borrow();
        if holding {
            held.fetch_add(read as u64, Relaxed);
        }
        let resumed = stalled.wait_for(|s| !*s).await.is_ok() && direction.wait_for(|s| !*s).await.is_ok();
        if holding {
            held.fetch_sub(read as u64, Relaxed);
        }
        if !resumed || *generation.borrow() != born || to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// The length of the AMQP 0-9-1 frame at the start of `bytes` (type, channel, payload size,
/// payload, frame end), once all of it is there.
fn amqp_frame_len(bytes: &[u8]) -> Option<usize> {
    let size = u32::from_be_bytes(bytes.get(3..7)?.try_into().ok()?) as usize;
    let len = 7 + size + 1;
    (bytes.len() >= len).then_some(len)
}

/// The AMQP heartbeat frame's type.
const AMQP_HEARTBEAT: u8 = 8;

/// Copies what an AMQP broker sends, frame by frame: while stalled (both ways or replies) every
/// frame is held back; while only answers are, heartbeats pass ahead of what is held. What is
/// held is written, in order, once nothing holds it.
async fn pump_amqp_frames(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    link: &Link,
    mut answers: watch::Receiver<bool>,
) {
    let (mut stalled, mut replies) = (link.stalled.clone(), link.replies_stalled.clone());
    let mut buffer = vec![0u8; 64 * 1024];
    let (mut pending, mut held) = (Vec::new(), Vec::<u8>::new());
    loop {
        let (all_held, answers_held) = (*stalled.borrow() || *replies.borrow(), *answers.borrow());
        if !all_held && !answers_held && !held.is_empty() {
            link.held.fetch_sub(held.len() as u64, Relaxed);
            if to.write_all(&held).await.is_err() {
                return;
            }
            held.clear();
        }
        while let Some(len) = amqp_frame_len(&pending) {
            let frame: Vec<u8> = pending.drain(..len).collect();
            let passes = !all_held && (!answers_held || frame[0] == AMQP_HEARTBEAT);
            if passes && (held.is_empty() || frame[0] == AMQP_HEARTBEAT) {
                if to.write_all(&frame).await.is_err() {
                    return;
                }
            } else {
                link.held.fetch_add(frame.len() as u64, Relaxed);
                held.extend_from_slice(&frame);
            }
        }
        tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => pending.extend_from_slice(&buffer[..n]),
            },
            changed = stalled.changed() => if changed.is_err() { return },
            changed = replies.changed() => if changed.is_err() { return },
            changed = answers.changed() => if changed.is_err() { return },
        }
    }
}
