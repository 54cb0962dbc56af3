//! Two timeouts where hyper has one. hyper's `header_read_timeout` starts when a
//! connection begins waiting for a request head, so on a keep-alive connection it also
//! bounds the idle time between requests. A 10 s slowloris bound then closes every pooled
//! connection after 10 s idle, while clients keep theirs for 90 s (Go's transport, which
//! the API server's proxy uses; reqwest; hyper-util): a request sent at the instant the
//! server closes is lost ("connection closed before message completed", or `EOF` from a
//! proxy), and a POST is not retried. Envoy and Go's server split the two: an idle
//! timeout longer than the clients' pools, and a header timeout from a request's first
//! byte. This module does that under hyper: the connection's reads are [`Watched`], and
//! the per-connection [`HeadTimer`] it hands hyper measures from the first byte read
//! since it was armed — or, with nothing read, from the end of the last answer.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The two bounds on waiting for a request head.
#[derive(Debug, Clone, Copy)]
pub struct HeadTimeouts {
    /// From a head's first byte (or from accepting the connection, for its first
    /// request) to its last.
    pub header_read: Duration,
    /// A keep-alive connection with no request started for this long is closed.
    pub idle: Duration,
}

/// What a connection's reads tell its timer.
#[derive(Debug)]
struct Activity {
    /// Connection start; `first_byte` counts from here.
    base: Instant,
    /// Nanoseconds after `base` (plus one) of the first byte read since the timer was
    /// last armed; 0 while nothing has been read.
    first_byte: AtomicU64,
    /// Whether the timer was armed before: the first arm waits for the connection's first
    /// request (a header timeout), later ones for a keep-alive's next request (idle).
    armed_before: AtomicBool,
}

impl Activity {
    fn read_some(&self) {
        // Relaxed: the IO and the timer are polled by the same connection task.
        if self.first_byte.load(Ordering::Relaxed) == 0 {
            let nanos = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
            self.first_byte.store(nanos + 1, Ordering::Relaxed);
        }
    }

    fn first_byte(&self) -> Option<Instant> {
        match self.first_byte.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n - 1)),
        }
    }
}

/// One connection's timer and IO, sharing its read activity.
pub fn watch<T>(io: T, timeouts: HeadTimeouts) -> (Watched<T>, HeadTimer) {
    let activity = Arc::new(Activity {
        base: Instant::now(),
        first_byte: AtomicU64::new(0),
        armed_before: AtomicBool::new(false),
    });
    (Watched { io, activity: activity.clone() }, HeadTimer { activity, timeouts })
}

/// A connection's IO that notes when bytes arrive.
#[derive(Debug)]
pub struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.read_some();
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The timer hyper arms when it starts waiting for a request head (its only use of an
/// HTTP/1 server's timer). hyper's deadline is ignored: [`HeadSleep`] computes its own.
#[derive(Debug, Clone)]
pub struct HeadTimer {
    activity: Arc<Activity>,
    timeouts: HeadTimeouts,
}

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, _duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.arm()
    }

    fn sleep_until(&self, _deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.arm()
    }
}

impl HeadTimer {
    fn arm(&self) -> Pin<Box<dyn hyper::rt::Sleep>> {
        let keep_alive = self.activity.armed_before.swap(true, Ordering::Relaxed);
        // Bytes of the last request (its body) do not start the next one's head.
        self.activity.first_byte.store(0, Ordering::Relaxed);
        let first_wait = if keep_alive { self.timeouts.idle } else { self.timeouts.header_read };
        let deadline = Instant::now() + first_wait;
        Box::pin(HeadSleep {
            activity: self.activity.clone(),
            header_read: keep_alive.then_some(self.timeouts.header_read),
            deadline,
            sleep: Box::pin(tokio::time::sleep_until(deadline.into())),
        })
    }
}

/// Fires at `deadline` while nothing is read; on a keep-alive connection, once a byte is
/// read, `header_read` after it instead. Re-computed each time hyper polls it, which it
/// does after every read that leaves the head incomplete.
#[derive(Debug)]
struct HeadSleep {
    activity: Arc<Activity>,
    /// `None` for a connection's first request: its bound runs from the accept.
    header_read: Option<Duration>,
    deadline: Instant,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = match (self.header_read, self.activity.first_byte()) {
            (Some(header_read), Some(first)) => first + header_read,
            _ => self.deadline,
        };
        if self.sleep.deadline() != deadline.into() {
            self.sleep.as_mut().reset(deadline.into());
        }
        self.sleep.as_mut().poll(cx)
    }
}

impl hyper::rt::Sleep for HeadSleep {}
