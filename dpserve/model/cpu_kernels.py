"""dpserve's own CPU kernels, in C (`gemv.c`, `decode_attention.c`, `fused_ops.c`,
`int8_gemm.c`, `decode_layers.c`): built, trusted, loaded, called.

Scope: the Python side of the kernels torch falls short on: `gemv` (steps of up
to `kernel_rows(dtype)` rows on plain weights, at memory speed),
`decode_attention` (straight from the paged cache), `add_rms_norm` and
`rotary_kv` (one pass each), `decode_layers` (a few-row decode step through every
layer in one call), `int8_pack` / `int8_linear` (`--quantization int8` with
AVX512-VNNI). The library is built at first use with the host's compiler
(`cc -O3 -march=native -fopenmp`; `DPSERVE_KERNEL_MARCH`), cached by sources,
flags and CPU (`DPSERVE_KERNEL_CACHE`, default ~/.cache/dpserve/kernels), and
loaded with ctypes. `DPSERVE_CPU_KERNELS=0` turns them off.

Invariants: no compiler, or a failed build, costs one warning and torch's
kernels serve every step; a library is written to a temporary file and renamed,
so engines starting together never load half of one; code is loaded only from a
cache directory of this user's alone and a file of this user's that is no
symlink and nobody else can write (`cache_safety`; else a private temporary
directory for this process).

Not here: when a layer calls which kernel (`dpserve.model.layers`, `llama`).

Design: docs/design/cpu-kernels.md
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

from dpserve.checkpoint.cache_safety import file_problem, private_dir
from dpserve.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

KERNELS_ENV = "DPSERVE_CPU_KERNELS"
CACHE_ENV = "DPSERVE_KERNEL_CACHE"
MAX_ROWS = 32  # the most rows `gemv` takes (gemv.c's MAX_MANY_ROWS)
_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("gemv.c", "decode_attention.c", "fused_ops.c", "int8_gemm.c",
                              "decode_layers.c"))
_HEADER = Path(__file__).with_name("cpu_kernels.h")  # included by each
MARCH_ENV = "DPSERVE_KERNEL_MARCH"  # the compiler's -march (default native)
BUILD_TIMEOUT_S = 120


def _flags() -> tuple[str, ...]:
    return ("-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp", "-shared",
            "-fPIC")


def enabled() -> bool:
    """Whether the kernels may be used (DPSERVE_CPU_KERNELS is not "0")."""
    return os.environ.get(KERNELS_ENV, "1") != "0"


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dpserve" / "kernels")


def find_compiler() -> str | None:
    """The C compiler builds use: $CC, else cc, else gcc (None: none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(compiler: str, cache_dir: Path | None = None) -> Path:
    """Where the library built from these sources, with these flags, for this CPU lives
    (in `cache_dir`, default the kernel cache)."""
    key = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*_SOURCES, _HEADER)), " ".join(_flags()).encode(),
                 compiler.encode(), " ".join(sorted(cpu_flags())).encode()):
        key.update(part)
    return (cache_dir or _cache_dir()) / f"dpserve_kernels-{key.hexdigest()[:16]}.so"


class UnsafeCacheError(RuntimeError):
    """The kernel cache directory is not this user's alone (`cache_safety`)."""


def build(compiler: str | None = None, cache_dir: Path | None = None) -> Path:
    """Compile the kernels (if not cached already) and return the library's path.

    Trust: the cache directory must be this user's alone (created 0700; else
    UnsafeCacheError), and a cached library a regular file of this user's that
    nobody else can write; one that is not (a symlink, another owner) is built
    again over it. Raises RuntimeError naming the compiler's complaint."""
    compiler = compiler or find_compiler()
    if not compiler:
        raise RuntimeError("no C compiler found (cc, gcc; or set CC)")
    cache_dir = cache_dir or _cache_dir()
    problem = private_dir(cache_dir)
    if problem is not None:
        raise UnsafeCacheError(f"the kernel cache {cache_dir} is {problem}")
    target = library_path(compiler, cache_dir)
    try:
        problem = file_problem(target)
    except FileNotFoundError:
        problem = "missing"
    if problem is None:
        return target
    if problem != "missing":
        logger.warning("not loading %s: it is %s; building it again", target, problem)
    _compile(compiler, target)
    return target


