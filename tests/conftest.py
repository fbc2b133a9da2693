import json
import os

from hypothesis import HealthCheck, settings

# ci: 30 examples per property, derandomized so that CI runs the same examples every time
# (a new failure comes from a code change, never from luck); nightly explores: 10,000 random
# examples per property (in CI, searching planners get a third: tests/test_properties.py). dev: quick.
# Choose with HYPOTHESIS_PROFILE=ci|nightly|dev (default ci).
settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionfinish(session, exitstatus):
    """Write tests/counts.py's example counts where $DCP_EXAMPLE_COUNTS says (nightly report)."""
    from tests.counts import EXAMPLES

    path = os.environ.get("DCP_EXAMPLE_COUNTS")
    if path and EXAMPLES:
        with open(path, "w") as f:
            json.dump(dict(sorted(EXAMPLES.items())), f, indent=1)
