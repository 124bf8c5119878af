"""What the host CPU can do, read once from /proc/cpuinfo (Linux; elsewhere: nothing).

Used where a kernel choice depends on an instruction set torch does not report:
native bfloat16 arithmetic (AVX512-BF16, AMX-BF16) for `--dtype auto`, and
AVX512-VNNI for the int8 kernels' activation range.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# `--dtype auto` on CPU picks bfloat16 where the CPU multiplies it natively;
# DPSERVE_CPU_BF16=0 keeps float32 there (the test suite sets it, so greedy
# outputs compare with transformers' float32 on every machine).
CPU_BF16_ENV = "DPSERVE_CPU_BF16"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags ("avx2", "avx512_bf16", ...)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    """Whether bfloat16 matrix products run natively (AVX512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def auto_cpu_dtype() -> str:
    """`--dtype auto` on CPU: bfloat16 with native support (about 1.6-2x faster
    linears than float32 here, bench/roofline.py), else float32."""
    if os.environ.get(CPU_BF16_ENV, "1") != "0" and native_bf16():
        return "bfloat16"
    return "float32"
