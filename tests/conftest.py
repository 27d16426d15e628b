"""Shared test setup: the Hypothesis profiles (the repository root is on sys.path through pytest's `pythonpath`).

Profiles: `ci` (derandomized, 200 examples, no deadline) and `nightly` (10,000 random examples).
HYPOTHESIS_PROFILE=nightly (or pytest's --hypothesis-profile) loads one globally; tests/spec/test_properties.py
applies the profile named by HYPOTHESIS_PROFILE, `ci` when unset.
"""

from __future__ import annotations

import os

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test dependency; modules that need it import it themselves
    settings = None

if settings is not None:
    settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("nightly", max_examples=10_000, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    # Only switch the global default when asked: other suites choose their own settings per test.
    if os.environ.get("HYPOTHESIS_PROFILE"):
        settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
