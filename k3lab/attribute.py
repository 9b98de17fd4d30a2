"""``k3lab attribute``: Captum attribution from the command line (its parser and code live in k3lab/experiment.py)."""

from k3lab.experiment import attribute_main as main

__all__ = ["main"]