def _compile(compiler: str, target: Path) -> None:
    """Build into a temporary file beside `target`, then rename it over `target`."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_flags(), *map(str, _SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask: nobody else writes it
        os.replace(tmp, target)  # atomic: a concurrent build just replaces it again
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{compiler} did not finish in {BUILD_TIMEOUT_S} s") from e
    except OSError as e:  # the compiler is not there or not executable; a full disk
        raise RuntimeError(f"building {target.name} with {compiler}: {e.strerror}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    """The library from the cache; from a private temporary directory (built there,
    removed once loaded) when the cache directory cannot be trusted."""
    try:
        return ctypes.CDLL(str(build()))
    except UnsafeCacheError as e:
        logger.warning("%s: not loading dpserve's CPU kernels from it; building them in a "
                       "private temporary directory (set %s to a directory only this user "
                       "can write)", e, CACHE_ENV)
    with tempfile.TemporaryDirectory(prefix="dpserve-kernels-") as tmp:
        return ctypes.CDLL(str(build(cache_dir=Path(tmp))))


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = _load()
    except (RuntimeError, OSError) as e:
        logger.warning("dpserve's CPU kernels unavailable, torch's run every step: %s", e)
        return None
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dpserve_gemv.restype = cint
    lib.dpserve_gemv.argtypes = [ptr, cint, ptr, ptr, cint, i64, i64, i64, cint]
    lib.dpserve_decode_attention.restype = cint
    lib.dpserve_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, cint, i64, i64,
                                             i64, i64, i64, i64, ctypes.c_float, cint]
    lib.dpserve_add_rms_norm.restype = cint
    lib.dpserve_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, cint, i64, i64, ctypes.c_float,
                                         cint]
    lib.dpserve_rotary_kv.restype = cint
    lib.dpserve_rotary_kv.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, cint, i64, i64,
                                      i64, i64, cint]
    lib.dpserve_decode_layers.restype = cint
    lib.dpserve_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, cint,
                                          i64, i64, i64, i64, i64, i64, i64, i64,
                                          ctypes.c_float, ctypes.c_float, cint]
    lib.dpserve_int8_vnni.restype = cint
    lib.dpserve_int8_vnni.argtypes = []
    lib.dpserve_int8_pack.restype = cint
    lib.dpserve_int8_pack.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.dpserve_int8_linear.restype = cint
    lib.dpserve_int8_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, cint]
    return lib


def available() -> bool:
    """Whether the kernels are enabled and built (builds them on first call)."""
    return enabled() and _library() is not None


_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def kernel_rows(dtype: torch.dtype) -> int:
    """Steps of up to this many rows run `gemv` rather than oneDNN (`layers.linear`),
    where it is faster: all of SmolLM2's projections, 2 threads, AVX-512 without AMX
    (bench/gemv_rows.py): one row 11 vs 13 ms in bfloat16, 18 vs 20 in float32 (the
    kernel streams at memory speed); bfloat16 at 2 to 31 rows, 11-46 ms against
    oneDNN's 15-52 (its bfloat16 GEMM runs on slower dot products); float32 up to 4
    rows. With AMX, oneDNN's bfloat16 tiles win from 2 rows. An AVX2 build keeps to
    one row: its tiles (16 vector registers, not 32) were not measured on an AVX2 CPU."""
    if dtype not in _DTYPES:
        return 0
    flags = cpu_flags()
    avx512 = "avx512f" in flags and os.environ.get(MARCH_ENV, "native") in ("", "native")
    if not avx512:
        return 1
    if dtype == torch.float32:
        return 4
    return 1 if "amx_bf16" in flags else MAX_ROWS - 1


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


def supports_attention(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` runs this shape (decode_attention.c's limits):
    head_dim a multiple of 16 up to 256, at most 16 query heads per KV head."""
    return (head_dim % 16 == 0 and head_dim <= 256 and heads % kv_heads == 0
            and heads // kv_heads <= 16)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor) -> None:
    """Attention of one query token per row over its cached tokens, into `out`.

    q [rows, heads, head_dim] (rows may be strided, heads and head_dim packed);
    kv_cache [2, num_blocks, block_size, kv_heads, head_dim] contiguous;
    block_table [rows, width] int64; seq_lens [rows] int64 (this step's token
    included, already written); out [rows, heads * head_dim] contiguous, q's dtype.
    Scale 1/sqrt(head_dim), as SDPA's default. `available()` and
    `supports_attention(...)` must be true.
    """
    lib = _library()
    rows, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    assert lib is not None and q.dtype in _DTYPES and kv_cache.dtype == q.dtype == out.dtype
    assert q.stride(2) == 1 and q.stride(1) == head_dim and kv_cache.is_contiguous()
    assert out.is_contiguous() and out.shape == (rows, heads * head_dim)
    assert block_table.dtype == seq_lens.dtype == torch.int64 and block_table.is_contiguous()
    assert seq_lens.is_contiguous() and supports_attention(heads, kv_heads, head_dim)
    status = lib.dpserve_decode_attention(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(), block_table.data_ptr(),
        block_table.shape[1], seq_lens.data_ptr(), int(q.dtype == torch.bfloat16), rows, heads,
        kv_heads, head_dim, num_blocks, block_size, head_dim ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError("dpserve_decode_attention: a row's blocks run past its table or "
                           "the cache, or memory ran out")


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta (in place; skipped when None), then a new tensor
    rms_norm(residual) * weight, as `layers.RMSNorm` computes it.

    residual, delta [rows, hidden] contiguous, weight [hidden]; one dtype, float32
    or bfloat16; `available()` must be true."""
    lib = _library()
    assert lib is not None and residual.dtype in _DTYPES and weight.dtype == residual.dtype
    assert residual.is_contiguous() and weight.is_contiguous()
    assert delta is None or (delta.dtype == residual.dtype and delta.is_contiguous()
                             and delta.shape == residual.shape)
    rows, hidden = residual.shape
    out = torch.empty_like(residual)
    lib.dpserve_add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                             weight.data_ptr(), out.data_ptr(),
                             int(residual.dtype == torch.bfloat16), rows, hidden, eps,
                             torch.get_num_threads())
    return out


def rotary_kv(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
              sin: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """RoPE on the q and k heads of `qkv`, and this step's keys and values into the cache.

    qkv [T, (heads + 2 kv_heads) * head_dim] (rows may be strided); cos, sin
    [T, 1, head_dim // 2] contiguous; slots [T] int64; kv_cache [2, num_blocks,
    block_size, kv_heads, head_dim] contiguous. One dtype, float32 or bfloat16.
    Returns the rotated q | k heads, [T, heads + kv_heads, head_dim]; raises
    ValueError (nothing written) for a slot outside the cache."""
    lib = _library()
    tokens = qkv.shape[0]
    _, num_blocks, block_size, cache_kv_heads, head_dim = kv_cache.shape
    assert lib is not None and qkv.dtype in _DTYPES
    assert cos.dtype == sin.dtype == kv_cache.dtype == qkv.dtype and head_dim % 2 == 0
    assert cache_kv_heads == kv_heads and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.numel() == sin.numel() == tokens * head_dim // 2 and kv_cache.is_contiguous()
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
    out = torch.empty(tokens, heads + kv_heads, head_dim, dtype=qkv.dtype)
    status = lib.dpserve_rotary_kv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                   slots.data_ptr(), kv_cache.data_ptr(), num_blocks * block_size,
                                   out.data_ptr(), int(qkv.dtype == torch.bfloat16), tokens,
                                   heads, kv_heads, head_dim, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"rotary_kv: a slot is outside the cache's {num_blocks * block_size}")
    return out


DECODE_LAYER_COLUMNS = 7  # decode_layers.c: in_norm, qkv, o, post_norm, gate_up, down, cache


def decode_layers(table: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, kv_cache_shape: torch.Size, heads: int,
                  intermediate: int, eps: float) -> None:
    """Every decoder layer of a decode step, in place on `residual` (decode_layers.c).

    table: [layers, DECODE_LAYER_COLUMNS] int64 addresses of each layer's tensors, all
    contiguous CPU tensors of residual's dtype: input norm weight, QKV [(heads + 2 kv)
    * d, hidden], O [hidden, heads * d], post-attention norm weight, gate/up [2 I,
    hidden], down [hidden, I], KV cache of `kv_cache_shape` [2, num_blocks,
    block_size, kv_heads, d]. residual [rows, hidden] (rows <= `kernel_rows`): the
    embeddings in, the sum after the last layer out (the final norm is the caller's).
    cos, sin [rows, 1, d / 2]; slots, seq_lens [rows] and block_table [rows, width]
    int64, as `rotary_kv` and `decode_attention` take them. The caller checked the
    shapes run (`supports_attention`, intermediate a multiple of 16)."""
    lib = _library()
    rows, hidden = residual.shape
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache_shape
    assert lib is not None and residual.dtype in _DTYPES and residual.is_contiguous()
    assert table.dtype == torch.int64 and table.is_contiguous()
    assert table.shape[1] == DECODE_LAYER_COLUMNS and intermediate % 16 == 0
    assert cos.dtype == sin.dtype == residual.dtype and cos.is_contiguous()
    assert sin.is_contiguous() and cos.numel() == rows * head_dim // 2
    for index in (slots, block_table, seq_lens):
        assert index.dtype == torch.int64 and index.is_contiguous()
    assert slots.numel() == seq_lens.numel() == rows == block_table.shape[0]
    status = lib.dpserve_decode_layers(
        table.data_ptr(), table.shape[0], residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(),
        int(residual.dtype == torch.bfloat16), rows, hidden, heads, kv_heads, head_dim,
        intermediate, num_blocks, block_size, eps, head_dim ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"dpserve_decode_layers failed ({status}): out of memory, a slot "
                           "or block outside the cache, or an attention shape it cannot run")


def int8_available() -> bool:
    """Whether `int8_linear` runs here: the kernels are built, with AVX512-VNNI."""
    lib = _library() if enabled() else None
    return lib is not None and bool(lib.dpserve_int8_vnni())


def int8_pack(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in] int8 -> (packed int8 bytes, wsum [out rounded up to 16] int32), the
    layout `int8_linear` reads (int8_gemm.c). `int8_available()` must be true."""
    lib = _library()
    assert lib is not None and q.dtype == torch.int8 and q.dim() == 2
    q = q.contiguous()
    n_len, k_len = q.shape
    n_pad, k_pad = -(-n_len // 16) * 16, -(-k_len // 4) * 4
    packed = torch.empty(n_pad * k_pad, dtype=torch.int8)
    wsum = torch.empty(n_pad, dtype=torch.int32)
    lib.dpserve_int8_pack(q.data_ptr(), n_len, k_len, packed.data_ptr(), wsum.data_ptr())
    return packed, wsum


def int8_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor,
                scales: torch.Tensor, bias: torch.Tensor | None, out_features: int
                ) -> torch.Tensor:
    """x [rows, in] float32 -> [rows, out_features] float32 through a weight from
    `int8_pack`, its per-channel `scales` [len(wsum)] float32 (zero padded) and
    `bias` [out_features] float32 or None; x is quantised per row inside."""
    lib = _library()
    assert lib is not None and x.dtype == torch.float32 and scales.dtype == torch.float32
    assert scales.numel() == wsum.numel() >= out_features
    x = x.contiguous()
    rows, k_len = x.shape
    assert packed.numel() == wsum.numel() * (-(-k_len // 4) * 4)
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out
    status = lib.dpserve_int8_linear(x.data_ptr(), rows, k_len, packed.data_ptr(),
                                     wsum.data_ptr(), scales.data_ptr(),
                                     None if bias is None else bias.data_ptr(), out_features,
                                     out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"dpserve_int8_linear failed for {rows} x {k_len}")
    return out
