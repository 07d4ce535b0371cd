"""Hypothesis profiles.

``ci`` (the default): derandomized, so the suite draws the same examples on every run and a CI
result can be reproduced. ``explore``: fresh random examples on every run, to look for new failures:
``HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest``.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
