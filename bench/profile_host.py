"""The queued host timer under its old name, for bench/dev_host_replay.py's import only:
the timer is :func:`twell.timing.host_us_queued`. Remove once that probe imports it."""

from twell.timing import host_us_queued as host_us

__all__ = ["host_us"]
