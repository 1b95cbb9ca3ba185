"""Deprecated location (kept one release): the torch-only quantizers moved to `portable_rl.engines.quantize`.

Only engines use them (SGLang's blockwise FP8, the fake_quant engine), so they live on the engine side,
which never imports JAX. This name is the same module object, so imports and attribute patches of either
name agree.
"""

import sys
import warnings

from portable_rl.engines import quantize as _moved

warnings.warn("portable_rl.convert.quantize moved to portable_rl.engines.quantize; the old name goes in the next "
              "release", FutureWarning, stacklevel=2)
sys.modules[__name__] = _moved
