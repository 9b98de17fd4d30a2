"""``k3lab patch``: activation patching from the command line (its parser and code live in k3lab/experiment.py)."""

from k3lab.experiment import patch_main as main

__all__ = ["main"]
