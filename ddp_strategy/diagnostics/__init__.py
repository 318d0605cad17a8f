"""Diagnostics: what global rank 0 tells the user about a fit (summary, batch-size warnings, communication).

Owns: reading numbers from a running Trainer and DDP's own timers, and turning them into messages. Must not
touch: the process group's lifetime, loaders or checkpoints (it only reads them). Entry point for the
strategy: :class:`FitDiagnostics`; the pure message functions are public for the notebook.
"""

from ddp_strategy.diagnostics.communication import COMM_DOMINATES_FRACTION, CommStats, communication_messages
from ddp_strategy.diagnostics.record import FitDiagnostics, FitRecord, GradientTracker, on_fit_end, on_fit_start
from ddp_strategy.diagnostics.summary import FitSummary, batch_size_warnings, collect_fit_summary

__all__ = [
    "COMM_DOMINATES_FRACTION",
    "CommStats",
    "FitDiagnostics",
    "FitRecord",
    "FitSummary",
    "GradientTracker",
    "batch_size_warnings",
    "collect_fit_summary",
    "communication_messages",
    "on_fit_end",
    "on_fit_start",
]
