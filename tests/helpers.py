"""Shared test helpers: tiny configs for every architecture variant, a byte tokenizer, fixture paths, decode-step
logits."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tinyloop_hf import TinyLoopConfig, TinyLoopForCausalLM

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = FIXTURES / "reference"
VOCAB = 256

# One config per architecture family, all tiny: they differ only in TinyLoopConfig fields.
VARIANTS: dict[str, dict] = {
    "llama": dict(num_loop_layers=2, num_loops=1, num_key_value_heads=2),
    "ouro": dict(num_loop_layers=2, num_loops=3, block_norm="sandwich", final_norm="every_loop", exit_gate=True),
    "huginn": dict(
        num_prelude_layers=1,
        num_loop_layers=2,
        num_coda_layers=1,
        num_loops=3,
        block_norm="post_residual",
        final_norm="before_and_after_coda",
        input_injection="linear_concat",
        attention_bias="qk",
        rope_layout="interleaved",
        embedding_scale=4.0,
        tie_word_embeddings=True,
    ),
    "tinyloop": dict(
        num_prelude_layers=1,
        num_loop_layers=1,
        num_coda_layers=1,
        num_loops=2,
        input_injection="add",
        initial_state="random",
        initial_state_std=0.5,
        attention_bias="qkv",
        num_key_value_heads=1,
        exit_gate=True,
    ),
}


def tiny_config(variant: str = "ouro", **overrides) -> TinyLoopConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        max_position_embeddings=128,
        eos_token_id=None,
        pad_token_id=0,
    )
    base.update(VARIANTS[variant])
    base.update(overrides)
    return TinyLoopConfig(**base)


def tiny_model(variant: str = "ouro", seed: int = 0, **overrides) -> TinyLoopForCausalLM:
    """A random model whose weights are far from the init (unit norms and tiny weights hide bugs)."""
    torch.manual_seed(seed)
    model = TinyLoopForCausalLM(tiny_config(variant, **overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if parameter.dim() == 1 and "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) * 0.8 + 0.6)
            elif parameter.dim() == 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return model.eval()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters), strict=True))


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token id = byte value (vocab 256, no merges); byte 0 is EOS and PAD. Fits the 256-token fixtures."""
    table = _bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    eos = table[0]
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos, bos_token=None)


def decode_logits(model, ids: torch.Tensor, prompt: int, cache) -> torch.Tensor:
    """fp32 logits [B, 1 + steps, V]: the last prompt token's (``ids[:, :prompt]`` as one forward), then each
    following token's, fed one decode step at a time through ``cache``."""
    with torch.no_grad():
        steps = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(steps, 1).float()
