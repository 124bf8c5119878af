"""A streaming matrix-vector kernel for CPU decode steps of a few rows (`gemv.c`).

Why: a one-stream decode step reads every weight once for one token, so its
speed is memory bandwidth. oneDNN's packed kernels read a weight at 17-19 GB/s
at one row on this machine (bench/roofline.py), where the memory gives 27-33;
`gemv.c` reads the plain [out, in] matrix front to back with wide accumulators.
`layers.linear` runs it for steps of up to `MAX_ROWS` rows when the model kept
the plain weights (`available()`), oneDNN otherwise.

How it is built: at first use, with the host's C compiler (`cc -O3 -march=native
-fopenmp`), into a cache directory keyed by the source, the flags and the CPU
(`DPSERVE_KERNEL_CACHE`, default ~/.cache/dpserve/kernels), through a temporary
file and a rename, so engines starting together never load a half-written
library. No compiler, or a failed build: one warning, and oneDNN serves every
step. `DPSERVE_CPU_GEMV=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dpserve.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

GEMV_ENV = "DPSERVE_CPU_GEMV"
CACHE_ENV = "DPSERVE_KERNEL_CACHE"
# Rows routed to the kernel: at one row it reads weights at 27-31 GB/s where oneDNN
# reads 13-20; at two they are about level, from three oneDNN is faster (the kernel
# takes up to four; bench/roofline.py measures both).
MAX_ROWS = 1
_SOURCE = Path(__file__).with_name("gemv.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120


def enabled() -> bool:
    """Whether the kernel may be used (DPSERVE_CPU_GEMV is not "0")."""
    return os.environ.get(GEMV_ENV, "1") != "0"


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dpserve" / "kernels")


def library_path(compiler: str) -> Path:
    """Where the library built from this source, with these flags, for this CPU lives."""
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(),
                 " ".join(sorted(cpu_flags())).encode()):
        key.update(part)
    return _cache_dir() / f"dpserve_gemv-{key.hexdigest()[:16]}.so"


def build(compiler: str | None = None) -> Path:
    """Compile gemv.c (if not cached already) and return the library's path.

    Raises RuntimeError naming the compiler's complaint."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (cc, gcc; or set CC)")
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, target)  # atomic: a concurrent build just replaces it again
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{compiler} did not finish in {BUILD_TIMEOUT_S} s") from e
    except OSError as e:  # not there, not executable
        raise RuntimeError(f"cannot run {compiler}: {e.strerror}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        logger.warning("CPU decode kernel unavailable, oneDNN runs every step: %s", e)
        return None
    fn = lib.dpserve_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel is enabled and built (builds it on first call)."""
    return enabled() and _library() is not None


_DTYPES = (torch.float32, torch.bfloat16)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T -> [rows, out] in x's dtype (rows <= MAX_ROWS;
    CPU tensors, float32 or bfloat16; `available()` must be true)."""
    lib = _library()
    assert lib is not None and x.dtype in _DTYPES and weight.dtype in _DTYPES
    assert weight.is_contiguous() and x.shape[1] == weight.shape[1]
    rows, k_len = x.shape
    n_len = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n_len, dtype=x.dtype)
    status = lib.dpserve_gemv(weight.data_ptr(), int(weight.dtype == torch.bfloat16),
                              x.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
                              rows, n_len, k_len, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"dpserve_gemv failed for {rows} x {k_len} @ {tuple(weight.shape)}")
    return out
