"""Shared pytest setup: load the Hypothesis profile (dev / ci / deep, see twell.testing)."""

from twell.testing.profiles import load_profile

PROFILE = load_profile()


def pytest_report_header(config):  # noqa: ANN001, ANN201, ARG001 - pytest hook
    return f"hypothesis profile: {PROFILE} (set TWELL_HYPOTHESIS_PROFILE to change)"
