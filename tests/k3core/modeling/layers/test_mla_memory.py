"""The plain forward of the k3-full sample grows linearly in memory with T (MLA no longer builds [T, T] scores).

Each length runs in a fresh subprocess on one thread; peak RSS growth is the peak RSS (VmHWM, reset through
/proc/self/clear_refs after a short warm-up forward) minus the RSS at that point. MALLOC_MMAP_THRESHOLD_
makes glibc map (and unmap) every large buffer, so the peak counts live tensors rather than what the heap
happened to keep.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
PROBE = """
import sys, torch
from k3core.modeling.model import K3ForCausalLM

def status_kb(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))

torch.set_num_threads(1)
model = K3ForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.randint(0, model.config.vocab_size, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    model(ids[:, :64])
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak (VmHWM) to the current RSS: loading's transient peak is not counted
    base = status_kb("VmRSS")
    model(ids)
print(status_kb("VmHWM") - base)
"""


def _peak_growth_kb(T: int) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "sample_checkpoints" / "k3-full"), str(T)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_forward_peak_memory_grows_linearly_with_length():
    at_4k, at_8k = _peak_growth_kb(4096), _peak_growth_kb(8192)
    assert at_4k > 0
    # quadratic scores would give 4x (and 2.7 GB at 8K before); linear gives about 2x
    assert at_8k <= 2.5 * at_4k, f"peak growth {at_4k} KB at 4096 tokens, {at_8k} KB at 8192"
    assert at_8k < 600_000, f"{at_8k} KB of peak growth at 8192 tokens for a 1.57M-parameter model"
