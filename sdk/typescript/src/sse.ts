/**
 * A Server-Sent Events parser over a byte stream (what `fetch` gives), following the
 * HTML spec's field rules: lines end at CRLF, LF or CR; `:` starts a comment; a blank
 * line ends a frame; several `data:` lines are joined with `\n`; one leading space of
 * a value is dropped.
 */

export interface SseFrame {
  /** `id:` of this frame; `undefined` when the frame had none (control frames). */
  id: string | undefined;
  /** `event:`; `"message"` when absent. */
  event: string;
  data: string;
  /** `retry:` in milliseconds, when the frame carried one. */
  retry: number | undefined;
}

/** Frames larger than this are a broken server; the stream is failed rather than grown. */
export const MAX_FRAME_BYTES = 16 * 1024 * 1024;

export class SseParser {
  private buffer = "";
  private readonly decoder = new TextDecoder("utf-8");
  private id: string | undefined;
  private event: string | undefined;
  private data: string[] = [];
  private retry: number | undefined;
  private frameChars = 0;
  /** A CR ended the last chunk: a LF starting the next one belongs to it. */
  private pendingCr = false;

  /** Feed bytes; returns the frames completed by them. */
  push(chunk: Uint8Array): SseFrame[] {
    return this.feed(this.decoder.decode(chunk, { stream: true }));
  }

  /** Feed text (tests; already decoded input). */
  feed(text: string): SseFrame[] {
    const frames: SseFrame[] = [];
    let input = text;
    if (this.pendingCr && input.startsWith("\n")) input = input.slice(1);
    this.pendingCr = false;
    this.buffer += input;
    for (;;) {
      const cr = this.buffer.indexOf("\r");
      const lf = this.buffer.indexOf("\n");
      let end: number;
      let skip: number;
      if (cr === -1 && lf === -1) break;
      if (cr !== -1 && (lf === -1 || cr < lf)) {
        end = cr;
        if (cr + 1 < this.buffer.length) {
          skip = this.buffer[cr + 1] === "\n" ? 2 : 1;
        } else {
          skip = 1;
          this.pendingCr = true;
        }
      } else {
        end = lf;
        skip = 1;
      }
      const line = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + skip);
      const frame = this.line(line);
      if (frame) frames.push(frame);
    }
    if (this.buffer.length + this.frameChars > MAX_FRAME_BYTES) {
      throw new Error(`SSE frame exceeds ${MAX_FRAME_BYTES} bytes`);
    }
    return frames;
  }

  private line(line: string): SseFrame | undefined {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return undefined;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    this.frameChars += line.length;
    switch (field) {
      case "id":
        if (!value.includes("\0")) this.id = value;
        break;
      case "event":
        this.event = value;
        break;
      case "data":
        this.data.push(value);
        break;
      case "retry":
        if (/^\d+$/.test(value)) this.retry = Number(value);
        break;
      default:
        break; // unknown fields are ignored
    }
    return undefined;
  }

  private dispatch(): SseFrame | undefined {
    const frame: SseFrame | undefined =
      this.data.length === 0 && this.event === undefined && this.id === undefined && this.retry === undefined
        ? undefined
        : { id: this.id, event: this.event ?? "message", data: this.data.join("\n"), retry: this.retry };
    this.id = undefined;
    this.event = undefined;
    this.data = [];
    this.retry = undefined;
    this.frameChars = 0;
    return frame;
  }
}
