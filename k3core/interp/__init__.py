"""Interpretability: hook points, the recorder, traces, interventions."""
