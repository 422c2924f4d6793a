"""Markers for tests that need one of torch's CPU kernels (this project's torch build has them: they run in CI)."""

import pytest

from engine.weights.int4 import kernel_unavailable

CPU_FAST = kernel_unavailable("cpu_int4pack", "cpu")
needs_cpu_kernel = pytest.mark.skipif(CPU_FAST is not None, reason=f"no CPU int4 kernel: {CPU_FAST}")
