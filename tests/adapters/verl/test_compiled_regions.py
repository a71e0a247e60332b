"""The compiled regions (``polynya.compiled_layers``: training's compiled layers, the sampler's
compiled prefill) equal the eager decoder layers under verl's transformers pin (5.10 in this
environment; the main suite runs the same tests under 5.24): the lower end of
``compiled_layers.VERIFIED_TRANSFORMERS``."""
from __future__ import annotations

import transformers
from packaging.version import Version
from polynya.compiled_layers import VERIFIED_TRANSFORMERS

from tests.core.test_compiled_layers import (  # noqa: F401 - collected here, in verl's environment
    test_compiled_model_equals_eager,
    test_inductor_on_cpu_equals_eager,
)
from tests.engines.sample.test_compiled_prefill import test_compiled_prefill_equals_eager  # noqa: F401


def test_this_environment_is_inside_the_verified_range():
    low, high = VERIFIED_TRANSFORMERS
    assert Version(low) <= Version(transformers.__version__) < Version(high)
