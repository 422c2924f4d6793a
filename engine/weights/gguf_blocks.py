"""GGUF weights kept as the file's own blocks, multiplied by a small C kernel (engine/weights/gguf_blocks.c).

A Q4_0, Q4_1, Q4_K, Q6_K or Q8_0 tensor is held as its bytes, row after row: the resident weights are the file's
tensor bytes (no second rounding, no wider format: a Q6_K tensor no longer becomes 8-bit rows), and loading is a
read; a Q4_0 / Q4_1 / Q8_0 layer of 16n rows is then reordered into 16-row tiles (`as_tiles`: the same bytes, one
output per vector lane) where the CPU has AVX2. The kernel rounds each activation row per block, to int8 per 256
values for the K-quants (as llama.cpp rounds its activations) and to int16 per 32 for the 32-value types
(llama.cpp's int8 there moved the embedded model's answers; see gguf_blocks.c), and sums each block's products
exactly in integers. Every float sum runs
in an order fixed by the row's length, so an output does not depend on how many rows are multiplied together
or on the thread count (reuse then never changes an answer through this kernel).

The kernel (with engine/exact_attention.c, in one library) is compiled on first use with the machine's C
compiler (`cc`, or $CC) for this CPU (-march=native, or $KVBOOST_BLOCKS_MARCH, refused where it needs features
this CPU lacks) into <engine cache>/kernels, keyed by the sources, the flags and the CPU's feature flags (~2 s,
once), and loaded only after engine.weights.kernel_build's checks (owner, mode, digest); without a compiler a
shipped x86-64-v3 build is used where the CPU runs it; otherwise `unavailable()` says why and the loader keeps
torch's kernels (engine.weights.int4, engine.weights.head).

Over 400 lines: the one binding of the C kernel, whose declared functions, build key, tile layout and per-type
calls must agree with each other and with gguf_blocks.c (how a build is made, checked and loaded:
engine.weights.kernel_build)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch
from torch import nn

from ..config import BLOCK_KERNEL
from .kernel_build import COMPILE_TIMEOUT_S, BlockKernelUnavailable, load_or_build, missing_features

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().with_name("gguf_blocks.c")
# Built into the same library: attention one row at a time (engine.exact_attention), the one-call forward
# (engine.block_forward) and the threads every kernel shares (thread_pool.c: one pool for the process, whichever
# thread calls).
ENGINE_DIR = SOURCE.parent.parent  # exact_attention.c and block_forward.c live at engine's root
SOURCES = (SOURCE, SOURCE.with_name("gguf_dots.c"), SOURCE.with_name("gguf_layout.c"), SOURCE.with_name("ktiles.c"),
           SOURCE.with_name("amx.c"), ENGINE_DIR / "exact_attention.c", ENGINE_DIR / "block_forward.c",
           SOURCE.with_name("thread_pool.c"))
# included by the sources: part of a build's key, shipped beside them
HEADERS = (SOURCE.with_name("gguf_blocks.h"), ENGINE_DIR / "own_exp.h", ENGINE_DIR / "attention_rows.h")
# Installers ship a build for x86-64-v3 (AVX2, FMA, F16C) beside the source (packaging/kvboost-desktop.spec), for
# machines without a C compiler; it is loaded only where the CPU has those features.
PREBUILT = SOURCE.with_name("gguf_blocks-x86-64-v3.so")
PREBUILT_NEEDS = ("avx2", "fma", "f16c")
# type name -> (ggml type id, values per block, bytes per block)
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
               "Q6_K": (14, 256, 210)}
ACTIVATION_BLOCK = 32  # every row's length is a multiple of this
# -z now (GNU ld, so Linux only; AMX is used only there): every symbol bound at load, so no lazy-binding trampoline
# (which saves the vector state with XSAVE into a buffer sized before AMX was granted) runs while a thread's tiles
# hold data (engine/weights/amx.c)
FLAGS = ("-O3", "-ffp-contract=off", "-pthread", "-fPIC", "-shared", "-std=c11",
         *(("-Wl,-z,now",) if platform.system() == "Linux" else ()))
MARCH_ENV_VAR = "KVBOOST_BLOCKS_MARCH"  # the CPU to build for (gcc's -march): "native" unless set
VECTOR_PATHS = {2: "avx2+vnni", 1: "avx2", 0: "portable C"}
KERNEL = BLOCK_KERNEL  # the name loaders and reports use for this kernel

_lock = threading.Lock()
_state: dict = {}


def kernel_dir(engine_cache_dir: Path | str | None = None) -> Path:
    """<the engine's cache folder>/kernels: `engine_cache_dir` (from_pretrained's disk_cache_dir) when given, else
    $KVBOOST_CACHE_DIR when set, else the per-user cache folder, as
    engine.weights.gguf_tokenizer.tokenizer_cache_dir."""
    if engine_cache_dir is not None:
        return Path(engine_cache_dir).expanduser() / "kernels"
    root = os.environ.get("KVBOOST_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "kernels"
    import platformdirs

    return Path(platformdirs.user_cache_dir("KVBoost", "KVBoost")) / "kv" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> str:
    """This CPU's feature flags as the kernel's build key reads them (/proc/cpuinfo's flags line)."""
    return _cpu_flags()


def build_command(compiler: str, target: Path, march: str) -> list[str]:
    """The command that builds the kernel for `march` (gcc's -march) into `target`."""
    return [compiler, *FLAGS, f"-march={march}", *map(str, SOURCES), "-o", str(target), "-lm"]


def _prebuilt() -> Path | None:
    flags = set(_cpu_flags().split())
    if PREBUILT.is_file() and platform.machine() in ("x86_64", "AMD64") and flags >= set(PREBUILT_NEEDS):
        return PREBUILT
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cannot_build() -> str | None:
    """Why neither a build nor the shipped library can be had here, or None."""
    if platform.system() == "Windows":
        return "the block kernel is built with a Unix C compiler; Windows keeps torch's kernels"
    if _compiler() is None and _prebuilt() is None:
        return "no C compiler (cc or $CC) to build the block kernel"
    return None


def kernel_file(folder: Path, compiler: str, march: str) -> Path:
    """Where `compiler`'s build for `march` lives in `folder`: named by a key of the sources, the flags, the march,
    the compiler and this CPU's feature flags, so a change of any of them is another build."""
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), march.encode(), compiler.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    return folder / f"gguf_blocks-{key}.so"


