"""``GET /v1/users/{user_id}/recommendations`` answered in plain ASGI, in front of the FastAPI app.

Why: a lookup from the published lists is little work (a binary search or one Redis call, and a small
JSON body), but FastAPI's middleware stack, routing, parameter validation and response classes cost
several times that again on every request: most of the frontend's CPU per answer was the framework
(measured with py-spy: docs/on-demand.md, "Lookups from the published lists against on demand"). Applications call this one route thousands of times a
second, so it gets a path of its own; everything else, and every unusual form of this route, goes to the
FastAPI app unchanged.

What it answers itself: a well-formed GET (``user_id`` a plain decimal 64-bit integer; ``top_n`` absent or
plain digits in 1..``scoring.top_n``; ``fresh`` absent or false). The answer is
:meth:`recsys.serve.app.Service.answer` and :meth:`~recsys.serve.app.Service.reply`, exactly as the
FastAPI route computes it (store first, on demand for users the lists miss, the same errors, the same
metrics) and the same JSON bytes. What it hands to FastAPI: any other method or path, a malformed or
out-of-range parameter (FastAPI's 400 names it), ``fresh=true``, repeated parameters; the OpenAPI
description still lists the route, from FastAPI's declaration of it.
"""
from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

PREFIX = "/v1/users/"
SUFFIX = "/recommendations"
INT64 = 2 ** 63          # user ids are 64-bit integers: -INT64 <= id < INT64 (both routes check it)
# what pydantic reads as False in a query parameter (FastAPI's ``fresh: bool``); anything else goes to FastAPI
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def encode(content: Any) -> bytes:
    """JSON bytes exactly as Starlette's ``JSONResponse`` renders them."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def parse(path: str, query: bytes, max_top_n: int) -> tuple[int, int | None] | None:
    """``(user_id, top_n or None)`` of a well-formed lookup; None when FastAPI should handle the request."""
    if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
        return None
    text = path[len(PREFIX):-len(SUFFIX)]
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
        return None
    user = int(text)
    if not -INT64 <= user < INT64:
        return None
    top_n = None
    if query:
        try:
            pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True, strict_parsing=True)
        except ValueError:
            return None
        names = [k for k, _ in pairs]
        if len(set(names)) != len(names):
            return None
        for name, value in pairs:
            if name == "top_n":
                if not (value.isascii() and value.isdigit()) or len(value) > 6 or not 1 <= int(value) <= max_top_n:
                    return None
                top_n = int(value)
            elif name == "fresh":
                if value.lower() not in _FALSE:
                    return None
    return user, top_n


class LookupRoute:
    """The ASGI app ``recsys serve`` runs: one-user lookups here, the rest (and lifespan) in ``api``."""

    def __init__(self, api: ASGIApp, service: Any) -> None:
        self.api = api
        self.service = service
        self._top_n = service.cfg.scoring.top_n
        self._timeout_s = service.cfg.serve.request_timeout_s

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            return await self.api(scope, receive, send)
        parsed = parse(scope["path"], scope["query_string"], self._top_n)
        if parsed is None:
            return await self.api(scope, receive, send)
        arrived = time.monotonic()
        user, top_n = parsed
        service = self.service
        status, body = await service.answer([user], top_n or self._top_n, False, self._timeout_s)
        code, extra, content = service.reply(status, body, arrived, 1, single=True)
        payload = encode(content)
        headers = [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
        if extra:
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


__all__ = ["LookupRoute", "encode", "parse"]
