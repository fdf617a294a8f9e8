"""Convert an Ouro-format checkpoint once, then use it from plain Hugging Face code.

python examples/convert_and_load.py /tmp/ouro-tinyloop
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tinyloop_hf.convert import convert_checkpoint

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference" / "ouro-tiny"
destination = convert_checkpoint(FIXTURE, sys.argv[1] if len(sys.argv) > 1 else "ouro-tinyloop")

# trust_remote_code loads the checkpoint's two small auto_map shims, which import the installed package;
# after `import tinyloop_hf` it is not even needed.
model = AutoModelForCausalLM.from_pretrained(destination, trust_remote_code=True)
ids = torch.tensor([[5, 17, 42]])
print("default depth (4):", model.generate(ids, max_new_tokens=6, do_sample=False).tolist())
print("exit gate, threshold 0.5:", model.generate(ids, max_new_tokens=6, do_sample=False, exit_threshold=0.5).tolist())