def build_into(folder: Path, timeout_s: float = COMPILE_TIMEOUT_S) -> ctypes.CDLL:
    """The kernel for this CPU from `folder` (built there where missing or untrusted, see kernel_build), bound; or
    the shipped build where there is no compiler. The process's library (`library()`) is neither read nor set.
    BlockKernelUnavailable where it cannot be had. `timeout_s`: the most each compiler call may take."""
    why = cannot_build()
    if why is not None:
        raise BlockKernelUnavailable(why)
    compiler = _compiler()
    if compiler is None:
        return _bind(_prebuilt())
    march = os.environ.get(MARCH_ENV_VAR) or "native"
    missing = missing_features(compiler, march, _cpu_flags(), timeout_s)
    if missing:  # built anyway, its first product would die with SIGILL
        raise BlockKernelUnavailable(f"${MARCH_ENV_VAR}={march} builds for CPU features this CPU lacks "
                                     f"({', '.join(missing)}): unset it to build for this CPU")
    return load_or_build(kernel_file(folder, compiler, march), lambda out: build_command(compiler, out, march),
                         _declare, timeout_s)


def _bind(target: Path) -> ctypes.CDLL:
    """A build not in the cache (the shipped one, another checkout's), loaded as it is and bound."""
    try:
        return _declare(ctypes.CDLL(str(target)))
    except (OSError, AttributeError) as exc:
        raise BlockKernelUnavailable(f"the block kernel {target} does not load: {exc}") from exc


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every function this module calls declared; AttributeError for one it lacks."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kvb_quantize.argtypes = [p, i64, i64, i32, p, p, p, i32]
    lib.kvb_quantize.restype = None
    lib.kvb_matmul.argtypes = [i32, p, i64, i64, i64, p, p, p, i64, p, i32]
    lib.kvb_matmul.restype = i32
    lib.kvb_linear.argtypes = [i32, p, i64, i64, i64, p, i64, p, i32]
    lib.kvb_linear.restype = i32
    lib.kvb_dequantize.argtypes = [i32, p, i64, i64, i64, p, i64, p, i32]
    lib.kvb_dequantize.restype = i32
    f32 = ctypes.c_float
    lib.kvb_attention.argtypes = [p, p, p, i64, i64, p, i64, i32, p, i64, i64, i64, i64, i64, i64, f32, i32]
    lib.kvb_attention.restype = i32
    lib.kvb_rmsnorm.argtypes = [p, p, i64, i64, f32, p]
    lib.kvb_rmsnorm.restype = None
    lib.kvb_silu.argtypes = [p, i64, p]
    lib.kvb_silu.restype = None
    lib.kvb_decoder_packed.argtypes = [p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, p, p, f32, f32, i32, p,
                                       p]
    lib.kvb_decoder_packed.restype = i32
    lib.kvb_attention_segments.argtypes = [i64, p, p, p, p, p, p, p, i64, i64, i64, f32, i32, p, p, p, p]
    lib.kvb_attention_segments.restype = i32
    lib.kvb_same_until.argtypes = [p, p, i64, i64, i64, i64, i64]
    lib.kvb_same_until.restype = i64
    lib.kvb_forward_timing.argtypes = [i32]
    lib.kvb_forward_timing.restype = None
    lib.kvb_forward_phases.argtypes = [p]
    lib.kvb_forward_phases.restype = None
    lib.kvb_supports.argtypes = [i32]
    lib.kvb_vector_path.restype = i32
    lib.kvb_amx.restype = i32
    lib.kvb_tiles.argtypes = [i32]
    lib.kvb_tiles.restype = i32
    lib.kvb_repack.argtypes = [i32, p, i64, i64, i64, p, i32]
    lib.kvb_repack.restype = i32
    for name, (type_id, _, _) in BLOCK_TYPES.items():
        assert lib.kvb_supports(type_id) and lib.kvb_activation_block(type_id) == activation_block(name), name
    return lib


