"""Join train.py's output (parts + config.json) and the tokenizer into a loadable TinyLoop checkpoint.

python examples/embedded_model/assemble.py OUT_FROM_TRAINING data/tokenizer DST
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM


def load_parts(folder: Path) -> dict[str, torch.Tensor]:
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for path in sorted(folder.glob("part-*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            match = re.fullmatch(r"(.+)::(\d+)/(\d+)", name)
            base, index = (match.group(1), int(match.group(2))) if match else (name, 0)
            pieces.setdefault(base, {})[index] = tensor
    return {name: torch.cat([parts[i] for i in sorted(parts)]) for name, parts in pieces.items()}


def main() -> None:
    trained, tokenizer, destination = map(Path, sys.argv[1:4])
    config = TinyLoopConfig.from_pretrained(trained)
    model = TinyLoopForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_parts(trained), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"parts do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.do_sample = False
    model.save_pretrained(destination)
    for path in tokenizer.iterdir():
        shutil.copy2(path, destination / path.name)
    print(f"wrote {destination}")


if __name__ == "__main__":
    main()
