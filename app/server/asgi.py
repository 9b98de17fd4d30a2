"""The app as an ASGI application (Streamlit's ``st.App``), what ``app.server.serve`` runs: app/main.py, its HTML
document with the element chunks preloaded (``app.server.chunk_preload``). ``streamlit run`` finds ``app`` here."""

from __future__ import annotations

import streamlit as st
from starlette.middleware import Middleware

from app.server.chunk_preload import PreloadChunks
from app.server.serve import MAIN

app = st.App(str(MAIN), middleware=[Middleware(PreloadChunks)])
