"""app.server.chunk_preload: which chunks are preloaded (an element's chunk and its static imports, read from the
built files) and the ASGI middleware that adds the tags to the HTML document only. The browser's side (the chunk is
fetched before the websocket opens) is in tests/app/test_browser.py."""

from __future__ import annotations

import asyncio

from app.server.chunk_preload import ELEMENT_CHUNKS, STATIC_JS, PreloadChunks, chunk_files, with_preloads


def _chunks(folder, files: dict[str, str]):
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_an_elements_chunk_and_its_static_imports_transitively_not_its_lazy_ones(tmp_path):
    js = _chunks(
        tmp_path,
        {
            "PlotlyChart.Ab1-x.js": 'import{a as b}from"./dep.X1.js";import"./side.Y2.js";'
            'const m=()=>import("./lazy.Z3.js");',
            "dep.X1.js": 'import{c}from"./deeper.W4.js";import{a}from"./dep.X1.js";',  # a cycle is read once
            "side.Y2.js": "",
            "deeper.W4.js": 'import{q}from"./missing.Q9.js";',  # a name without a file is left out
            "lazy.Z3.js": "",
            "PlotlyChartWide.Qq.js": "",  # another element whose name starts the same
            "Table.T7.js": 'import{a}from"./dep.X1.js";',
        },
    )
    assert chunk_files(js, ["PlotlyChart"]) == ["PlotlyChart.Ab1-x.js", "dep.X1.js", "side.Y2.js", "deeper.W4.js"]
    both = chunk_files(js, ["PlotlyChart", "Table"])  # the elements' chunks first, then what they import; dep once
    assert both == ["PlotlyChart.Ab1-x.js", "Table.T7.js", "dep.X1.js", "side.Y2.js", "deeper.W4.js"]
    assert chunk_files(js, ["Absent"]) == []


def test_the_installed_streamlit_has_the_preloaded_chunks():
    """The names follow Streamlit's build: each element's chunk exists in the installed package."""
    names = chunk_files(STATIC_JS, ELEMENT_CHUNKS)
    for element in ELEMENT_CHUNKS:
        assert any(name.startswith(f"{element}.") for name in names), (element, names[:5])


def test_tags_go_before_the_head_end_and_skip_what_the_document_names():
    html = b'<html><head><link rel="modulepreload" href="./static/js/a.1.js"></head><body></body></html>'
    out = with_preloads(html, ["a.1.js", "b.2.js"])
    assert out.count(b"a.1.js") == 1
    assert b'<link rel="modulepreload" crossorigin href="./static/js/b.2.js"></head>' in out
    assert with_preloads(b"<p>no head</p>", ["b.2.js"]) == b"<p>no head</p>"


def _serve(middleware: PreloadChunks, method: str = "GET") -> tuple[dict, bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "http", "method": method, "path": "/"}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return dict(start["headers"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _app(content_type: bytes, parts: list[bytes], extra: list[tuple[bytes, bytes]] = ()):
    async def app(scope, receive, send):
        length = str(sum(map(len, parts))).encode()
        headers = [(b"content-type", content_type), (b"content-length", length), *extra]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    return app


def test_the_middleware_rewrites_the_html_document_and_its_length_only(tmp_path):
    js = _chunks(tmp_path, {"PlotlyChart.H1.js": ""})
    document = [b"<html><head><title>k</title>", b"</head><body></body></html>"]  # sent in two parts

    headers, body = _serve(PreloadChunks(_app(b"text/html; charset=utf-8", document), js_dir=js))
    assert b'href="./static/js/PlotlyChart.H1.js"></head>' in body
    assert int(headers[b"content-length"]) == len(body)

    script = [b'console.log("</head>")']
    headers, body = _serve(PreloadChunks(_app(b"application/javascript", script), js_dir=js))
    assert body == script[0] and headers[b"content-length"] == str(len(script[0])).encode()

    gzipped = PreloadChunks(_app(b"text/html", [b"\x1f\x8b..."], [(b"content-encoding", b"gzip")]), js_dir=js)
    assert _serve(gzipped)[1] == b"\x1f\x8b..."  # compressed bytes are never edited

    headers, body = _serve(PreloadChunks(_app(b"text/html", document), js_dir=js), method="HEAD")
    assert headers[b"content-length"] == str(sum(map(len, document))).encode()  # a HEAD answer keeps its length

    nothing = PreloadChunks(_app(b"text/html", document), js_dir=tmp_path / "no-static-folder")
    assert _serve(nothing)[1] == b"".join(document)
