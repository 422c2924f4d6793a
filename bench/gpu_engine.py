"""The engine's own decode on a GPU against the bandwidth limit: the roofline rows of `python -m bench decode`, for
CUDA, without downloads. Part of `python -m bench.gpu_check` (`--dry-run`: tiny bodies on the CPU).

A model of a real body (Qwen2.5-1.5B's, Mistral-7B's) is built with random weights straight on the device in
bfloat16, then run through KVBoost twice: as it is (bfloat16) and with its decoder linears in int4 (RTN, group 128,
tinygemm). For each context the engine generates greedily (reuse off, no drafts: one token per forward) and its
own Stats give TTFT and decode tokens/s. A decode step reads every weight held but the input table (one row of it;
a table the head shares is read whole) and the KV of the context; the limit is the device copy bandwidth over those
bytes, and the share is what the engine reached of it.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from bench.roofline import step_bytes

EOS = 2  # the tokenizer's end token; its output row is zeroed so greedy decoding runs to max_new_tokens


@dataclass(frozen=True)
class Body:
    name: str
    model_type: str  # "qwen2" | "llama"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    def tiny(self) -> "Body":
        return replace(self, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=max(1, self.kv_heads // 4 or 1),
                       vocab=512)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab, tie_word_embeddings=self.tied, max_position_embeddings=4096,
            bos_token_id=1, eos_token_id=EOS, pad_token_id=0)


BODIES = (
    Body("1.5b-qwen2", "qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    Body("7b-mistral", "llama", 4096, 14336, 32, 32, 8, 32000, False),
)


def word_tokenizer(vocab: int):
    """A whitespace word tokenizer over ids 0..vocab-1 ("w<id>"): enough for KVBoost to encode and decode ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<bos>": 1, "<eos>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def build_model(body: Body, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(body.config(), dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS].zero_()
    return model


def engine_rows(body: Body, kernel: str, device: torch.device, bandwidth: float, contexts: tuple[int, ...],
                new_tokens: int, log=print) -> list[dict]:
    """bfloat16 / float32 (CPU dry run) and int4 rows of one body at each context, with transformers' own greedy
    loop over the same model beside each (what the engine's own work per token costs)."""
    from engine import EngineConfig, KVBoost
    from engine.weights.int4 import quantize_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = word_tokenizer(body.vocab)
    rows = []
    for weights in ("float", "int4"):
        start = time.perf_counter()
        model = build_model(body, device, dtype)
        if weights == "int4":
            quantize_model(model, group_size=128 if device.type == "cuda" else 32, kernel=kernel)
        built_s = time.perf_counter() - start
        engine = KVBoost(model, tokenizer, EngineConfig.of(reuse="off", disk_cache_bytes=0, speculative=None),
                         name=body.name)
        fmt = engine.info().weights.format
        graphs_off = engine.info().cuda_graphs_unavailable
        eager = engine.with_options(cuda_graphs=False)  # the same model, every step through transformers' forward
        for context in contexts:
            g = torch.Generator().manual_seed(context)
            ids = torch.randint(3, body.vocab, (context,), generator=g).tolist()
            engine.generate(ids, max_new_tokens=4, temperature=0)  # warm-up: kernels, allocator, rotary tables
            graphs = engine.runner.graph_step
            captures, capture_s = (graphs.captures, graphs.capture_s) if graphs is not None else (0, 0.0)
            result = engine.generate(ids, max_new_tokens=new_tokens, temperature=0)
            stats = result.stats
            if graphs is not None:
                captures, capture_s = graphs.captures - captures, graphs.capture_s - capture_s
            eager.generate(ids, max_new_tokens=4, temperature=0)
            eager_stats = eager.generate(ids, max_new_tokens=new_tokens, temperature=0).stats
            plain = plain_decode_tps(model, ids, new_tokens)
            nbytes = step_bytes(model, engine.info().weights.resident_bytes, context + new_tokens // 2,
                                kv_element_bytes=model.dtype.itemsize)
            limit = bandwidth / nbytes
            row = {"body": body.name, "weights": weights, "format": fmt, "kernel": kernel if weights == "int4" else "-",
                   "context": context, "new_tokens": stats.generated_tokens, "ttft_ms": stats.ttft_ms,
                   "prefill_tps": context / (stats.ttft_ms / 1e3) if stats.ttft_ms else float("nan"),
                   "decode_tps": stats.decode_tokens_per_s, "graphs": graphs_off is None,
                   "graphs_unavailable": graphs_off,
                   "graph_captures": captures, "capture_ms": capture_s * 1e3,
                   "eager_decode_tps": eager_stats.decode_tokens_per_s, "eager_ttft_ms": eager_stats.ttft_ms,
                   "transformers_decode_tps": plain, "bytes_per_token": nbytes,
                   "limit_tps": limit, "share": stats.decode_tokens_per_s / limit, "built_s": built_s}
            rows.append(row)
            log(f"  {body.name} {weights} @{context}: decode {row['decode_tps']:.1f} tok/s "
                f"({'CUDA graphs, ' + str(captures) + ' captures' if graphs_off is None else graphs_off}; "
                f"eager {row['eager_decode_tps']:.1f}; transformers' loop {plain:.1f}; limit {limit:.0f}, "
                f"share {row['share']:.0%}), TTFT {stats.ttft_ms:.1f} ms")
        del engine, eager, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"Engine decode on the device (copy bandwidth {bandwidth / 1e9:.0f} GB/s; greedy, reuse off, no drafts)",
             "",
             "| body | weights | format | context | TTFT ms | prefill tok/s | decode tok/s | graphs (captures, ms) | "
             "eager steps tok/s | transformers' loop tok/s | MB read / token | limit tok/s | share of the limit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        graphs = f"{r['graph_captures']}, {r['capture_ms']:.0f}" if r["graphs"] else "off"
        lines.append(f"| {r['body']} | {r['weights']} | {r['format']} | {r['context']} | {r['ttft_ms']:.1f} | "
                     f"{r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {graphs} | {r['eager_decode_tps']:.1f} | "
                     f"{r['transformers_decode_tps']:.1f} | "
                     f"{r['bytes_per_token'] / 2**20:.0f} | "
                     f"{r['limit_tps']:.0f} | {r['share']:.0%} |")
    return "\n".join(lines)


def plain_decode_tps(model, ids: list[int], new_tokens: int) -> float:
    """transformers' own greedy loop on the same model (a DynamicCache, one forward a token): the reference row."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    with torch.inference_mode():
        def run(n: int) -> float:
            cache = DynamicCache()
            out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
            token = out.logits[0, -1].argmax()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                out = model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
                token = out.logits[0, -1].argmax()
            int(token)
            return time.perf_counter() - start
        run(2)
        return new_tokens / run(new_tokens)


def profile_rows(body: Body, kernel: str, device: torch.device, context: int, new_tokens: int, folder: str,
                 log=print) -> list[dict]:
    """Where a decode step's time goes, float and int4: the engine's decode tok/s against transformers' own loop
    on the same model, and a torch.profiler table of `new_tokens` engine steps written to `folder`."""
    from torch.profiler import ProfilerActivity, profile

    from engine import EngineConfig, KVBoost
    from engine.weights.int4 import quantize_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tokenizer = word_tokenizer(body.vocab)
    ids = torch.randint(3, body.vocab, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    rows = []
    for weights in ("float", "int4"):
        model = build_model(body, device, dtype)
        if weights == "int4":
            quantize_model(model, group_size=128 if device.type == "cuda" else 32, kernel=kernel)
        engine = KVBoost(model, tokenizer, EngineConfig.of(reuse="off", disk_cache_bytes=0, speculative=None),
                         name=body.name)
        engine.generate(ids, max_new_tokens=4, temperature=0)
        ours = engine.generate(ids, max_new_tokens=new_tokens, temperature=0).stats.decode_tokens_per_s
        plain = plain_decode_tps(model, ids, new_tokens)
        with profile(activities=activities) as prof:
            engine.generate(ids, max_new_tokens=new_tokens, temperature=0)
        averages = prof.key_averages()
        with open(f"{folder}/profile-{body.name}-{weights}.txt", "w") as f:
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n\n")
            f.write(averages.table(sort_by=sort, row_limit=30))
        rows.append({"body": body.name, "weights": weights, "context": context, "engine_decode_tps": ours,
                     "transformers_decode_tps": plain})
        log(f"  profile {body.name} {weights} @{context}: engine {ours:.1f} tok/s, transformers' loop {plain:.1f}")
        del engine, model, prof
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
