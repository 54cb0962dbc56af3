#!/usr/bin/env python3
"""A minimal agent for fault tests: thaws, thinks for the turn's `think_ms`, appends the
turn's text, checkpoints through the sidecar, then holds the answer for the turn's
`hold_ms` (a turn whose write landed before its pod froze). No events, so the only
database write of a turn is its checkpoint. A resumed turn (`Leasehold-Resume`) whose
interrupted attempt's checkpoint already landed (the checkpoint names the turn) is not
applied again: it only answers. A turn with `status` is answered that status
at once (an agent's own 401 or 503), with nothing written; a turn with `"poison": true`
fails mid-turn each time it is sent (the connection closes unanswered). Usage: hold_agent.py --listen IP:PORT (the sidecar's agent API is
on the same IP, port 18082).

With HOLD_AGENT_RECORD_DIR set, it keeps a record of what it was sent, one JSON line per
happening in <dir>/<ip>.jsonl, so a test can see what reached this pod's agent:
  {"got": "<path>", "content_type", "epoch", "turn_id", "headers", "body"}
                                     on receipt of any POST ("headers": [name, value] pairs);
  {"thawed": "<key>", "checkpoint_epoch"}                         after a thaw (null: 404)."""
import http.server
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

listen = sys.argv[sys.argv.index("--listen") + 1]
host, port = listen.rsplit(":", 1)
sidecar = f"http://{host}:18082"
record_dir = os.environ.get("HOLD_AGENT_RECORD_DIR")
record_lock = threading.Lock()


def record(entry):
    if not record_dir:
        return
    with record_lock, open(os.path.join(record_dir, f"{host}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


class Agent(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        record(
            {
                "got": self.path,
                "content_type": self.headers.get("content-type"),
                "epoch": self.headers.get("leasehold-epoch"),
                "turn_id": self.headers.get("leasehold-turn-id"),
                "headers": [[name.lower(), value] for name, value in self.headers.items()],
                "body": raw.decode("utf-8", "replace"),
            }
        )
        parts = self.path.strip("/").split("/")  # sessions/{key}/turns
        if len(parts) != 3 or parts[2] != "turns":
            return self.answer(200, {})  # stand-down and the rest: nothing to hold
        key, epoch = parts[1], self.headers["leasehold-epoch"]
        turn = json.loads(raw or b"{}")
        if "status" in turn:  # an answer of the agent's own: no thaw, no checkpoint
            return self.answer(turn["status"], {"error": "from_the_agent", "status": turn["status"]})
        if turn.get("poison"):  # fails mid-turn every time: the connection closes unanswered
            self.close_connection = True
            return self.connection.shutdown(2)
        url = f"{sidecar}/v1/sessions/{key}/checkpoint"
        try:
            with urllib.request.urlopen(url) as r:
                checkpoint_epoch = r.headers.get("leasehold-checkpoint-epoch")
                history = json.load(r)["history"]
                written_by = r.headers.get("leasehold-checkpoint-turn")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                return self.answer(502, {"error": "thaw_failed"})
            checkpoint_epoch, history, written_by = None, [], None
        record({"thawed": key, "checkpoint_epoch": checkpoint_epoch})
        resumed = self.headers.get("leasehold-resume")
        if resumed is not None and resumed == written_by:  # applied before the interruption
            return self.answer(200, {"history_len": len(history), "epoch": int(epoch)})
        time.sleep(turn.get("think_ms", 0) / 1000)
        history.append(turn.get("text", ""))
        put = urllib.request.Request(
            url, data=json.dumps({"history": history}).encode(), method="PUT", headers={"leasehold-epoch": epoch}
        )
        try:
            urllib.request.urlopen(put).read()
        except urllib.error.HTTPError:
            return self.answer(409, {"error": "fenced"})
        time.sleep(turn.get("hold_ms", 0) / 1000)
        self.answer(200, {"history_len": len(history), "epoch": int(epoch)})


http.server.ThreadingHTTPServer((host, int(port)), Agent).serve_forever()
