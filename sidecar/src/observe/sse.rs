//! Server-Sent Events: encoding our messages, and parsing an upstream stream.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};

use super::{Event, EventId};

/// Encode one SSE frame. Multi-line data becomes one `data:` line per line.
pub fn encode(id: Option<EventId>, kind: &str, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + kind.len() + 32);
    if let Some(id) = id {
        out.push_str(&format!("id: {id}\n"));
    }
    out.push_str("event: ");
    out.push_str(kind);
    out.push('\n');
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line.trim_end_matches('\r'));
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

/// A control frame (`idle`, `reconnect`, `overflow`, ...) with a small JSON body.
pub fn control(kind: &str, data: serde_json::Value) -> Bytes {
    encode(None, kind, &data.to_string())
}

/// A comment line: keeps idle connections open through proxies.
pub const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

/// One parsed SSE frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frame {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl Frame {
    /// Our event, if the frame is one (control frames carry no id).
    pub fn to_event(&self) -> Option<Event> {
        let id = EventId::parse(self.id.as_deref()?)?;
        Some(Event::new(id, self.event.as_deref().unwrap_or("message"), &self.data))
    }
}

/// Longest frame accepted from upstream; a larger one is a broken peer.
const MAX_FRAME: usize = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("upstream stream failed")]
    Upstream(#[source] reqwest::Error),
    #[error("upstream frame exceeds {MAX_FRAME} bytes")]
    TooLarge,
}

fn parse_frame(block: &str) -> Option<Frame> {
    let mut frame = Frame::default();
    let mut data_lines = Vec::new();
    for line in block.lines() {
        if line.is_empty() || line.starts_with(':') {
            continue; // comment / keep-alive
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "id" => frame.id = Some(value.to_owned()),
            "event" => frame.event = Some(value.to_owned()),
            "data" => data_lines.push(value),
            _ => {}
        }
    }
    if frame.id.is_none() && frame.event.is_none() && data_lines.is_empty() {
        return None;
    }
    frame.data = data_lines.join("\n");
    Some(frame)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The first blank line in `buf`: (end of the frame, bytes to consume).
fn boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = find(buf, b"\n\n").map(|i| (i, i + 2));
    let crlf = find(buf, b"\r\n\r\n").map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Parse a byte stream into SSE frames.
pub fn parse(
    bytes: impl Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + Send + 'static,
) -> impl Stream<Item = Result<Frame, ParseError>> + Unpin + Send {
    let state = (bytes, BytesMut::new(), false);
    Box::pin(futures_util::stream::unfold(state, |(mut bytes, mut buf, done)| async move {
        loop {
            // A frame ends at a blank line.
            if let Some((end, consumed)) = boundary(&buf) {
                let block = String::from_utf8_lossy(&buf[..end]).into_owned();
                buf.advance(consumed);
                if let Some(frame) = parse_frame(&block) {
                    return Some((Ok(frame), (bytes, buf, done)));
                }
                continue;
            }
            if done {
                return None;
            }
            if buf.len() > MAX_FRAME {
                return Some((Err(ParseError::TooLarge), (bytes, buf, true)));
            }
            match bytes.next().await {
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Some((Err(ParseError::Upstream(e)), (bytes, buf, true))),
                None => return None,
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn frames(chunks: &[&str]) -> Vec<Frame> {
        let owned: Vec<reqwest::Result<bytes::Bytes>> =
            chunks.iter().map(|c| Ok(bytes::Bytes::from(c.to_string()))).collect();
        parse(futures_util::stream::iter(owned)).map(|f| f.unwrap()).collect().await
    }

    #[tokio::test]
    async fn frames_split_across_chunks_and_comments_are_skipped() {
        let got = frames(&[
            ": keep-alive\n\nid: 1-1\nevent: tok",
            "en\ndata: {\"i\":0}\n\n",
            "event: idle\ndata: {}\n\n",
        ])
        .await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].to_event().unwrap().id, EventId::parse("1-1").unwrap());
        assert!(!got[0].to_event().unwrap().opens_turn);
        assert_eq!(got[0].data, "{\"i\":0}");
        assert_eq!(got[1].event.as_deref(), Some("idle"));
        assert!(got[1].to_event().is_none(), "control frames have no id");
    }

    #[tokio::test]
    async fn what_we_encode_parses_back() {
        let id = EventId::parse("3-7").unwrap();
        let bytes = encode(Some(id), "token", "{\"a\":\n1}");
        assert_eq!(&bytes[..], b"id: 3-7\nevent: token\ndata: {\"a\":\ndata: 1}\n\n");
        let got = frames(&[std::str::from_utf8(&bytes).unwrap()]).await;
        assert_eq!((got[0].event.as_deref(), got[0].data.as_str()), (Some("token"), "{\"a\":\n1}"));
        let event = got[0].to_event().unwrap();
        assert_eq!((event.id, event.frame), (id, bytes), "the event re-encodes to the same frame");
    }

    #[tokio::test]
    async fn multi_line_data_and_crlf() {
        let got = frames(&["id: 2-5\r\nevent: x\r\ndata: a\r\ndata: b\r\n\r\n"]).await;
        assert_eq!(got[0].data, "a\nb");
        assert_eq!(got[0].id.as_deref(), Some("2-5"));
    }
}
