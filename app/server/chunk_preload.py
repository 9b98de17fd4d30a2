"""Streamlit's element code fetched with the page: ``<link rel="modulepreload">`` tags added to its HTML document.

Streamlit's frontend fetches an element's code (a JS chunk: plotly's is 4.7 MB, the table's pulls in an Arrow
reader) only when the first such element arrives from the script. On a cold open that is when the server is busiest:
the Overview's first chart is sent while the run loads and the forward pass runs, and the same Python process serves
the static files, so the chunk came 0.4-1.9 s later, was parsed, and then its imports were fetched the same way.
With these tags the browser fetches and parses the chunks while it loads Streamlit itself, when the server is idle;
it still evaluates each one only when an element needs it. Measured with ``benchmarks/bench_pages.py`` (cold open
to the first chart): see benchmarks/README.

``ELEMENT_CHUNKS`` names the elements whose chunks are preloaded; ``chunk_files`` adds every chunk they import
statically, read from the chunks themselves, so the list follows the installed Streamlit's build (hashed file
names). Where Streamlit's static folder or a chunk is missing, fewer tags (none) are added: the page works as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import streamlit

STATIC_JS = Path(streamlit.__file__).resolve().parent / "static" / "static" / "js"
# The two big chunks the first page (Overview) waits on: plotly (4.7 MB) for its charts and the syntax highlighter
# (1.6 MB) for the model card's code blocks. Not every element the page draws: with the small ones too (60 more
# chunks) the browser's six connections per host were busy with them, and the websocket opened 0.6 s later.
ELEMENT_CHUNKS = ("PlotlyChart", "StreamlitSyntaxHighlighter")
# a static import in a built chunk: `import{a as b}from"./x.js"` or `import"./x.js"`, not the lazy `import("./x.js")`
_STATIC_IMPORT = re.compile(rb'(?:\bfrom|\bimport)\s*"\./([\w.\-]+\.js)"')


def chunk_files(js_dir: Path, elements: Iterable[str]) -> list[str]:
    """File names of each element's chunk (``{element}.{hash}.js``), then every chunk those import statically,
    transitively (breadth first, each once)."""
    todo = [
        match.name
        for element in elements
        for match in sorted(js_dir.glob(f"{element}.*.js"))
        if re.fullmatch(rf"{re.escape(element)}\.[\w\-]+\.js", match.name)
    ]
    seen: list[str] = []
    while todo:
        name = todo.pop(0)
        if name in seen or not (js_dir / name).is_file():
            continue
        seen.append(name)
        todo.extend(m.decode() for m in _STATIC_IMPORT.findall((js_dir / name).read_bytes()))
    return seen


def preload_tags(html: bytes, names: Iterable[str]) -> bytes:
    """The ``<link rel="modulepreload">`` tags for these chunks that the document does not already name."""
    return b"".join(
        f'<link rel="modulepreload" crossorigin href="./static/js/{name}">'.encode()
        for name in names
        if f"/static/js/{name}".encode() not in html
    )


def with_preloads(html: bytes, names: Iterable[str]) -> bytes:
    """The HTML document with the preload tags before its ``</head>`` (unchanged without one)."""
    if b"</head>" not in html:
        return html
    return html.replace(b"</head>", preload_tags(html, names) + b"</head>", 1)


class PreloadChunks:
    """ASGI middleware: an uncompressed ``text/html`` response (Streamlit's index.html, served for "/" and each page's
    path) gets ``with_preloads``; every other response passes through untouched."""

    def __init__(self, app, js_dir: Path = STATIC_JS, elements: Iterable[str] = ELEMENT_CHUNKS) -> None:
        self.app = app
        self.names = chunk_files(js_dir, elements) if js_dir.is_dir() else []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "GET" or not self.names:
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def send_with_preloads(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = {key.lower(): value for key, value in message.get("headers", [])}
                html = headers.get(b"content-type", b"").startswith(b"text/html")
                if html and b"content-encoding" not in headers:
                    start = message  # held until the whole body is here: its length changes
                    return
            elif start is not None and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                html = with_preloads(b"".join(body), self.names)
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(html)).encode())]})
                await send({"type": "http.response.body", "body": html})
                return
            await send(message)

        await self.app(scope, receive, send_with_preloads)
