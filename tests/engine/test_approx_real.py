"""APPROXIMATE reuse on the real model: documents warmed alone are found inside reordered RAG prompts, and each
repair mode keeps the answer closer to full prefill than no repair does.

Measured on these three prompts (first answer token, KL of the approximate next-token distribution from full
prefill's; greedy tokens shared with full prefill out of 32), mean over the prompts, with the default model as
"auto" loads it on an AVX-512 CPU (int4 layers on torch's kernel, an int8 head) and on an AVX2 CPU (the file's
blocks through engine.block_forward, int16 activations; the same to three digits):
  none        KL 0.124 (0.120, 0.147, 0.103)  common prefix 14.7 (16, 10, 18)
  selective   KL 0.117 (0.083, 0.240, 0.029)  common prefix 15.7 (16, 16, 15)
  cacheblend  KL 0.074 (0.082, 0.110, 0.029)  common prefix 18.7 (16, 16, 24)
With int8 activations in the blocks (llama.cpp's rounding) every mode moved (none 0.149, selective 0.138,
cacheblend 0.101), so each mode is held against no repair's numbers in the same run, not against fixed floors.
The first answer token agrees with full prefill on every prompt in every mode (no repair included), so it is
no floor. Selective's margin over no repair is thin on these prompts (5% in mean KL, one token in mean prefix;
on the second prompt its KL is worse than no repair's), cacheblend's is wide."""

from __future__ import annotations

import pytest
from quality import common_prefix, kl

from bench import needle

ORDERS = [(2, 0, 3, 1), (1, 3, 0, 2), (3, 2, 1, 0)]
NEW_TOKENS = 32
# mode -> (mean KL below this share of no repair's, mean common prefix at least this many tokens above no repair's)
MARGINS = {"selective": (0.97, 1.0), "cacheblend": (0.80, 3.0)}


@pytest.fixture(scope="module")
def measured(smollm):
    """Mean KL and common prefix against full prefill per repair mode, "none" included."""
    docs = needle.make_documents(num_docs=4, chars=700)
    questions = [needle.NeedleQuestion(order, order[-1], f"What is the archive code of the {docs[order[-1]].name} "
                                       "collection?", docs[order[-1]].code) for order in ORDERS]
    prompts = [needle.messages_for(docs, q) for q in questions]
    off = smollm.with_options(reuse="off")
    refs = [off.chat(m, max_new_tokens=NEW_TOKENS, return_logits=True) for m in prompts]
    out = {}
    for mode in ("none", "selective", "cacheblend"):
        eng = smollm.with_options(reuse="approx", repair=mode)
        for doc in docs:
            eng.warm(needle.warm_messages(doc))
        kls, prefixes = [], []
        for m, ref in zip(prompts, refs):
            res = eng.chat(m, max_new_tokens=NEW_TOKENS, return_logits=True)
            approx_tokens = sum(e - s for s, e, kind in res.stats.chunks if kind == "APPROXIMATE")
            # measured 0.57 (selective recomputes 16 tokens per seam) to 0.76 of the prompt
            assert approx_tokens >= 0.55 * res.stats.prompt_tokens, res.stats.chunks
            assert res.stats.repair == mode
            if mode == "cacheblend":
                assert res.stats.repaired_tokens > 0
            kls.append(kl(ref.first_logits, res.first_logits))
            prefixes.append(common_prefix(res.token_ids, ref.token_ids))
        out[mode] = {"kl": sum(kls) / len(kls), "prefix": sum(prefixes) / len(prefixes), "kls": kls,
                     "prefixes": prefixes}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "cacheblend"])
def test_repair_keeps_reordered_documents_closer_to_full_prefill_than_no_repair(measured, mode):
    kl_share, prefix_gain = MARGINS[mode]
    got, none = measured[mode], measured["none"]
    assert got["kl"] < kl_share * none["kl"], (got, none)
    assert got["prefix"] >= none["prefix"] + prefix_gain, (got, none)
