"""Tiny GGUF files for tests: a writer (gguf-py's GGUFWriter, with llama.* / qwen2.* metadata and a byte-level
BPE tokenizer of 512 tokens), packers for the K-quant blocks gguf-py cannot quantize (Q4_K, Q5_K, Q6_K, written
here from the block layout and checked against gguf-py's dequantize in test_gguf_loader.py), and byte patches
that make a written file lie."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

VOCAB = 512
PAD, BOS, EOS = 0, 1, 2
SIZES = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64)  # K-quants: rows of 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
QK_K = 256


# -- K-quant packers ---------------------------------------------------------------------------------------------

def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [n, 2]


def _scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and 8 six-bit mins (Q4_K, Q5_K): sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins), 4-7 in bytes 8-11's nibbles with their top two bits in bits 6-7 above."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return out


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] codes -> 128 bytes: 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high."""
    sub = (q & 15).reshape(-1, 4, 2, 32)
    return (sub[:, :, 0] | (sub[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """Superblocks of w = (d * sc) * q - dmin * m: d, dmin [n] (stored fp16), sc, m [n, 8] in 0..63, q [n, 256]
    in 0..15 -> uint8 [n, 144]."""
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scale_bytes(sc, m), _low_nibbles(q)], axis=1)


def pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    """As Q4_K with q in 0..31: the fifth bit of element i of sub-block s is bit s of byte i of 32 -> [n, 176]."""
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= (high[:, s] << s).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scale_bytes(sc, m), qh, _low_nibbles(q)], axis=1)


def pack_q6_k(d, scales, q) -> np.ndarray:
    """Superblocks of w = (d * scale) * (q - 32): d [n] (fp16), scales [n, 16] int8 (one per 16 weights), q [n, 256]
    in 0..63 -> uint8 [n, 210]: ql 128 bytes (half h, byte b: element 128h + b low, 128h + 64 + b high nibble),
    qh 64 bytes (half h, byte b: bits 2s..2s+1 the top two bits of element 128h + 32s + b), scales, d."""
    n = q.shape[0]
    halves = q.reshape(n, 2, 128)
    low, high = halves & 15, halves >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128).astype(np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (high[:, :, 32 * s:32 * (s + 1)] << (2 * s)).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), scales.astype(np.int8).view(np.uint8), _fp16_bytes(d)], axis=1)


def _superblocks(weight: np.ndarray) -> np.ndarray:
    assert weight.shape[-1] % QK_K == 0, weight.shape
    return weight.astype(np.float32).reshape(-1, QK_K)


def _fp16_step(step: np.ndarray) -> np.ndarray:
    """`step` as the fp16 value a block stores, float32; 1 where it is 0 in fp16 (an all-zero range)."""
    stored = step.astype(np.float16).astype(np.float32)
    return np.where(stored > 0, stored, np.float32(1))


