"""The defaults the library and the command line share, declared once.

The library's option classes (``ScanOptions``, ``RunOptions``, ``delayed.Settings``,
``fp16plan``, ``drift``) take their field defaults from here, and the CLI's option
declarations (``fpaudit.cli.options``) take theirs from here too, so ``--help``'s
``[default: X]`` is the library's default. Plain constants: importing this loads
nothing, so the layers below the CLI can read it.
"""

from __future__ import annotations

DEVICE = "auto"  # auto, cpu, cuda or cuda:N
SEED = 0
WINDOW = 1  # merge the records of W consecutive captured steps

SCAN_STEPS = 10
SCAN_EVERY = 1  # capture every K-th step only

RUN_CAPTURE_EVERY = 10  # record every backward op on every K-th step; 0: never
RUN_CAPTURE_AFTER_SKIP = 3  # capture (with its forward) the step after a skip, N times a run
RUN_MAX_BACKOFFS = 5  # more consecutive scale back-offs than this is a finding
RUN_MAX_SKIP_RATE = 0.02  # a higher skip rate after calibration is a finding

DRIFT_BINADES = 2  # warn when per-window recommendations span more binades than this

DELAYED_HISTORY_LENGTH = 1024  # FP8 delayed scaling: amax history length H
DELAYED_MARGIN = 0  # FP8 delayed scaling: margin in binades
DELAYED_AMAX_COMPUTE_ALGO = "max"  # max or most_recent

FP16_PLAN_STEPS = 4
FP16_PLAN_HEADROOM_BITS = 1  # keep amax * S at most 65504 / 2^H
FP16_PLAN_MAX_UNDERFLOW = 0.001

METRICS_TOP = 8  # dashboard metrics: modules with a series of their own
