//! A node's TCP link to the store that a fault can cut, like [`crate::Link`] (while cut no
//! byte passes either way and nothing is reset: statements hang), which can also be armed
//! to cut itself the moment a checkpoint write passes through it, holding that write: a
//! partition that begins in the middle of a write. Random timing rarely lands a cut on a
//! checkpoint (a demo-agent turn spends most of its store time on fenced publishes), yet
//! that held write arriving late is exactly what the fence exists for.

use std::{io, net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::{JoinHandle, JoinSet},
};

/// Bytes read from one side before they are held or passed on.
const CHUNK: usize = 16 * 1024;
/// What marks a checkpoint write on the wire: the demo agent's state, sent as the
/// statement's `bytea` parameter in binary (nothing else a sidecar sends contains it).
const CHECKPOINT_MARK: &[u8] = br#"{"history":["#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// Open until a checkpoint write passes; then cut, holding it.
    Armed,
    Cut,
}

/// A running link; every connection through it ends when it is dropped.
#[derive(Debug)]
pub struct StoreLink {
    addr: SocketAddr,
    state: Arc<watch::Sender<State>>,
    task: JoinHandle<()>,
}

impl StoreLink {
    /// A link on 127.0.0.1 to the database server of `url` (its host an IP address).
    pub async fn to_database(url: &str) -> io::Result<StoreLink> {
        let (_, server, _) = authority(url);
        let target: SocketAddr = server.parse().map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{server} is not an ip:port: {e}"))
        })?;
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(watch::Sender::new(State::Open));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new(); // aborted with this task
            while let Ok((client, _)) = listener.accept().await {
                connections.spawn(relay(client, target, shared.clone()));
            }
        });
        Ok(StoreLink { addr, state, task })
    }

    /// `url` (`postgres://user@host:port/db?...`) rewritten to go through this link.
    pub fn database_url(&self, url: &str) -> String {
        let (before, _, after) = authority(url);
        format!("{before}{}{after}", self.addr)
    }

    /// Partition: hold every byte in both directions, on open and new connections.
    pub fn cut(&self) {
        self.state.send_replace(State::Cut);
    }

    /// Heal: what was held flows on.
    pub fn mend(&self) {
        self.state.send_replace(State::Open);
    }

    /// Cut the link the moment a checkpoint write passes (before it passes).
    pub fn arm(&self) {
        self.state.send_replace(State::Armed);
    }

    /// An armed link that has not tripped is open again.
    pub fn disarm(&self) {
        self.state.send_if_modified(|s| {
            let armed = *s == State::Armed;
            if armed {
                *s = State::Open;
            }
            armed
        });
    }

    /// Wait until the link is cut (by a tripped arm or by [`StoreLink::cut`]).
    pub async fn tripped(&self) {
        let mut watching = self.state.subscribe();
        // Dropping the value's read guard at once: a `cut` or `mend` waits for it.
        let _ = watching.wait_for(|s| *s == State::Cut).await.map(drop);
    }
}

impl Drop for StoreLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `url` split around its `host:port`: (before, host:port, after).
fn authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let start = url[start..].find('@').map_or(start, |i| start + i + 1);
    let end = url[start..].find(['/', '?']).map_or(url.len(), |i| start + i);
    (&url[..start], &url[start..end], &url[end..])
}

async fn relay(client: TcpStream, target: SocketAddr, state: Arc<watch::Sender<State>>) {
    let Ok(server) = TcpStream::connect(target).await else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pipe(client_read, server_write, &state, true),
        pipe(server_read, client_write, &state, false)
    );
}

/// Copy `from` to `to`, holding each chunk while the link is cut; on the way to the
/// store (`to_store`), a checkpoint write cuts an armed link before it passes.
async fn pipe(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin,
    state: &watch::Sender<State>,
    to_store: bool,
) {
    let mut watching = state.subscribe();
    let mut buf = vec![0; CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to_store && contains(&buf[..n], CHECKPOINT_MARK) {
            state.send_if_modified(|s| {
                let armed = *s == State::Armed;
                if armed {
                    *s = State::Cut;
                }
                armed
            });
        }
        if watching.wait_for(|s| *s != State::Cut).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A server that records what it receives and answers each read with "ok".
    async fn recording_server() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n @ 1..) = socket.read(&mut buf).await {
                        let _ = tx.send(buf[..n].to_vec());
                        let _ = socket.write_all(b"ok").await;
                    }
                });
            }
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn an_armed_link_holds_the_first_checkpoint_write_until_mended() {
        let (server, mut received) = recording_server().await;
        let link = StoreLink::to_database(&format!("postgres://u@{server}/db")).await.unwrap();
        let mut conn = TcpStream::connect(link.addr).await.unwrap();
        let mut answer = [0u8; 2];

        link.arm();
        conn.write_all(b"SELECT 1").await.unwrap();
        conn.read_exact(&mut answer).await.unwrap(); // other statements pass
        conn.write_all(br#"Bind {"history":["s0-t1"]}"#).await.unwrap();
        let tripped = tokio::time::timeout(Duration::from_secs(5), link.tripped()).await.is_ok();
        assert!(tripped, "the checkpoint write tripped the link");
        assert_eq!(received.recv().await.unwrap(), b"SELECT 1");
        let held = tokio::time::timeout(Duration::from_millis(300), received.recv()).await;
        assert!(held.is_err(), "the write is held while cut");
        link.mend();
        assert_eq!(
            received.recv().await.unwrap(),
            br#"Bind {"history":["s0-t1"]}"#,
            "and arrives once mended"
        );
    }

    #[tokio::test]
    async fn a_disarmed_link_lets_writes_pass() {
        let (server, mut received) = recording_server().await;
        let link = StoreLink::to_database(&format!("postgres://u@{server}/db")).await.unwrap();
        link.arm();
        link.disarm();
        let mut conn = TcpStream::connect(link.addr).await.unwrap();
        conn.write_all(br#"Bind {"history":[]}"#).await.unwrap();
        assert_eq!(received.recv().await.unwrap(), br#"Bind {"history":[]}"#);
        link.cut();
        link.disarm();
        let cut = tokio::time::timeout(Duration::from_secs(1), link.tripped()).await;
        assert!(cut.is_ok(), "disarming leaves a cut link cut");
    }

    #[test]
    fn database_urls_are_rewritten_to_the_link() {
        assert_eq!(
            authority("postgres://postgres@127.0.0.1:5432/lh_1?sslmode=disable"),
            ("postgres://postgres@", "127.0.0.1:5432", "/lh_1?sslmode=disable")
        );
    }
}
