//! A TCP link from one process to a server that a test can cut: while cut, no byte passes
//! either way and nothing is refused or reset, which is what a network partition looks
//! like to the process (its statements hang; they do not fail). Mended, the bytes held
//! meanwhile flow on, as late packets do.

use std::{io, net::SocketAddr};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::watch,
    task::{JoinHandle, JoinSet},
};

/// Bytes read from one side before they are held or passed on.
const CHUNK: usize = 16 * 1024;

/// A running link; every connection through it ends when it is dropped.
#[derive(Debug)]
pub struct Link {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Link {
    /// Listen on `listen` (port 0 picks one) and relay every connection to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> io::Result<Link> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new(); // aborted with this task
            while let Ok((client, _)) = listener.accept().await {
                connections.spawn(relay(client, target, cut_rx.clone()));
            }
        });
        Ok(Link { addr, cut, task })
    }

    /// A link on 127.0.0.1 to the database server of `url` (its host an IP address).
    pub async fn to_database(url: &str) -> io::Result<Link> {
        let (_, server, _) = authority(url);
        let target = server.parse().map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{server} is not an ip:port: {e}"))
        })?;
        Link::start((std::net::Ipv4Addr::LOCALHOST, 0).into(), target).await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Partition: hold every byte in both directions, on open and new connections.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Heal: what was held flows on.
    pub fn mend(&self) {
        self.cut.send_replace(false);
    }

    /// A Postgres URL (`postgres://user@host:port/db?...`) rewritten to go through this link.
    pub fn database_url(&self, url: &str) -> String {
        via(url, self.addr)
    }
}

/// `url` split around its `host:port`: (before, host:port, after).
fn authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let start = url[start..].find('@').map_or(start, |i| start + i + 1);
    let end = url[start..].find(['/', '?']).map_or(url.len(), |i| start + i);
    (&url[..start], &url[start..end], &url[end..])
}

/// `url` with its `host:port` replaced by `addr`.
fn via(url: &str, addr: SocketAddr) -> String {
    let (before, _, after) = authority(url);
    format!("{before}{addr}{after}")
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, target: SocketAddr, cut: watch::Receiver<bool>) {
    let Ok(server) = TcpStream::connect(target).await else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(pipe(client_read, server_write, cut.clone()), pipe(server_read, client_write, cut));
}

/// Copy `from` to `to`, holding each chunk while the link is cut.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut cut: watch::Receiver<bool>) {
    let mut buf = vec![0; CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if cut.wait_for(|cut| !*cut).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = socket.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_cut_link_holds_bytes_until_it_is_mended() {
        let link = Link::start("127.0.0.1:0".parse().unwrap(), echo_server().await).await.unwrap();
        let mut conn = TcpStream::connect(link.addr()).await.unwrap();
        let mut buf = [0u8; 5];
        conn.write_all(b"hello").await.unwrap();
        conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");

        link.cut();
        conn.write_all(b"later").await.unwrap();
        let held = tokio::time::timeout(Duration::from_millis(300), conn.read_exact(&mut buf)).await;
        assert!(held.is_err(), "nothing passes while cut");
        link.mend();
        conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"later", "the held bytes arrive once mended");
    }

    #[test]
    fn database_urls_are_rewritten_to_the_link() {
        let addr = "127.0.0.9:4000".parse().unwrap();
        assert_eq!(
            via("postgres://postgres@127.0.0.1:5432/lh_1?sslmode=disable", addr),
            "postgres://postgres@127.0.0.9:4000/lh_1?sslmode=disable"
        );
        assert_eq!(via("postgres://db.example:5432", addr), "postgres://127.0.0.9:4000");
    }
}
