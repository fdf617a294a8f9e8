"""Loop depth is a runtime argument: one loaded model, several depths, and one batch whose rows differ in depth.

Runs offline on the Huginn-format reference fixture shipped with the tests (random weights: the point is the API).
"""

from pathlib import Path

import torch

import tinyloop_hf  # noqa: F401  (registers TinyLoop with the Auto classes)
from tinyloop_hf.convert import build_model, read_source

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference" / "huginn-tiny"

model = build_model(read_source(FIXTURE))  # Huginn checkpoint -> TinyLoopForCausalLM, in memory
prompt = torch.tensor([[12, 200, 31, 7, 99]])

for depth in (1, 4, 8):
    tokens = model.generate(prompt, num_loops=depth, max_new_tokens=8, do_sample=False)
    print(f"num_loops={depth}: {tokens[0, prompt.shape[1] :].tolist()}")

# One batch, three depths: each row equals running it alone at its own depth.
batch = prompt.repeat(3, 1)
print(
    "per-row depths [1, 4, 8]:",
    model.generate(batch, num_loops=[1, 4, 8], max_new_tokens=8, do_sample=False)[:, prompt.shape[1] :].tolist(),
)

# The default depth for generate() can live in generation_config (it survives save_pretrained).
model.generation_config.num_loops = 4
print("generation_config.num_loops=4:", model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 5:].tolist())

# Logit lens: the state after every loop, read out through the coda and head.
with torch.no_grad():
    output = model(prompt, num_loops=8, output_hidden_states=True)
lens = [model.logits_from_state(state)[0, -1].argmax().item() for state in output.hidden_states[1:]]
print("logit lens, next token after each loop:", lens)
