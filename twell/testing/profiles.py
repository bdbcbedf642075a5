"""Hypothesis profiles for twell's property tests.

Three profiles, chosen by :func:`load_profile`:

- ``dev`` (the default on a workstation): few examples, quick feedback.
- ``ci``: Hypothesis' built-in ``ci`` profile (derandomized, no database, no deadline,
  loaded automatically when the ``CI`` environment variable is set), extended with
  twell's example count and health-check settings — extended, not replaced.
- ``deep``: thousands of examples and no deadline, for a long hunt before a release or
  after touching the formats.

Select one with ``TWELL_HYPOTHESIS_PROFILE=deep pytest ...``; without it, ``ci`` is
used when ``CI`` is set and ``dev`` otherwise.

Example:
    In a ``conftest.py``::

        from twell.testing.profiles import load_profile

        load_profile()
"""

from __future__ import annotations

import os

from twell._optional import optional_dependency

with optional_dependency("hypothesis", "twell.testing.profiles"):
    from hypothesis import HealthCheck, settings
    from hypothesis.errors import InvalidArgument

__all__ = ["PROFILES", "ENVIRONMENT_VARIABLE", "register_profiles", "load_profile"]

#: The environment variable that names the profile to load.
ENVIRONMENT_VARIABLE = "TWELL_HYPOTHESIS_PROFILE"

#: The profiles :func:`register_profiles` defines.
PROFILES = ("dev", "ci", "deep")

# Strategies build NumPy arrays and draw many small integers: generation can be slow on
# a busy 2-core machine without anything being wrong with a test.
_SLOW_GENERATION = [HealthCheck.too_slow, HealthCheck.data_too_large]

_registered = False


def register_profiles() -> None:
    """Register the ``dev``, ``ci`` and ``deep`` profiles (idempotent)."""
    global _registered
    if _registered:
        return
    builtin_ci = settings.get_profile("ci")
    settings.register_profile(
        "dev",
        max_examples=25,
        deadline=1000,
        suppress_health_check=_SLOW_GENERATION,
    )
    settings.register_profile(
        "ci",
        builtin_ci,
        max_examples=100,
        suppress_health_check=_SLOW_GENERATION,
    )
    settings.register_profile(
        "deep",
        max_examples=2000,
        deadline=None,
        suppress_health_check=_SLOW_GENERATION,
    )
    _registered = True


def load_profile(name: str | None = None) -> str:
    """Register the profiles and load one; return its name.

    Args:
        name: the profile to load. ``None`` picks ``$TWELL_HYPOTHESIS_PROFILE`` if set,
            else ``"ci"`` when ``$CI`` is set, else ``"dev"``.

    Raises:
        ValueError: ``name`` (or the environment variable) is not a registered profile.
    """
    register_profiles()
    if name is None:
        name = os.environ.get(ENVIRONMENT_VARIABLE) or ("ci" if os.environ.get("CI") else "dev")
    try:
        settings.get_profile(name)
    except InvalidArgument:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}: expected a registered profile such as "
            f"{', '.join(PROFILES)}, got {name!r}"
        ) from None
    settings.load_profile(name)
    return name
