"""Deprecated location (kept one release): bucketing moved to `portable_rl.engines.buckets`.

Pushes are one flat (name, tensor) iterator now and each adapter buckets for its own transport, so the
bucketing helpers are engine-side. This name is the same module object as the new one.
"""

import sys
import warnings

from portable_rl.engines import buckets as _moved

warnings.warn("portable_rl.convert.buckets moved to portable_rl.engines.buckets; the old name goes in the next "
              "release", FutureWarning, stacklevel=2)
sys.modules[__name__] = _moved
