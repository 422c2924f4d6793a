"""Tiny random-weight decoders of every supported RoPE architecture, and a word-level tokenizer, for tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 512
PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 3  # prompts draw ids from [FIRST_WORD, VOCAB): never a special token
CHUNK = 16
WINDOW = 32  # sliding window of the sliding-window models; every prompt below is longer
ATOL = 1e-4

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
)

# arch -> (config, attention implementation). Gemma2 has no SDPA path in transformers (logit soft-capping).
ARCHS = {
    "llama": (lambda: LlamaConfig(**COMMON), "sdpa"),
    "qwen2": (lambda: Qwen2Config(**COMMON), "sdpa"),
    "qwen3": (lambda: Qwen3Config(head_dim=16, **COMMON), "sdpa"),
    "mistral": (lambda: MistralConfig(sliding_window=WINDOW, **COMMON), "sdpa"),
    "gemma2": (lambda: Gemma2Config(head_dim=16, sliding_window=WINDOW, **COMMON), "eager"),
    "gemma3": (lambda: Gemma3TextConfig(head_dim=16, sliding_window=WINDOW,
                                        layer_types=["sliding_attention", "full_attention"], **COMMON), "sdpa"),
    "phi3": (lambda: Phi3Config(**COMMON), "sdpa"),
}
SLIDING_ARCHS = ["mistral", "gemma2", "gemma3"]


def build_model(arch: str):
    make_config, attn = ARCHS[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation=attn, dtype=torch.float32).eval()
    # A zero output row gives EOS the logit 0 (also after Gemma's soft-capping), which never wins the argmax
    # over 511 random logits: greedy generation always runs to max_new_tokens. Prompts never contain EOS,
    # so zeroing a tied input row too changes nothing else.
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS].zero_()
    return model




def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, **{f"w{i}": i for i in range(FIRST_WORD, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD, VOCAB, (n,), generator=g).tolist()
