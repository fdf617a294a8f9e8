"""Decoding features of looped models, on the embedded trained model (offline): self-speculative decoding (draft with
one loop, verify with four), per-token early exit that skips the remaining loops, and a warm-up schedule."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinyloop_hf import embedded_model_path

path = embedded_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
ids = tokenizer("HAMLET. To be, or not to be,", return_tensors="pt").input_ids
greedy = dict(max_new_tokens=32, do_sample=False)

plain = model.generate(ids, **greedy)
print("plain:", tokenizer.decode(plain[0, ids.shape[1] :]))

speculative = model.generate(ids, draft_loops=1, num_draft_tokens="adaptive", **greedy)
stats = model.speculation_stats
print(f"self-speculative: identical={torch.equal(speculative, plain)}, acceptance {stats.acceptance_rate:.0%}, "
      f"{stats.tokens_per_round:.1f} tokens per verify")  # fmt: skip

with torch.no_grad():  # early exit, step by step, to see how many loops each token ran
    cache = model.new_cache()
    logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    loops = []
    for _ in range(16):
        token = logits.argmax(-1, keepdim=True)
        out = model(token, past_key_values=cache, use_cache=True, early_exit="kl", early_exit_threshold=0.05)
        logits, loops = out.logits[:, -1], loops + [int(out.loops_run[0])]
print("early exit (kl < 0.05), loops per token:", loops)

warm = model.generate(ids, warmup_tokens=8, warmup_loops=1, **greedy)
print("first 8 tokens at one loop:", tokenizer.decode(warm[0, ids.shape[1] :]))
