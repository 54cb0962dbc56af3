"""Check real HTTP exchanges against the OpenAPI documents in docs/ (openapi.yaml: the
client API and the admin port; openapi-agent.yaml: the agent API and, as webhooks, the
routes an agent serves).

An answer passes when its route is documented, its status is documented for that route
(or is one every listener gives, `x-every-route`), its `Content-Type` is one the
response documents (no body when it documents none), its body matches the schema
(JSON Schema 2020-12, `$ref`s resolved inside the document) and every required header
is there and matches its schema. A request the sidecar sends an agent passes when its
path and method name a webhook (`x-path`), every required parameter is there, and every
`Leasehold-*` or `Idempotency-Key` header it carries is documented and matches.

`Coverage` records what was seen; `missing()` names every documented (route, status),
webhook and `error` code that no exchange produced, except the statuses marked
`x-not-on-loopback` and the codes listed in `x-codes-not-on-loopback` (a listed code
that was produced is named too: the list must not go stale).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOCS = Path(__file__).resolve().parents[3] / "docs"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", template)
    return re.compile(
        "^" + "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts) + "$"
    )


def _media(content_type: str | None) -> str | None:
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()


@dataclass(frozen=True)
class Exchange:
    """One answer as it came over the wire. `body` is None when it was not read (a stream)."""

    method: str
    path: str
    status: int
    headers: dict[str, str]
    body: bytes | None


class Undocumented(AssertionError):
    """An exchange the document does not describe."""


@dataclass
class Document:
    path: Path
    doc: dict[str, Any] = field(init=False)
    uri: str = field(init=False)
    registry: Registry[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.doc = yaml.safe_load(self.path.read_text())
        self.uri = f"urn:leasehold:{self.path.name}"
        resource: Resource[Any] = Resource.from_contents(
            self.doc, default_specification=DRAFT202012
        )
        self.registry = Registry().with_resource(self.uri, resource)

    # -- navigation --------------------------------------------------------------------------

    def at(self, pointer: str) -> Any:
        node: Any = self.doc
        for token in pointer.lstrip("/").split("/") if pointer else []:
            token = token.replace("~1", "/").replace("~0", "~")
            node = node[int(token)] if isinstance(node, list) else node[token]
        return node

    def deref(self, pointer: str) -> tuple[Any, str]:
        """The object at `pointer`, following `$ref`s of non-schema objects."""
        node = self.at(pointer)
        while isinstance(node, dict) and "$ref" in node:
            pointer = node["$ref"].removeprefix("#")
            node = self.at(pointer)
        return node, pointer

    def validate(self, instance: Any, schema_pointer: str, what: str) -> None:
        validator = jsonschema.Draft202012Validator(
            {"$ref": f"{self.uri}#{schema_pointer}"}, registry=self.registry
        )
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
        if errors:
            detail = "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
            raise Undocumented(f"{what}: does not match {schema_pointer}: {detail}")

    def operations(self) -> list[tuple[str, str, str]]:
        """(method, path template, pointer) of every operation under `paths`."""
        out = []
        for template, item in self.doc.get("paths", {}).items():
            for method in METHODS:
                if method in item:
                    out.append((method, template, f"/paths/{_escape(template)}/{method}"))
        return out

    def webhooks(self) -> list[tuple[str, str, str, str]]:
        """(name, method, path template from `x-path`, pointer) of every webhook."""
        out = []
        for name, item in self.doc.get("webhooks", {}).items():
            for method in METHODS:
                if method in item:
                    op = item[method]
                    out.append((name, method, op["x-path"], f"/webhooks/{name}/{method}"))
        return out

    def error_codes(self) -> set[str]:
        """Every `error` code a schema of the document names (an `enum` or a `const`)."""
        codes: set[str] = set()

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                error = (
                    node.get("properties", {}).get("error")
                    if isinstance(node.get("properties"), dict)
                    else None
                )
                if isinstance(error, dict):
                    codes.update(error.get("enum", []))
                    if "const" in error:
                        codes.add(error["const"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(self.doc)
        return codes

    def not_on_loopback(self, response_pointer: str) -> str | None:
        raw = self.at(response_pointer)
        resolved, _ = self.deref(response_pointer)
        reason = raw.get("x-not-on-loopback") or resolved.get("x-not-on-loopback")
        return str(reason) if reason else None

    # -- checks ------------------------------------------------------------------------------

    def find(self, method: str, path: str) -> tuple[str, str]:
        """(template, operation pointer) of the operation serving `method path`."""
        path = path.split("?", 1)[0]
        candidates = [
            (template, pointer)
            for m, template, pointer in self.operations()
            if m == method.lower() and _template_regex(template).match(path)
        ]
        if not candidates:
            raise Undocumented(f"{method} {path}: no such route in {self.path.name}")
        # The most specific template wins (fewest parameters).
        return min(candidates, key=lambda c: c[0].count("{"))

    def check(self, exchange: Exchange) -> tuple[str | None, str]:
        """Raise `Undocumented` unless the exchange is documented. Returns the route's
        template and the status when the route documents the status, else (None, status)
        for an answer every listener gives (`x-every-route`)."""
        what = f"{exchange.method} {exchange.path} -> {exchange.status}"
        status = str(exchange.status)
        every_route = self.doc.get("x-every-route", {})
        try:
            template, op_pointer = self.find(exchange.method, exchange.path)
        except Undocumented:
            # An unknown path, or a known one with another method, is answered alike
            # everywhere; anything else on an undocumented route is undocumented.
            path = exchange.path.split("?", 1)[0]
            known_path = any(_template_regex(t).match(path) for _, t, _ in self.operations())
            wrong = (status == "404" and not known_path) or (status == "405" and known_path)
            if wrong and status in every_route:
                self.check_response(exchange, f"/x-every-route/{status}", what)
                return None, status
            raise
        responses = self.at(op_pointer)["responses"]
        candidates = []
        if status in responses:
            candidates.append((template, f"{op_pointer}/responses/{status}"))
        if status in every_route:
            candidates.append((None, f"/x-every-route/{status}"))
        if not candidates:
            raise Undocumented(
                f"{what}: status {status} is not documented for {exchange.method} {template} "
                f"in {self.path.name} (documented: {sorted(responses)})"
            )
        first_error: Undocumented | None = None
        for found, pointer in candidates:
            try:
                self.check_response(exchange, pointer, what)
                return found, status
            except Undocumented as e:
                first_error = first_error or e
        assert first_error is not None
        raise first_error

    def check_response(self, exchange: Exchange, pointer: str, what: str) -> None:
        response, pointer = self.deref(pointer)
        headers = {k.lower(): v for k, v in exchange.headers.items()}
        for name in response.get("headers", {}):
            header, header_pointer = self.deref(f"{pointer}/headers/{_escape(name)}")
            value = headers.get(name.lower())
            if value is None:
                if header.get("required"):
                    raise Undocumented(f"{what}: required header {name} is missing")
                continue
            self.validate(value, f"{header_pointer}/schema", f"{what}: header {name}")
        content = response.get("content")
        media = _media(headers.get("content-type"))
        if not content:
            if exchange.body:
                raise Undocumented(f"{what}: a body ({media}) where none is documented")
            return
        key = next(
            (
                k
                for k in content
                if k == media
                or k == "*/*"
                or (k.endswith("/*") and media and media.startswith(k[:-1]))
            ),
            None,
        )
        if key is None:
            raise Undocumented(f"{what}: Content-Type {media} is not one of {sorted(content)}")
        if exchange.body is None:
            return
        schema_pointer = f"{pointer}/content/{_escape(key)}/schema"
        if media and (media == "application/json" or media.endswith("+json")):
            try:
                instance = json.loads(exchange.body)
            except ValueError as e:
                raise Undocumented(f"{what}: the body is not JSON: {e}") from e
            self.validate(instance, schema_pointer, f"{what}: body")
        elif key != "*/*" and media and media.startswith("text/"):
            self.validate(exchange.body.decode(), schema_pointer, f"{what}: body")

    def check_webhook(self, method: str, raw_path: str, headers: dict[str, str]) -> str:
        """Raise `Undocumented` unless a request to an agent is a documented webhook; its name."""
        path = raw_path.split("?", 1)[0]
        matches = [
            (name, pointer)
            for name, m, template, pointer in self.webhooks()
            if m == method.lower() and _template_regex(template).match(path)
        ]
        if not matches:
            raise Undocumented(f"{method} {path}: no webhook of {self.path.name} has this path")
        name, pointer = matches[0]
        headers = {k.lower(): v for k, v in headers.items()}
        documented = set()
        for i, _ in enumerate(self.at(pointer).get("parameters", [])):
            param, param_pointer = self.deref(f"{pointer}/parameters/{i}")
            if param["in"] != "header":
                continue
            lower = param["name"].lower()
            documented.add(lower)
            value = headers.get(lower)
            if value is None:
                if param.get("required"):
                    raise Undocumented(f"{method} {path} ({name}): header {param['name']} missing")
                continue
            self.validate(value, f"{param_pointer}/schema", f"{method} {path}: header {lower}")
        for lower in headers:
            if (
                lower.startswith("leasehold-") or lower == "idempotency-key"
            ) and lower not in documented:
                raise Undocumented(f"{method} {path} ({name}): header {lower} is not documented")
        return name


@dataclass
class Coverage:
    """What the running sidecars were seen to do, per document."""

    documents: list[Document]
    seen: set[tuple[str, str, str, str]] = field(default_factory=set)
    every_route_seen: set[tuple[str, str]] = field(default_factory=set)
    webhooks_seen: set[tuple[str, str]] = field(default_factory=set)
    codes_seen: set[tuple[str, str]] = field(default_factory=set)

    def document_for(self, name: str) -> Document:
        return next(d for d in self.documents if d.path.name == name)

    def record(self, document: Document, exchange: Exchange) -> None:
        template, status = document.check(exchange)
        code = _error_code(exchange)
        if code:
            self.codes_seen.add((document.path.name, code))
        if template is None:
            self.every_route_seen.add((document.path.name, status))
        else:
            self.seen.add((document.path.name, exchange.method.lower(), template, status))

    def record_webhook(
        self, document: Document, method: str, path: str, headers: dict[str, str]
    ) -> None:
        self.webhooks_seen.add((document.path.name, document.check_webhook(method, path, headers)))

    def missing(self) -> list[str]:
        out = []
        for document in self.documents:
            name = document.path.name
            for method, template, pointer in document.operations():
                for status in document.at(pointer)["responses"]:
                    if (name, method, template, status) in self.seen:
                        continue
                    if document.not_on_loopback(f"{pointer}/responses/{status}"):
                        continue
                    out.append(f"{name}: {method.upper()} {template} {status}")
            for status in document.doc.get("x-every-route", {}):
                if (name, status) not in self.every_route_seen and not document.not_on_loopback(
                    f"/x-every-route/{status}"
                ):
                    out.append(f"{name}: x-every-route {status}")
            for hook, _, _, _ in document.webhooks():
                if (name, hook) not in self.webhooks_seen:
                    out.append(f"{name}: webhook {hook}")
            excused = document.doc.get("x-codes-not-on-loopback", {})
            for code in sorted(document.error_codes()):
                seen = (name, code) in self.codes_seen
                if not seen and code not in excused:
                    out.append(f"{name}: error code {code}")
                if seen and code in excused:
                    out.append(f"{name}: {code} was produced: drop it from x-codes-not-on-loopback")
        return out


def _error_code(exchange: Exchange) -> str | None:
    if not exchange.body or not exchange.body.startswith(b"{"):
        return None
    try:
        body = json.loads(exchange.body)
    except ValueError:
        return None
    code = body.get("error") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def load() -> tuple[Document, Document]:
    return Document(DOCS / "openapi.yaml"), Document(DOCS / "openapi-agent.yaml")