def _library(engine_cache_dir: Path | str | None = None) -> ctypes.CDLL:
    """The kernel, built on the first call of the process into kernel_dir(engine_cache_dir)."""
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = build_into(kernel_dir(engine_cache_dir))
            except (BlockKernelUnavailable, OSError, subprocess.SubprocessError) as exc:
                _state["error"] = str(exc)
        if "error" in _state:
            raise BlockKernelUnavailable(_state["error"])
        return _state["lib"]


def unavailable(device: torch.device | str = "cpu", engine_cache_dir: Path | str | None = None) -> str | None:
    """Why the block kernel cannot run on `device` here, or None (built on the first call of the process, into
    kernel_dir(engine_cache_dir))."""
    if torch.device(device).type != "cpu":
        return f"the GGUF block kernel runs on the CPU, not on {torch.device(device).type}"
    try:
        _library(engine_cache_dir)
    except BlockKernelUnavailable as exc:
        return str(exc)
    return None


def expected_unavailable(device: torch.device | str = "cpu") -> str | None:
    """What unavailable() would say, without building anything (for estimates made before a load): None when
    the kernel is loaded already, or a compiler or a shipped build for this CPU is there."""
    if torch.device(device).type != "cpu":
        return f"the GGUF block kernel runs on the CPU, not on {torch.device(device).type}"
    with _lock:
        if "lib" in _state:
            return None
        if "error" in _state:
            return _state["error"]
    return cannot_build()


def vector_path() -> str:
    """Which of the kernel's paths this CPU runs ("avx2+vnni", "avx2" or "portable C")."""
    return VECTOR_PATHS[_library().kvb_vector_path()]


def numerics() -> str:
    """Which float sums this build's outputs come from. "blocks-5": every path (portable C, AVX2 rows, AVX2 and
    AVX-512 tiles, AMX) takes the same float steps, one rounding per block (gguf_dots.c, block32_float and
    block256_float), so every build gives the same bits, and SiLU's exponential is the library's own
    (engine/own_exp.h; libm's expf before, which other C libraries compute otherwise). Before: "blocks-4" (Q4_1's
    offsets per block rounded three times, m times the activations' scale, times their code sum, added; now one
    fma of m and the activations' scale times their sum), "blocks-3" (libm's expf), "avx2-2" / "portable-2" (the
    K-quants' float sums were per vector lane on the AVX2 path, in block order in portable C). Part of a model's
    fingerprint, so that a shared store never hands KV computed with other float steps."""
    return "blocks-5"


# The arithmetic of engine/exact_attention.c (built into this library), in a model's fingerprint where it attends
# with it: 2 since its exponentials are its own (exp_one / exp8) instead of libm's expf.
ATTENTION_NUMERICS = 2

TILED = 256  # added to a type's id in a call: its weight is held as 16-row tiles (gguf_blocks.c, kvb_repack)


def tiles(type_name: str) -> bool:
    """Whether this build multiplies `type_name` held as 16-row tiles: the 32-value types with AVX2 or AVX-512,
    Q4_K and Q6_K with AVX-512 VNNI (engine/weights/ktiles.c)."""
    return bool(_library().kvb_tiles(BLOCK_TYPES[type_name][0]))


def amx() -> bool:
    """Whether AMX multiplies the K-quants' tiles 16 activation rows at a time here (amx.c, ktiles.c: the CPU has
    it, the OS grants the process its tile state, and $KVBOOST_BLOCKS_AMX is not "0"); the same outputs either
    way."""
    return bool(_library().kvb_amx())


