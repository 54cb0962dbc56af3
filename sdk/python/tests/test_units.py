"""Pure functions: the SSE parser, directives, typed errors, bodies, the demo's input."""

from __future__ import annotations

import json
import uuid

import pytest

import leasehold
from leasehold._policy import (
    TURN_ID_NAMESPACE,
    check_key,
    directive_of,
    encode_body,
    error_for,
    turn_id_for,
)
from leasehold.agent import to_response
from leasehold.demo_agent import BadInput, Input, default_node_id, split_listen
from leasehold.models import Event, TurnAnswer, TurnInfo, event_from_frame
from leasehold.sse import Frame, SSEParser


def frames(*chunks: str) -> list[Frame]:
    parser = SSEParser()
    out: list[Frame] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    return out


def test_sse_frames_split_anywhere_with_comments_and_every_line_ending() -> None:
    text = (
        ': keep-alive\n\nid: 1-1\nevent: token\ndata: {"i":0}\n\n'
        "event: idle\ndata: {}\r\n\r\n"
        "id: 2-5\revent: x\rdata: a\rdata: b\r\r"
        "data:no-space\n\n"
    )
    expected = [
        Frame("1-1", "token", '{"i":0}'),
        Frame(None, "idle", "{}"),
        Frame("2-5", "x", "a\nb"),
        Frame(None, None, "no-space"),
    ]
    assert frames(text) == expected
    for size in (1, 2, 3, 7):  # the same stream cut into pieces, CRLF split included
        assert frames(*[text[i : i + size] for i in range(0, len(text), size)]) == expected


def test_sse_ignores_unknown_fields_and_a_leading_bom() -> None:
    assert frames("\ufeffretry: 10\nfoo: bar\nevent: e\ndata: x\n\n") == [Frame(None, "e", "x")]
    assert frames("\n\n: only comments\n\n") == []


def test_events_parse_json_and_ids() -> None:
    event = event_from_frame("3-7", "token", '{"a":\n1}')
    assert (event.epoch, event.seq, event.data, event.control) == (3, 7, {"a": 1}, False)
    control = event_from_frame(None, "overflow", '{"missed": 2}')
    assert control.control and control.epoch is None
    assert event_from_frame("x", None, "not json") == Event("x", "message", "not json")


def test_a_directive_comes_from_the_body_or_retry_after() -> None:
    body = b'{"error":"takeover_pending","retry":{"delay_ms":7250,"budget_ms":37250}}'
    d = directive_of(503, {"retry-after": "8"}, body, 30.0)
    assert d == leasehold.Directive(7250, 37250) and d.delay == 7.25
    assert directive_of(503, {"retry-after": "2"}, b"busy", 30.0) == leasehold.Directive(
        2000, 30000
    )
    assert directive_of(503, {}, b'{"error":"x"}', 30.0) is None, "no directive: no retry"
    assert directive_of(502, {"retry-after": "1"}, body, 30.0) is None, "only a 503 directs"
    assert directive_of(503, {}, b'{"retry":{"delay_ms":"1","budget_ms":2}}', 30.0) is None


def test_errors_are_typed_by_status_and_code() -> None:
    def err(status: int, body: dict[str, object]) -> leasehold.HttpError:
        return error_for(status, {}, json.dumps(body).encode())

    assert isinstance(err(409, {"error": "fenced"}), leasehold.Fenced)
    busy = err(409, {"error": "busy", "turn_id": "t-1"})
    assert isinstance(busy, leasehold.Busy) and busy.turn_id == "t-1"
    assert isinstance(err(409, {"error": "interrupted"}), leasehold.Interrupted)
    reused = err(422, {"error": "idempotency_key_reused"})
    assert (
        isinstance(reused, leasehold.IdempotencyKeyReused)
        and reused.code == "idempotency_key_reused"
    )
    failed = err(502, {"error": "owner_failed"})
    assert isinstance(failed, leasehold.OwnerFailed) and failed.directive is None
    assert isinstance(err(404, {"error": "not_found"}), leasehold.NotFound)
    other = err(418, {"error": "teapot"})
    assert type(other) is leasehold.HttpError and (other.status, other.code) == (418, "teapot")
    assert error_for(500, {}, b"plain").code is None
    assert all(isinstance(e, leasehold.LeaseholdError) for e in (busy, failed, other))


def test_bodies_keys_and_turn_ids() -> None:
    assert encode_body(b"\x00", None) == (b"\x00", "application/octet-stream")
    assert encode_body("hé", None) == ("hé".encode(), "text/plain; charset=utf-8")
    assert encode_body({"a": 1}, None) == (b'{"a":1}', "application/json")
    assert encode_body({"a": 1}, "application/vnd+json")[1] == "application/vnd+json"
    for good in ("a", "chat:42@x.y-z_", "k" * 200):
        assert check_key(good) == good
    for bad in ("", ".", "..", "a/b", "a b", "k" * 201, "ü"):
        with pytest.raises(ValueError, match="invalid session key"):
            check_key(bad)
    key = str(uuid.uuid4())
    assert turn_id_for(key) == key
    assert turn_id_for("order-1") == str(uuid.uuid5(TURN_ID_NAMESPACE, "order-1"))
    assert turn_id_for("order-1") == turn_id_for("order-1") != turn_id_for("order-2")


def test_turn_info_reads_the_contract_shape() -> None:
    answer = {"status": 200, "content_type": "application/json", "body": '{"a":1}'}
    info = TurnInfo.from_json(
        {"turn_id": "t", "state": "finished", "epoch": 2, "attempts": 2, "answer": answer}
    )
    assert info.finished and (info.epoch, info.attempts) == (2, 2)
    assert info.answer == TurnAnswer(200, "application/json", '{"a":1}')
    assert info.answer.json() == {"a": 1}
    running = TurnInfo.from_json({"turn_id": "t", "state": "running", "epoch": 1})
    assert not running.finished and running.answer is None and running.attempts is None


def test_the_demo_input_is_checked_like_the_rust_one() -> None:
    assert Input.parse(b"  \n") == Input()
    assert Input.parse(b'{"text":"hi","think_ms":5,"tokens":0,"extra":1}') == Input(
        "hi", None, 5, 0
    )
    assert Input.parse(b'{"tokens":null,"text":null}') == Input()
    for bad in (
        b"[1]",
        b"{",
        b'{"think_ms":-1}',
        b'{"tokens":"3"}',
        b'{"text":1}',
        b'{"think_ms":true}',
    ):
        with pytest.raises(BadInput):
            Input.parse(bad)


def test_the_demo_node_id_and_listen_address() -> None:
    assert default_node_id({"LEASEHOLD_NODE_ID": "n", "POD_NAME": "p", "HOSTNAME": "h"}) == "n"
    assert default_node_id({"POD_NAME": "p", "HOSTNAME": "h"}) == "p"
    assert default_node_id({"HOSTNAME": "h"}) == "h"
    assert default_node_id({}) == "demo"
    assert split_listen("127.0.0.1:3000") == ("127.0.0.1", 3000)
    assert split_listen("[::1]:3000") == ("::1", 3000)
    with pytest.raises(ValueError, match="--listen"):
        split_listen("3000")


def test_handler_replies_become_responses() -> None:
    assert (to_response({"a": 1}).status_code, to_response({"a": 1}).body) == (200, b'{"a":1}')
    assert to_response(None).status_code == 204
    assert to_response("hi").media_type == "text/plain"
    assert to_response(b"\x01").media_type == "application/octet-stream"
    created = to_response((201, [1, 2]))
    assert (created.status_code, created.body) == (201, b"[1,2]")
