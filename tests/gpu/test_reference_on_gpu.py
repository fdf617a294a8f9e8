"""The reference path on a CUDA GPU: same numbers as on the CPU (skipped cleanly without a GPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import REFERENCE, VARIANTS, tiny_model
from tinyloop_hf import QuantEmbedding, QuantFormat, QuantLinear
from tinyloop_hf.convert import build_model, read_source
from tinyloop_hf.quant_tinyloop import dequantize, quantize_rtn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quant_linear_is_dequantize_then_matmul_on_gpu(bits, dtype):
    fmt = QuantFormat(bits=bits, group_size=64, symmetric=bits == 8)
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits))
    packed = quantize_rtn(weight, fmt)
    layer = QuantLinear(256, 96, True, fmt)
    layer.load_packed(packed)
    layer.bias.data.normal_()
    layer = layer.cuda()
    assert layer.scales.dtype == torch.float16 and layer.qweight.is_cuda
    x = torch.randn(5, 256, device="cuda", dtype=dtype)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight().to(dtype), layer.bias.to(dtype))
    assert torch.equal(layer.to(dtype)(x), expected)
    assert torch.equal(dequantize(packed, fmt).cuda(), layer.dequantized_weight())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quant_embedding_lookup_replays_in_a_cuda_graph(bits):
    """The lookup is captured once and replayed with new ids: no host sync or host tensor inside it."""
    fmt = QuantFormat(bits=bits, group_size=64)
    embedding = QuantEmbedding(300, 256, fmt)
    embedding.load_packed(quantize_rtn(torch.randn(300, 256, generator=torch.Generator().manual_seed(bits)), fmt))
    embedding = embedding.cuda().to(torch.bfloat16)
    ids = torch.zeros(4, 5, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graph asks
        embedding(ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(ids)
    table = dequantize(embedding.packed(), fmt)
    for seed in range(3):
        new = torch.randint(0, 300, (4, 5), generator=torch.Generator().manual_seed(seed)).cuda()
        ids.copy_(new)
        graph.replay()
        assert torch.equal(out, table[new].to(torch.bfloat16))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_on_gpu_matches_cpu(variant):
    model = tiny_model(variant)
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cpu = model(ids, num_loops=3).logits
        gpu = model.cuda()(ids.cuda(), num_loops=3).logits.cpu()
    assert (cpu - gpu).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name, key", [("ouro-tiny", "greedy_tokens_ut4"), ("huginn-tiny", "greedy_tokens")])
def test_reference_fixture_greedy_on_gpu(name, key):
    model = build_model(read_source(REFERENCE / name)).float().cuda()
    reference = load_file(str(REFERENCE / name / "reference.safetensors"))
    tokens = model.generate(reference["prompt_ids"].cuda(), max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(tokens.cpu(), reference[key])


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_and_gptq_run_on_gpu_tensors(bits):
    from tinyloop_hf.convert.gptq import gptq_quantize
    from tinyloop_hf.quant_tinyloop import unpack

    fmt = QuantFormat(bits=bits, group_size=128)
    weight = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    on_cpu, on_gpu = quantize_rtn(weight, fmt), quantize_rtn(weight.cuda(), fmt)
    assert on_gpu.qweight.is_cuda
    agree = (unpack(on_cpu, fmt) == unpack(on_gpu, fmt).cpu()).float().mean()
    assert agree > 0.999  # ties in round() may fall differently
    hessian = torch.eye(576, device="cuda") * 2
    packed = gptq_quantize(weight.cuda(), hessian, fmt)
    assert (dequantize(packed, fmt) - weight).abs().max() <= on_cpu.scales.float().max() * 0.51
