"""The plain-ASGI lookup route in front of FastAPI (recsys.serve.lookup_route): it answers well-formed one-user
lookups byte for byte as the FastAPI route does, counts them the same way, and hands every other request to
FastAPI. In process, on an embedded index of a small published partition (no Spark, no server)."""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from recsys.config import load_config  # noqa: E402
from recsys.serve.app import create_app  # noqa: E402
from recsys.serve.lists import EmbeddedLists  # noqa: E402
from recsys.serve.lookup_route import parse  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
USERS, TOP_N = 50, 20


def _write_partition(root: Path) -> None:
    """benchmarks/export_load.py's synthetic published partition (the output contract, _SUCCESS, manifest)."""
    spec = importlib.util.spec_from_file_location("export_load", REPO / "benchmarks" / "export_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_partition(root, USERS, TOP_N, 500, 1)


@pytest.fixture(scope="module")
def route(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup-route")
    _write_partition(root / "out")
    cfg = load_config(None, [f"paths.output={root / 'out'}", "serve.store=embedded", "output.table=null",
                             f"scoring.top_n={TOP_N}", f"serve.backend_dir={root / 'backend'}"])
    app = create_app(cfg, lambda: "sc://127.0.0.1:1")
    app.service.lists = EmbeddedLists(cfg.paths.output)     # what the app's start-up does, without a backend
    assert app.service.lists.refresh()
    return app


def _get(app, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path)
    return asyncio.run(go())


def _count(app, code: str) -> float:
    return app.service.metrics.registry.get_sample_value("recsys_serve_requests_total", {"code": code}) or 0.0


class _Counting:
    """The FastAPI app, counting the requests the lookup route hands to it."""

    def __init__(self, api):
        self.api, self.calls = api, 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await self.api(scope, receive, send)


def _handed_on(route, path: str) -> tuple[httpx.Response, int]:
    """GET ``path`` through the lookup route: the answer, and how many requests it handed to FastAPI."""
    api, route.api = route.api, _Counting(route.api)
    try:
        return _get(route, path), route.api.calls
    finally:
        route.api = api


@pytest.mark.parametrize("path", [
    "/v1/users/5/recommendations",
    "/v1/users/7/recommendations?top_n=3",
    "/v1/users/7/recommendations?top_n=3&fresh=false",
    f"/v1/users/{10 ** 12}/recommendations",                 # not listed: the version's fallback list
    "/v1/users/-4/recommendations?top_n=1",
])
def test_a_well_formed_lookup_gets_the_fastapi_route_s_exact_answer_and_is_counted(route, path):
    before = _count(route, "200")
    fast, handed_on = _handed_on(route, path)
    assert handed_on == 0                                     # answered by the lookup route itself
    assert _count(route, "200") == before + 1
    slow = _get(route.api, path)                              # the FastAPI app alone
    assert fast.status_code == slow.status_code == 200
    assert fast.content == slow.content
    assert fast.headers["content-type"] == slow.headers["content-type"] == "application/json"
    assert int(fast.headers["content-length"]) == len(fast.content)
    body = fast.json()
    assert body["served_from"] == "embedded" and body["date"] == "2024-06-15"
    assert len(body["recommendations"]) == (3 if "top_n=3" in path else 1 if "top_n=1" in path else TOP_N)


@pytest.mark.parametrize("path, status, says", [
    ("/v1/users/abc/recommendations", 400, "user_id"),
    ("/v1/users/5/recommendations?top_n=0", 400, "top_n = 0 is out of range"),
    (f"/v1/users/5/recommendations?top_n={TOP_N + 1}", 400, "out of range"),
    ("/v1/users/5/recommendations?top_n=x", 400, "top_n"),
    (f"/v1/users/{2 ** 63}/recommendations", 400, "not a 64-bit integer"),
    ("/v1/users/5/recommendations?fresh=true", 503, "backend"),        # fresh lists need the on-demand backend
])
def test_anything_else_is_answered_by_fastapi_with_its_error(route, path, status, says):
    (fast, handed_on), slow = _handed_on(route, path), _get(route.api, path)
    assert handed_on == 1
    assert fast.status_code == slow.status_code == status
    assert says in fast.json()["detail"]
    assert fast.content == slow.content


def test_the_parser_takes_only_the_plain_forms():
    assert parse("/v1/users/42/recommendations", b"", 20) == (42, None)
    assert parse("/v1/users/42/recommendations", b"top_n=5&fresh=no&other=1", 20) == (42, 5)
    assert parse("/v1/users/-9223372036854775808/recommendations", b"", 20) == (-2 ** 63, None)
    for path, query in [("/v1/users/9223372036854775808/recommendations", b""),
                        ("/v1/users/+1/recommendations", b""), ("/v1/users/1.0/recommendations", b""),
                        ("/v1/users//recommendations", b""), ("/v1/users/1/2/recommendations", b""),
                        ("/v1/users/1/recommendations", b"top_n=5&top_n=6"),
                        ("/v1/users/1/recommendations", b"fresh=1"), ("/v1/users/1/recommendations", b"top_n=21"),
                        ("/v1/users/\u0661/recommendations", b""), ("/v2/users/1/recommendations", b"")]:
        assert parse(path, query, 20) is None, (path, query)
