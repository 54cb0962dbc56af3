//! The body of a relayed answer: the upstream body frame by frame, keeping its size
//! hint (so a response of known length goes out with `Content-Length`, in one write,
//! instead of being re-framed as chunks), holding a guard until it is done, and cut off
//! with an error when the session is stood down mid-answer.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::BoxError;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// `B` relayed as it is; `G` is held until the body is dropped.
pub struct Relay<B, G> {
    inner: B,
    halt: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    halted: bool,
    _guard: G,
}

impl<B, G> Relay<B, G> {
    pub fn new(inner: B, guard: G, halt: Option<CancellationToken>) -> Self {
        Relay { inner, halt: halt.map(|h| Box::pin(h.cancelled_owned())), halted: false, _guard: guard }
    }
}

/// The error a stood-down answer ends with: the client sees a broken response, never a
/// complete-looking partial one.
#[derive(Debug, thiserror::Error)]
#[error("session stood down mid-answer")]
pub struct StoodDown;

impl<B, G> Body for Relay<B, G>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    G: Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.halted {
            return Poll::Ready(None);
        }
        if let Some(halt) = this.halt.as_mut() {
            if halt.as_mut().poll(cx).is_ready() {
                this.halted = true;
                return Poll::Ready(Some(Err(StoodDown.into())));
            }
        }
        Pin::new(&mut this.inner).poll_frame(cx).map(|frame| frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.halted || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, Full, StreamBody};

    use super::*;

    #[tokio::test]
    async fn a_known_length_is_kept_and_the_body_relayed() {
        let relay = Relay::new(Full::new(Bytes::from_static(b"hello")), (), Some(CancellationToken::new()));
        assert_eq!(relay.size_hint().exact(), Some(5));
        assert_eq!(relay.collect().await.unwrap().to_bytes(), "hello");
    }

    #[tokio::test]
    async fn a_halt_cuts_the_body_with_an_error() {
        let halt = CancellationToken::new();
        let chunks =
            futures_util::stream::iter([Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"a")))])
                .chain(futures_util::stream::pending());
        let mut relay = Relay::new(StreamBody::new(chunks), (), Some(halt.clone()));
        let first = relay.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "a");
        halt.cancel();
        let err = relay.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "session stood down mid-answer");
        assert!(relay.frame().await.is_none(), "nothing after the cut");
    }

    #[tokio::test]
    async fn the_guard_is_held_until_the_body_is_dropped() {
        let guard = std::sync::Arc::new(());
        let relay = Relay::new(Full::new(Bytes::new()), guard.clone(), None);
        assert_eq!(std::sync::Arc::strong_count(&guard), 2);
        drop(relay);
        assert_eq!(std::sync::Arc::strong_count(&guard), 1);
    }
}
