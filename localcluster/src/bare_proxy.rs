//! The thinnest hyper reverse proxy, a baseline for the hop benchmark: one upstream
//! connection per client connection, no routing, no pool, no ownership, no proof. The
//! bench binary runs itself in this role (`LEASEHOLD_BENCH_ROLE=bare-proxy`), so (c)
//! against this separates what our forwarding adds from what hyper and tokio cost.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use hyper::{body::Incoming, server::conn::http1, service::service_fn, Request};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

const ROLE_ENV: &str = "LEASEHOLD_BENCH_ROLE";
const ROLE: &str = "bare-proxy";

/// If this process was started as the bare proxy, serve until killed and return true.
pub async fn serve_if_requested() -> bool {
    if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
        return false;
    }
    let arg = |flag: &str| std::env::args().skip_while(|a| a != flag).nth(1).expect(flag);
    let listen: SocketAddr = arg("--listen").parse().expect("--listen");
    let upstream: SocketAddr = arg("--upstream").parse().expect("--upstream");
    let listener = TcpListener::bind(listen).await.expect("bind the bare proxy");
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            let Ok(up) = TcpStream::connect(upstream).await else { return };
            let _ = up.set_nodelay(true);
            let Ok((send, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(up)).await else {
                return;
            };
            tokio::spawn(conn);
            let send = Arc::new(tokio::sync::Mutex::new(send));
            let service = service_fn(move |request: Request<Incoming>| {
                let send = send.clone();
                async move { send.lock().await.send_request(request).await }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(client), service).await;
        });
    }
}

/// The command line that runs this executable as the bare proxy.
pub fn command(listen: SocketAddr, upstream: SocketAddr) -> std::process::Command {
    let exe: PathBuf = std::env::current_exe().expect("current exe");
    let mut cmd = std::process::Command::new(exe);
    cmd.env(ROLE_ENV, ROLE).args(["--listen", &listen.to_string(), "--upstream", &upstream.to_string()]);
    cmd
}
