"""Start the app's Streamlit server with its libraries already imported (``python -m app.server.serve [options]``).

``streamlit run app/main.py`` imports torch, plotly, pandas and k3lab only when the first browser
session runs the script: about 4 s on a 2-core machine, all of it in front of the first user's first
chart. Here the server process imports them (and builds one model on the meta device, which pulls in
the rest of what a checkpoint load needs) before it starts listening, so a session starts warm, and its
malloc gives freed memory back (``app.server.process_memory.limit_heap_retention``). The arguments after
``app.server.serve`` are those of ``streamlit run`` (``--server.port 8501`` ...).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().parent.parent / "main.py"
_ROOT = str(MAIN.parent.parent)


def preload() -> None:
    """Import what the first script run needs, build a small model on the meta device, and one figure as the app
    builds and sends it (plotly imports its validators and encoders on first use: 0.1-0.15 s of the first chart)."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    # Not app.*: their Streamlit caches are made when the server's runtime exists.
    import pandas  # noqa: F401 - imported to warm the module cache
    import plotly.graph_objects  # noqa: F401
    import plotly.io
    import torch

    import analysis.metrics.headline  # noqa: F401
    import analysis.runs.loading  # noqa: F401
    from analysis.figures.density import build_allocation
    from analysis.runs.context import AnalysisContext
    from analysis.views.catalogue import all_views
    from k3core.interp.trace import Trace
    from k3core.modeling.model import K3ForCausalLM

    all_views()
    model = K3ForCausalLM.from_config("k3-nano", device="meta", dtype=torch.float32)
    figure, _ = build_allocation(AnalysisContext(trace=Trace(), config=model.config, label="preload"))
    plotly.io.to_json(figure)


def main(argv: list[str] | None = None) -> int:
    from streamlit.web import cli

    preload()
    # what the server imported lives as long as it does: out of every later full collection's walk
    gc.freeze()
    from app.server.process_memory import limit_heap_retention

    limit_heap_retention()
    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["streamlit", "run", str(MAIN), *args]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
