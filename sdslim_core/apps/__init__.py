"""Flows that users run (each behind one CLI command, node or UI tab): slim, eval, fidelity, breakdown, demo."""