def as_tiles(blocks: torch.Tensor, type_name: str, columns: int, in_place: bool = False) -> torch.Tensor | None:
    """The weight whose rows are `blocks` as 16-row tiles (its values in the order the vector kernels read them),
    or None where this build has no tiles for the type or the row count is not a multiple of 16. `in_place`:
    the tiles are written over `blocks` (returned), so a load never holds a weight twice."""
    _check_blocks(blocks, type_name, columns)
    if not tiles(type_name) or blocks.shape[0] % 16:
        return None
    out = blocks if in_place else torch.empty_like(blocks)
    status = _library().kvb_repack(BLOCK_TYPES[type_name][0], _ptr(blocks), blocks.shape[0], columns,
                                   blocks.shape[1], _ptr(out), _threads())
    if status == -2:
        raise MemoryError(f"no memory to reorder a {type_name} weight into tiles")
    assert status == 0, type_name
    return out


def row_bytes(type_name: str, columns: int) -> int:
    """Bytes of one row of `columns` values in `type_name`'s blocks; ValueError when the row is not whole blocks
    or the kernel cannot take it."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"the block kernel does not hold {type_name}")
    _, per_block, block_bytes = BLOCK_TYPES[type_name]
    if columns <= 0 or columns % per_block or columns % ACTIVATION_BLOCK:
        raise ValueError(f"a {type_name} row of {columns} values is not whole blocks of {per_block}")
    return columns // per_block * block_bytes


def library(engine_cache_dir: Path | str | None = None) -> ctypes.CDLL:
    """The built library (BlockKernelUnavailable where it cannot be had): for engine.exact_attention."""
    return _library(engine_cache_dir)


def other_build(path: Path | str) -> ctypes.CDLL:
    """Another build of this kernel (another checkout's: `library()._name` there), bound as this one is, for a
    benchmark that times two builds side by side; its functions must take the arguments this checkout passes."""
    return _bind(Path(path))


@contextlib.contextmanager
def build_in_use(lib: ctypes.CDLL):
    """Within it, this module's calls go to `lib` (other_build's, or library()'s): a benchmark alternating builds."""
    _library()
    with _lock:
        saved, _state["lib"] = _state["lib"], lib
    try:
        yield
    finally:
        with _lock:
            _state["lib"] = saved


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def activation_block(type_name: str) -> int:
    """The block the kernel rounds activations in for weights of `type_name`: 256 for the K-quants, else 32."""
    return 256 if type_name.endswith("_K") else 32


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [rows, k] (k a multiple of `block`) -> the activations as the kernel multiplies them: block 32 (the
    32-value types): (int16 codes [rows, k], float32 scales max|x| / 32767 [rows, k / 32], sums int32
    [rows, k / 32, 2]: the codes' sum, then the float32 bits of the scale times it); block 256 (the K-quants):
    (int8 codes [rows, k], scales max|x| / 127 [rows, k / 256], int16 code sums per 16 [rows, k / 16])."""
    if block not in (32, 256) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or \
            x.shape[1] % block:
        raise ValueError(f"activations {x.dtype} {list(x.shape)} are not contiguous float32 rows of {block}s")
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int16 if block == 32 else torch.int8)
    d = torch.empty(rows, k // block, dtype=torch.float32)
    sums = torch.empty(rows, k // 32, 2, dtype=torch.int32) if block == 32 else torch.empty(rows, k // 16,
                                                                                            dtype=torch.int16)
    _library().kvb_quantize(_ptr(x), rows, k, block, _ptr(q), _ptr(d), _ptr(sums), _threads())
    return q, d, sums


def _check_blocks(blocks: torch.Tensor, type_name: str, columns: int, tiled: bool = False) -> int:
    """The kernel's id for the weight (its type's, + TILED when held as tiles); ValueError for blocks that are not
    its rows."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() or \
            blocks.device.type != "cpu" or blocks.shape[1] != row_bytes(type_name, columns):
        raise ValueError(f"{type_name} blocks {blocks.dtype} {list(blocks.shape)} are not rows of {columns} values")
    if tiled and (blocks.shape[0] % 16 or not tiles(type_name)):
        raise ValueError(f"{type_name} blocks of {blocks.shape[0]} rows cannot be tiles in this build")
    return BLOCK_TYPES[type_name][0] + (TILED if tiled else 0)


def matmul(blocks: torch.Tensor, type_name: str, columns: int, x: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """x float32 [rows, columns] times the weight whose rows are `blocks` (uint8 [out, row bytes]; `tiled`: as
    as_tiles holds them) -> float32 [rows, out]."""
    out = blocks.shape[0]
    type_id = _check_blocks(blocks, type_name, columns, tiled)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[-1] != columns or not x.is_contiguous():
        raise ValueError(f"activations {x.dtype} {list(x.shape)} are not contiguous float32 rows of {columns}")
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    status = _library().kvb_linear(type_id, _ptr(blocks), out, columns, blocks.shape[1], _ptr(x), x.shape[0], _ptr(y),
                                   _threads())
    if status == -2:
        raise MemoryError(f"no scratch memory for {x.shape[0]} rows of activations")
    assert status == 0, type_name
    return y


def dequantize(blocks: torch.Tensor, type_name: str, columns: int, rows: torch.Tensor | None = None,
               tiled: bool = False) -> torch.Tensor:
    """float32 values of the rows `rows` (int64 indices, each checked against the row count; None: all) of the
    weight held as `blocks` (`tiled`: as as_tiles holds them), gguf-py's dequantization bit for bit."""
    type_id = _check_blocks(blocks, type_name, columns, tiled)
    if rows is None:
        rows = torch.arange(blocks.shape[0])
    rows = rows.reshape(-1).to("cpu", torch.int64).contiguous()
    out = torch.empty(rows.numel(), columns, dtype=torch.float32)
    status = _library().kvb_dequantize(type_id, _ptr(blocks), blocks.shape[0], columns, blocks.shape[1], _ptr(rows),
                                       rows.numel(), _ptr(out), _threads())  # the kernel checks every index
    if status == -3:
        raise IndexError(f"row index out of range for a table of {blocks.shape[0]} rows")
    assert status == 0, type_name
    return out


class BlockLinear(nn.Module):
    """A linear layer whose weight is a GGUF tensor's blocks (uint8 [out, row bytes]), multiplied by the block
    kernel; activations in any float dtype, computed in float32 and returned in the input's dtype."""

    kernel = KERNEL

    def __init__(self, blocks: torch.Tensor, type_name: str, in_features: int, bias: torch.Tensor | None = None,
                 take: bool = False):
        """`take`: `blocks` is handed over (the loader's fresh read): it may be reordered into tiles in place."""
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(type_name, in_features):
            raise ValueError(f"{type_name} blocks of shape {list(blocks.shape)} are not rows of {in_features} values")
        self.type_name, self.in_features, self.out_features = type_name, in_features, blocks.shape[0]
        _library()  # built or BlockKernelUnavailable, before a forward needs it
        blocks = blocks.contiguous()
        # where this CPU multiplies tiles: the order it reads
        as_tiled = as_tiles(blocks, type_name, in_features, in_place=take)
        self.tiled = as_tiled is not None
        self.register_buffer("blocks", blocks if as_tiled is None else as_tiled)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.fallback_reason: str | None = None
        self.type_id = BLOCK_TYPES[type_name][0] + (TILED if self.tiled else 0)  # the kernel's id of the weight
        self._call = (self.type_id, blocks.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the checks of `matmul` were made once, here and in __init__; a forward is one call into the kernel
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of {x.shape[-1]} features into a layer of {self.in_features}")
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if self.blocks.device.type != "cpu" or x2.device.type != "cpu":
            raise RuntimeError(f"the GGUF block kernel runs on the CPU, not on {x2.device} / {self.blocks.device}")
        type_id, row_bytes = self._call
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        status = _state["lib"].kvb_linear(type_id, self.blocks.data_ptr(), self.out_features, self.in_features,
                                          row_bytes, x2.data_ptr(), x2.shape[0], y.data_ptr(), _threads())
        if status != 0:
            raise MemoryError(f"no scratch memory for {x2.shape[0]} rows of activations") if status == -2 else \
                RuntimeError(f"the block kernel does not multiply {self.type_name}")
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] weight: the file's dequantized values."""
        return dequantize(self.blocks, self.type_name, self.in_features, tiled=self.tiled).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}"
                + (", tiled" if self.tiled else ""))


class BlockEmbedding(nn.Module):
    """An input table held as a GGUF tensor's blocks: a lookup dequantizes only the rows asked for (gguf's
    values, in `dtype`, times a scaled table's `embed_scale`). May share its blocks with a BlockLinear head."""

    def __init__(self, blocks: torch.Tensor, type_name: str, embedding_dim: int, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None, tiled: bool = False):
        super().__init__()
        row_bytes(type_name, embedding_dim)
        self.type_name, self.embedding_dim, self.dtype, self.tiled = type_name, embedding_dim, dtype, tiled
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone(),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks, self.type_name, self.embedding_dim, ids, self.tiled).to(self.dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.type_name}"
