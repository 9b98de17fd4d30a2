"""For tests/k3core/distributed/test_pipeline_items.py, kept out of the library:

    torchrun ... -m tests.pipeline_what WHAT TRACE-ARGS...

runs ``k3lab trace TRACE-ARGS`` under torchrun recording ``what`` = WHAT ("default", "all" or items joined by
commas) instead of the command's "all"."""

from __future__ import annotations

import functools
import sys

from analysis.runs import trace_writer
from k3lab.cli import main as k3lab

if __name__ == "__main__":
    what = sys.argv[1] if sys.argv[1] in ("default", "all") else tuple(sys.argv[1].split(","))
    trace_writer.write_pipeline_traces = functools.partial(trace_writer.write_pipeline_traces, what=what)
    sys.exit(k3lab(["trace", *sys.argv[2:]]))
