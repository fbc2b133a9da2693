"""Examples each property ran, for the nightly report (scripts/nightly.py): hypothesis prints
no statistics for a @given nested inside a parametrized test, so such tests count their own
calls here; conftest.py writes the counts to $DCP_EXAMPLE_COUNTS (JSON) when the session ends."""

import collections

EXAMPLES: collections.Counter = collections.Counter()
