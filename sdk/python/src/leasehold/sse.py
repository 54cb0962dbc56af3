"""An incremental Server-Sent Events parser (the WHATWG event-stream format).

Lines end with CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the
next are one line end); a blank line dispatches the frame; `:` starts a comment (the
sidecar's keep-alive); `data:` lines are joined with newlines; one space after the colon
is dropped. Unlike a browser's EventSource, each frame's `id` is its own (`None` when the
frame has no `id:` line): the sidecar sends ids only on events the agent published, so a
control frame (`idle`, `reconnect`, `overflow`) is recognisable by having none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A line longer than this is a broken upstream, not an event.
MAX_LINE = 16 * 1024 * 1024


class SSEError(ValueError):
    """The stream is not a well-formed event stream."""


@dataclass(frozen=True)
class Frame:
    id: str | None
    event: str | None
    data: str


@dataclass
class SSEParser:
    _buf: str = ""
    _after_cr: bool = False
    _started: bool = False
    _id: str | None = None
    _event: str | None = None
    _data: list[str] = field(default_factory=list)
    _fields: bool = False

    def feed(self, text: str) -> list[Frame]:
        """Feed decoded text; returns the frames completed by it."""
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        self._after_cr = False
        buf = self._buf + text
        frames: list[Frame] = []
        start = 0
        length = len(buf)
        while start < length:
            cr = buf.find("\r", start)
            lf = buf.find("\n", start)
            if cr == -1 and lf == -1:
                break
            if cr == -1 or (lf != -1 and lf < cr):
                end, next_start = lf, lf + 1
            elif cr + 1 < length:
                end, next_start = cr, cr + (2 if buf[cr + 1] == "\n" else 1)
            else:  # a CR ending this chunk: an LF may follow in the next one
                end, next_start = cr, cr + 1
                self._after_cr = True
            frame = self._line(buf[start:end])
            if frame is not None:
                frames.append(frame)
            start = next_start
        self._buf = buf[start:]
        if len(self._buf) > MAX_LINE:
            raise SSEError(f"an event-stream line exceeds {MAX_LINE} characters")
        return frames

    def _line(self, line: str) -> Frame | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "id":
            if "\0" not in value:
                self._id = value
                self._fields = True
        elif name == "event":
            self._event = value
            self._fields = True
        elif name == "data":
            self._data.append(value)
            self._fields = True
        return None

    def _dispatch(self) -> Frame | None:
        if not self._fields:
            return None
        frame = Frame(id=self._id or None, event=self._event or None, data="\n".join(self._data))
        self._id, self._event, self._data, self._fields = None, None, [], False
        return frame