def quantize_q4_k(weight: np.ndarray, levels: int = 15, pack=pack_q4_k) -> np.ndarray:
    """Round-to-nearest Q4_K (Q5_K with levels=31, pack=pack_q5_k): per sub-block of 32 a range [lo <= 0, hi],
    its step and -lo in 6 bits of the superblock's d and dmin. [rows, cols] -> uint8 [rows, cols/256 * bytes]."""
    blocks = _superblocks(weight)
    sub = blocks.reshape(-1, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    step = (hi - lo) / levels
    d16, dmin16 = _fp16_step(step.max(-1) / 63), _fp16_step((-lo).max(-1) / 63)
    sc = np.clip(np.round(step / d16[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin16[:, None]), 0, 63).astype(np.uint8)
    scale = d16[:, None] * sc.astype(np.float32)
    offset = dmin16[:, None] * m.astype(np.float32)
    q = np.clip(np.round((sub + offset[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    packed = pack(d16, dmin16, sc, m, q.reshape(-1, QK_K))
    return packed.reshape(weight.shape[0], -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q6_K: per 16 weights a signed step (max |w| / 31), in int8 units of the superblock's d."""
    blocks = _superblocks(weight)
    groups = blocks.reshape(-1, 16, 16)
    step = np.abs(groups).max(-1) / 31
    d16 = _fp16_step(step.max(-1) / 127)
    scales = np.clip(np.round(step / d16[:, None]), 1, 127).astype(np.int8)
    scale = d16[:, None] * scales.astype(np.float32)
    q = np.clip(np.round(groups / scale[..., None]), -32, 31).astype(np.int16) + 32
    return pack_q6_k(d16, scales, q.reshape(-1, QK_K).astype(np.uint8)).reshape(weight.shape[0], -1)


def encode(weight: np.ndarray, type_name: str) -> np.ndarray:
    """`weight` [rows, cols] float32 as stored in a GGUF tensor of `type_name`."""
    if type_name == "F32":
        return weight.astype(np.float32)
    if type_name == "F16":
        return weight.astype(np.float16)
    if type_name == "Q4_K":
        return quantize_q4_k(weight)
    if type_name == "Q5_K":
        return quantize_q4_k(weight, levels=31, pack=pack_q5_k)
    if type_name == "Q6_K":
        return quantize_q6_k(weight)
    return quants.quantize(weight.astype(np.float32), GGMLQuantizationType[type_name])  # Q4_0 ... Q8_0, BF16


# -- files -------------------------------------------------------------------------------------------------------

def tensor_shapes(arch: str = "llama", sizes: dict | None = None, tied: bool = True) -> dict[str, tuple]:
    """GGUF tensor name -> shape in torch order ([out, in] for a matrix) of a tiny `arch` decoder."""
    s = {**SIZES, **(sizes or {})}
    h, inter, q, kv = s["hidden"], s["intermediate"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"token_embd.weight": (VOCAB, h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, h)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (h,), b + "attn_q.weight": (q, h), b + "attn_k.weight": (kv, h),
                   b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, q), b + "ffn_norm.weight": (h,),
                   b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h),
                   b + "ffn_down.weight": (h, inter)}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
    return shapes


def random_tensors(shapes: dict[str, tuple], seed: int = 0) -> dict[str, np.ndarray]:
    """Weights of a plausible scale: linears ~N(0, 1/in), norms near 1, biases small."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if "norm" in name:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


def byte_level_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a GPT-2 style byte-level BPE of VOCAB tokens: three control tokens,
    the 256 byte symbols, then merges of letter pairs ("a b" -> "ab")."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<pad>", "<bos>", "<eos>"] + list(bytes_to_unicode().values())
    letters = "etaoinshrdlucmfw"
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) < VOCAB:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
    types = [3, 3, 3] + [1] * (len(tokens) - 3)  # 3: control, 1: normal
    return tokens, types, merges


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama",
               sizes: dict | None = None, name: str = "tiny", metadata: dict | None = None) -> Path:
    """A GGUF file of `arch` at `path` holding `tensors` (name -> (float32 values [out, in], GGUF type name)),
    with the metadata of SIZES (updated by `sizes`), a byte-level tokenizer and CHAT_TEMPLATE; `metadata`
    (key -> int | float | str) overrides or adds keys."""
    s = {**SIZES, **(sizes or {})}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(2048)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_vocab_size(VOCAB)
    tokens, types, merges = byte_level_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(PAD)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for tensor_name, (values, type_name) in tensors.items():
        stored = encode(values, type_name)
        raw = None if type_name in ("F32", "F16") else GGMLQuantizationType[type_name]
        writer.add_tensor(tensor_name, stored, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(path: Path, linear_type: str = "Q4_K", arch: str = "llama", table_type: str = "F32",
              tied: bool = True, seed: int = 0, sizes: dict | None = None, drop: tuple = (),
              linear_types: dict | None = None) -> Path:
    """A tiny `arch` decoder whose decoder linears are all `linear_type` (those whose name ends with a key of
    `linear_types`: its type, as in a mixed file), its table (and untied head) `table_type`, norms and biases
    F32; tensors named in `drop` left out."""
    values = random_tensors(tensor_shapes(arch, sizes, tied), seed)
    typed = {}
    for name, v in values.items():
        if name in drop:
            continue
        if v.ndim == 1:
            typed[name] = (v, "F32")
        elif name in ("token_embd.weight", "output.weight"):
            typed[name] = (v, table_type)
        else:
            mixed = [kind for end, kind in (linear_types or {}).items() if name.endswith(end)]
            typed[name] = (v, mixed[0] if mixed else linear_type)
    return write_gguf(path, typed, arch=arch, sizes=sizes)


# -- lies --------------------------------------------------------------------------------------------------------

def patch(path: Path, offset: int, fmt: str, value) -> None:
    """Overwrite the little-endian `fmt` value at `offset` of the file."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(struct.pack("<" + fmt, value))


def string_end(path: Path, text: str) -> int:
    """The offset just past the first GGUF string (u64 length + bytes) equal to `text` in the file's header."""
    data = Path(path).read_bytes()[:1 << 20]
    needle = struct.pack("<Q", len(text.encode())) + text.encode()
    at = data.index(needle)
    return at + len(needle)


def tensor_info_fields(path: Path, name: str, num_dims: int) -> tuple[int, int]:
    """(offset of the ggml type, offset of the data offset) in tensor `name`'s info record."""
    dims_end = string_end(path, name) + 4 + 8 * num_dims
    return dims_end, dims_end + 4


# -- a file at a real size, for measuring loads (not used by the tests) -----------------------------------------

QWEN2_1_5B = dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, head_dim=128, vocab=151936)


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid stored bytes of a [rows, cols] tensor of `type_name` (Q4_K or Q6_K) with random codes and small
    positive fp16 scales: the layout of real weights, none of their values."""
    superblocks = rows * cols // QK_K
    width = {"Q4_K": 144, "Q6_K": 210}[type_name]
    data = rng.integers(0, 256, (superblocks, width), dtype=np.uint8)
    scale = _fp16_bytes(rng.uniform(1e-4, 1e-3, superblocks))
    if type_name == "Q4_K":
        data[:, 0:2], data[:, 2:4] = scale, _fp16_bytes(rng.uniform(1e-4, 1e-3, superblocks))
    else:
        data[:, 208:210] = scale
    return data.reshape(rows, -1)


def write_q4_k_m_like(path: Path, sizes: dict = QWEN2_1_5B, seed: int = 0) -> Path:
    """A qwen2 GGUF of `sizes` laid out as llama.cpp's Q4_K_M writes one: decoder linears Q4_K, attn_v and ffn_down
    Q6_K in the first and last eighth of the layers and every third layer between, the tied table Q6_K, norms
    and q/k/v biases F32; random values (a Qwen2.5-1.5B shape by default, ~0.9 GB)."""
    rng = np.random.default_rng(seed)
    s = sizes
    h, inter, layers = s["hidden"], s["intermediate"], s["layers"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    writer = GGUFWriter(str(path), "qwen2", use_temp_file=True)
    writer.add_name("q4_k_m-like")
    writer.add_context_length(32768)
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(s["vocab"])
    tokens, types, merges = byte_level_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(EOS)

    def add(name: str, type_name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_blocks(type_name, rows, cols, rng), raw_dtype=GGMLQuantizationType[type_name])

    def add_vector(name: str, width: int, mean: float) -> None:
        writer.add_tensor(name, (mean + 0.02 * rng.standard_normal(width)).astype(np.float32))

    add("token_embd.weight", "Q6_K", s["vocab"], h)
    add_vector("output_norm.weight", h, 1.0)
    for i in range(layers):
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        b = f"blk.{i}."
        for name, rows, cols, kind in (("attn_q", q, h, "Q4_K"), ("attn_k", kv, h, "Q4_K"),
                                       ("attn_v", kv, h, "Q6_K" if more_bits else "Q4_K"),
                                       ("attn_output", h, q, "Q4_K"), ("ffn_gate", inter, h, "Q4_K"),
                                       ("ffn_up", inter, h, "Q4_K"),
                                       ("ffn_down", h, inter, "Q6_K" if more_bits else "Q4_K")):
            add(f"{b}{name}.weight", kind, rows, cols)
        for name, width in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            add_vector(f"{b}{name}.bias", width, 0.0)
        add_vector(f"{b}attn_norm.weight", h, 1.0)
        add_vector(f"{b}ffn_norm.weight", h, 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def arch_gguf(path: Path, arch: str, linear_type: str = "Q8_0", metadata: dict | None = None, seed: int = 0) -> Path:
    """A tiny GGUF of any architecture transformers maps: the tensors (names and shapes) are those its name map
    gives the model of the file's own config (q/k norms, fused qkv, post-norms as the architecture has them),
    linears `linear_type`, everything 1-D F32, the table F32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    write_gguf(path, {}, arch=arch, metadata=metadata)  # the metadata alone, to read its config
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    params = dict(model.named_parameters())
    shapes = {gguf: tuple(params[hf].shape) for gguf, hf in get_gguf_hf_weights_map(model, processor).items()
              if hf in params}
    values = random_tensors(shapes, seed)
    typed = {n: (v, "F32" if v.ndim == 1 or n == "token_embd.weight" else linear_type) for n, v in values.items()}
    return write_gguf(path, typed, arch=arch, metadata=metadata)


# metadata architectures need beyond the common keys (the tests' GGUF files of gemma2 / gemma3)
ARCH_KEYS = {"gemma2": {"gemma2.attention.key_length": 64, "gemma2.attention.sliding_window": 32},
             "gemma3": {"gemma3.attention.key_length": 64, "gemma3.attention.sliding_window": 32}}
