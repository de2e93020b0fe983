//! A TCP proxy on the loopback for the tests that cut a client off its broker: every connection
//! made to the proxy is forwarded to the target. [`Proxy::cut`] closes every connection at once
//! (the client sees the broker go away and reconnects — through the proxy again);
//! [`Proxy::stall`] stops forwarding without closing anything (a silent network partition: both
//! sides keep their sockets and hear nothing) until [`Proxy::resume`];
//! [`Proxy::stall_replies`] stops only what the broker sends, so requests are carried out and
//! their answers lost (a write whose outcome the client cannot know). Works for any broker.

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
    accepted: Arc<AtomicU64>,
    held: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let (generation, _) = watch::channel(0u64);
        let (stalled, _) = watch::channel(false);
        let (replies_stalled, _) = watch::channel(false);
        let accepted = Arc::new(AtomicU64::new(0));
        let held = Arc::new(AtomicU64::new(0));
        let accept = {
            let (generation, stalled, replies_stalled, accepted, held) = (
                generation.clone(),
                stalled.clone(),
                replies_stalled.clone(),
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

    /// Forwards again what a stall held back.
    pub fn resume(&self) {
        self.stalled.send_replace(false);
        self.replies_stalled.send_replace(false);
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
    let down = pump(
        server_read,
        client_write,
        &link,
        link.replies_stalled.clone(),
        born,
    );
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
