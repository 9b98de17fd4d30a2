"""Fault injection for tests/k3core/distributed/test_pipeline.py, kept out of the library:

    torchrun ... -m tests.pipeline_fault RANK:LAYER:die|hang  TRACE-ARGS...

runs ``k3lab trace TRACE-ARGS`` with rank RANK killed (SIGKILL, as an out-of-memory kill) or hung when it reaches
decoder layer LAYER, after saying so on stderr with the time, so the test can measure how long the other ranks
take to stop."""

from __future__ import annotations

import os
import signal
import sys
import time

from k3core.modeling.model import K3DecoderLayer
from k3lab.cli import main as k3lab


def inject(rank: int, layer: int, kind: str) -> None:
    """Make this process's rank ``rank`` die or hang on entering decoder layer ``layer``."""
    forward = K3DecoderLayer.forward

    def faulty(self, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) == rank and self.layer_idx == layer:
            print(f"k3lab trace: rank {rank}: injected fault ({kind}) at layer {layer} at t={time.time():.3f}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10**6)
        return forward(self, *args, **kwargs)

    K3DecoderLayer.forward = faulty


if __name__ == "__main__":
    rank, layer, kind = sys.argv[1].split(":")
    inject(int(rank), int(layer), kind)
    sys.exit(k3lab(["trace", *sys.argv[2:]]))
