"""polynya's kernels: one folder per op with ``kernel.py`` (Triton only), ``op.py`` (checked
launcher) and ``reference.py`` (plain torch: the test oracle and the CPU fallback)."""
