"""tinyloop-convert: every source format, the written directory, remote code, and the errors users meet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import REFERENCE, byte_tokenizer
from tinyloop_hf import QuantEmbedding, TinyLoopForCausalLM
from tinyloop_hf.convert import ConversionError, build_model, convert_checkpoint, read_source
from tinyloop_hf.convert.__main__ import main as convert_main


def _copy_source(name: str, destination: Path) -> Path:
    source = destination / name
    shutil.copytree(REFERENCE / name, source)
    for path in source.iterdir():
        path.chmod(0o644)
    (source / "reference.safetensors").unlink()
    return source


@pytest.fixture(scope="module")
def converted_ouro(tmp_path_factory):
    work = tmp_path_factory.mktemp("ouro")
    source = _copy_source("ouro-tiny", work)
    byte_tokenizer().save_pretrained(source)
    assert convert_main([str(source), str(work / "tl")]) == 0
    return work / "tl"


def test_cli_writes_a_complete_directory(converted_ouro, capsys):
    names = {path.name for path in converted_ouro.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "configuration_tinyloop.py",
        "modeling_tinyloop.py",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    config = json.loads((converted_ouro / "config.json").read_text())
    assert config["model_type"] == "tinyloop" and config["auto_map"]["AutoModelForCausalLM"]
    assert config["num_loops"] == 4 and config["exit_gate"] and config["final_norm"] == "every_loop"
    generation = json.loads((converted_ouro / "generation_config.json").read_text())
    assert generation["_from_model_config"] is False and generation["eos_token_id"] == 0


def test_converted_directory_loads_through_auto_classes_and_matches_reference(converted_ouro):
    reference = load_file(str(REFERENCE / "ouro-tiny" / "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(converted_ouro)
    assert isinstance(model, TinyLoopForCausalLM)
    with torch.no_grad():
        logits = model(reference["input_ids"], num_loops=2).logits
    assert (logits - reference["logits_ut2"]).abs().max() <= 1e-4
    assert AutoTokenizer.from_pretrained(converted_ouro).decode([72, 105]) == "Hi"


@pytest.mark.parametrize("theta", [10000.0, 49000.0])
def test_a_huginn_rope_table_that_does_not_match_the_config_is_refused(theta):
    """The checkpoint's stored freqs_cis (rope_base 50000) against a config with another base: refused, even 2% off."""
    with pytest.raises(ConversionError, match="freqs_cis stored in the Huginn checkpoint does not match"):
        build_model(read_source(REFERENCE / "huginn-tiny"), rope_theta=theta)


def test_huginn_converts_with_the_zero_initial_state(tmp_path):
    source = _copy_source("huginn-tiny", tmp_path)
    destination = convert_checkpoint(source, tmp_path / "tl", max_loops=40)
    config = json.loads((destination / "config.json").read_text())
    assert config["initial_state"] == "zeros" and config["max_loops"] == 40 and config["num_loops"] == 6
    assert "lm_head.weight" not in load_file(str(destination / "model.safetensors"))  # tied, stored once
    reference = load_file(str(REFERENCE / "huginn-tiny" / "reference.safetensors"))
    model = TinyLoopForCausalLM.from_pretrained(destination)
    with torch.no_grad():
        assert (model(reference["input_ids"]).logits - reference["logits"]).abs().max() <= 1e-4


def test_dtype_is_kept_or_converted_on_request(tmp_path):
    source = _copy_source("ouro-tiny", tmp_path)
    destination = convert_checkpoint(source, tmp_path / "bf16", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(destination / "model.safetensors")).values())
    assert TinyLoopForCausalLM.from_pretrained(destination).dtype == torch.bfloat16
    with pytest.raises(ConversionError, match="dtype must be one of"):
        convert_checkpoint(source, tmp_path / "x", dtype="int8")


def test_missing_source_tensor_is_named(tmp_path):
    source = _copy_source("ouro-tiny", tmp_path)
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"missing tensors \['model.loop_layers.1.mlp.up_proj.weight'\]"):
        convert_checkpoint(source, tmp_path / "out")


def test_shape_mismatched_source_tensor_is_named(tmp_path):
    source = _copy_source("ouro-tiny", tmp_path)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(
        ConversionError,
        match=r"model.loop_layers.0.self_attn.k_proj.weight: expected \[64, 64\], "
        r"got \[32, 64\]",
    ):
        convert_checkpoint(source, tmp_path / "out")


def test_unknown_architecture_is_refused(tmp_path, capsys):
    source = _copy_source("ouro-tiny", tmp_path)
    config = json.loads((source / "config.json").read_text())
    config["model_type"] = "mamba"
    (source / "config.json").write_text(json.dumps(config))
    assert convert_main([str(source), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "unknown architecture: config.json model_type='mamba'" in error and "'huginn_raven'" in error


def test_missing_tensor_at_load_time_is_an_error(converted_ouro, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(converted_ouro, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys: \['model.norm.weight'\]"):
        AutoModelForCausalLM.from_pretrained(broken)


def _run_fresh(code: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=environment, capture_output=True, text=True, timeout=300
    )


def test_fresh_process_loads_with_trust_remote_code_and_generates_the_same(converted_ouro, tmp_path):
    prompt = [[72, 105, 32, 116, 104, 101]]
    expected = TinyLoopForCausalLM.from_pretrained(converted_ouro).generate(
        torch.tensor(prompt), max_new_tokens=12, do_sample=False
    )
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(converted_ouro)!r}, trust_remote_code=True)\n"
        "assert 'tinyloop_hf' in sys.modules\n"
        f"print(model.generate(torch.tensor({prompt}), max_new_tokens=12, do_sample=False).tolist())\n"
    )
    result = _run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected.tolist()


def test_fresh_process_without_the_package_says_how_to_install(converted_ouro, tmp_path):
    code = (
        "import sys\n"
        "sys.modules['tinyloop_hf'] = None  # as if the package were not installed\n"
        "from transformers import AutoModelForCausalLM\n"
        f"AutoModelForCausalLM.from_pretrained({str(converted_ouro)!r}, trust_remote_code=True)\n"
    )
    result = _run_fresh(code, tmp_path)
    assert result.returncode != 0
    assert "pip install tinyloop-hf" in result.stderr


def test_save_pretrained_round_trip_keeps_shims_and_weights(converted_ouro, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(converted_ouro, trust_remote_code=True)
    model.save_pretrained(tmp_path / "again")
    shim = (tmp_path / "again" / "modeling_tinyloop.py").read_text()
    assert "from tinyloop_hf import" in shim and len(shim.splitlines()) < 12
    reloaded = TinyLoopForCausalLM.from_pretrained(tmp_path / "again")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_push_to_hub_uploads_a_loadable_folder_with_shims(monkeypatch, tmp_path):
    """No hub here: capture the folder push_to_hub would upload and load it in a fresh process."""
    import transformers.utils.hub as hub

    from helpers import tiny_model

    class _Repo:
        repo_id = "user/tinyloop-test"

    class _Api:
        def create_repo(self, *args, **kwargs):
            return _Repo()

    uploaded = tmp_path / "uploaded"

    def capture(self, folder, *args, **kwargs):
        shutil.copytree(folder, uploaded)

    monkeypatch.setattr(hub, "hf_api", lambda: _Api())
    monkeypatch.setattr(
        hub,
        "create_and_tag_model_card",
        lambda *args, **kwargs: type("Card", (), {"save": lambda self, path: Path(path).write_text("card")})(),
    )
    monkeypatch.setattr(TinyLoopForCausalLM, "_upload_modified_files", capture)
    model = tiny_model("huginn")
    model.generation_config.num_loops = 2
    model.push_to_hub("user/tinyloop-test")
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "configuration_tinyloop.py",
        "modeling_tinyloop.py",
    } <= {path.name for path in uploaded.iterdir()}
    expected = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=6, do_sample=False).tolist()
    code = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(uploaded)!r}, trust_remote_code=True)\n"
        "print(model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=6, do_sample=False).tolist())\n"
    )
    result = _run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_base_model_loads_from_a_causal_lm_checkpoint(converted_ouro):
    from transformers import AutoModel

    from tinyloop_hf import TinyLoopModel

    base = AutoModel.from_pretrained(converted_ouro)
    full = TinyLoopForCausalLM.from_pretrained(converted_ouro)
    assert isinstance(base, TinyLoopModel)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, full.model(ids).last_hidden_state)


def test_quantizing_a_source_without_tokenizer_skips_only_the_report(tmp_path, capsys):
    source = _copy_source("huginn-tiny", tmp_path)
    assert convert_main([str(source), str(tmp_path / "q"), "--bits", "4", "--group-size", "32", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "quality report skipped: SRC has no tokenizer" in printed and "quantized: prelude=4/g32/asym" in printed
    model = TinyLoopForCausalLM.from_pretrained(tmp_path / "q")
    assert model.model.injection.format.bits == 4


def test_layers_that_cannot_be_packed_are_named_by_the_converter(tmp_path, capsys):
    source = _copy_source("ouro-tiny", tmp_path)  # intermediate_size 176 is not a multiple of 32
    assert convert_main([str(source), str(tmp_path / "q"), "--bits", "4", "--no-report"]) == 2
    assert "model.loop_layers.0.mlp.down_proj: in_features=176 must be a multiple of 32" in capsys.readouterr().err


def test_the_converter_quantizes_the_embedding_of_a_tied_model(tmp_path, capsys):
    source = _copy_source("huginn-tiny", tmp_path)  # tie_embeddings: true
    assert convert_main([str(source), str(tmp_path / "q"), "--embed-tokens-bits", "8", "--no-report"]) == 0
    assert "embed_tokens=8/channel/asym (rtn)" in capsys.readouterr().out
    model = TinyLoopForCausalLM.from_pretrained(tmp_path / "q")
    reference = build_model(read_source(source))
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.format.group_size is None
    assert not model.config.tie_word_embeddings and torch.equal(model.lm_head.weight, reference.lm_head.weight)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def _tiny_qwen2(directory: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A tiny Qwen2 checkpoint (random weights) as transformers saves it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**{**config, **overrides})).to(dtype).save_pretrained(directory)
    return directory


def _tiny_qwen2_gguf(directory: Path) -> Path:
    """The tiny Qwen2 as an F32 GGUF file with a BPE tokenizer (what llama.cpp's converter writes, in small)."""
    import gguf
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer=trainer)
    vocab, merges = tokenizer.get_vocab(), json.loads(tokenizer.to_str())["model"]["merges"]
    tokens = sorted(vocab, key=vocab.get)
    model = AutoModelForCausalLM.from_pretrained(_tiny_qwen2(directory / "hf", vocab_size=len(tokens)))
    config = model.config
    writer = gguf.GGUFWriter(str(directory / "model.gguf"), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, tensor in model.state_dict().items():
        if name not in names:
            _, _, layer, *module, kind = name.split(".")
            names[name] = f"blk.{layer}.{per_layer['.'.join(module)]}.{kind}"
        writer.add_tensor(names[name], tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory


def _parity_table(printed: str) -> tuple[str, float, str]:
    """(title's dtype, max |delta logit|, identical greedy) from the converter's parity report."""
    lines = printed[printed.index("parity vs transformers") :].splitlines()
    return lines[0].split("weights in ")[1].split(",")[0], float(lines[2].split()[-1]), lines[3].split()[-1]


def test_gguf_cli_conversion_writes_and_reports_parity(tmp_path, capsys):
    source = _tiny_qwen2_gguf(tmp_path)
    assert convert_main([str(source), str(tmp_path / "tl"), "--gguf-file", "model.gguf"]) == 0
    assert _parity_table(capsys.readouterr().out) == ("float32", 0.0, "4/4")
    assert AutoTokenizer.from_pretrained(tmp_path / "tl").decode([5, 6]) != ""


def test_a_bfloat16_conversion_is_compared_with_the_reference_at_the_same_weights(tmp_path, capsys):
    """The report measures the conversion, not bf16 rounding: both models run in fp32 from the same bf16 weights."""
    source = _tiny_qwen2(tmp_path / "src")
    assert convert_main([str(source), str(tmp_path / "tl"), "--dtype", "bfloat16"]) == 0
    assert _parity_table(capsys.readouterr().out) == ("bfloat16", 0.0, "4/4")
    assert TinyLoopForCausalLM.from_pretrained(tmp_path / "tl").dtype == torch.bfloat16


def test_quantizing_a_llama_family_source_reports_the_conversion_parity_and_keeps_the_dtype(tmp_path, capsys):
    source = _tiny_qwen2(tmp_path / "src", torch.bfloat16)
    assert convert_main([str(source), str(tmp_path / "q"), "--bits", "4", "--group-size", "32", "--no-report"]) == 0
    assert _parity_table(capsys.readouterr().out) == ("bfloat16", 0.0, "4/4")
    model = TinyLoopForCausalLM.from_pretrained(tmp_path / "q")
    assert model.model.norm.weight.dtype == torch.bfloat16 and model.model.loop_layers[0].mlp.down_proj.format.bits == 4


def test_converting_a_checkpoint_into_itself_rewrites_it(tmp_path):
    converted = convert_checkpoint(_tiny_qwen2(tmp_path / "src"), tmp_path / "tl")
    byte_tokenizer().save_pretrained(converted)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = TinyLoopForCausalLM.from_pretrained(converted)(ids).logits
    assert convert_main([str(converted), str(converted), "--dtype", "bfloat16", "--no-parity"]) == 0
    model = TinyLoopForCausalLM.from_pretrained(converted)
    with torch.no_grad():
        got = model(ids).logits
    assert model.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 0.05 * want.abs().max()
    assert AutoTokenizer.from_pretrained(converted).decode([72, 105]) == "Hi"


def test_a_tokenizer_left_in_dst_by_an_earlier_conversion_is_removed(tmp_path, capsys):
    destination = tmp_path / "tl"
    source = _tiny_qwen2(tmp_path / "src")
    byte_tokenizer().save_pretrained(source)
    convert_checkpoint(source, destination)
    assert (destination / "tokenizer.json").exists()
    convert_checkpoint(_copy_source("ouro-tiny", tmp_path), destination)  # no tokenizer files
    assert not any((destination / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    assert "replaced the tokenizer files an earlier conversion left" in capsys.readouterr().out


def test_a_llama_config_without_rope_theta_gets_transformers_default(tmp_path):
    source = _tiny_qwen2(tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    config.pop("rope_parameters", None), config.pop("rope_theta", None)
    (source / "config.json").write_text(json.dumps(config))
    assert build_model(read_source(source)).config.rope_theta == 10000.0


@pytest.mark.parametrize(
    "flags, message",
    [(["--bits", "4", "--calib", "/nonexistent.txt"], "--calib: no such file"),
     (["--bits", "4", "--eval-text", "/nonexistent.txt"], "--eval-text: no such file"),
     (["--bits", "4", "--calib-samples", "0"], "--calib-samples must be at least 1, got 0"),
     (["--max-loops", "0"], "--max-loops must be at least 1, got 0")],
)  # fmt: skip
def test_bad_arguments_fail_before_any_work_naming_the_flag(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        convert_main([str(tmp_path / "missing-src"), str(tmp_path / "dst"), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_a_depth_given_to_the_conversion_replaces_the_source_generation_configs(tmp_path):
    source = _copy_source("ouro-tiny", tmp_path)
    (source / "generation_config.json").write_text(json.dumps({"num_loops": 2, "draft_loops": 1}))
    model = build_model(read_source(source), num_loops=3)
    assert (model.config.num_loops, getattr(model.generation_config, "num_loops", None)) == (3, None)
    assert model.config.trained_loops == json.loads((source / "config.json").read_text())["total_ut_steps"]
    assert model.generation_config.draft_loops == 1  # the rest is kept
    (source / "generation_config.json").write_text(json.dumps({"num_loops": 8}))
    with pytest.raises(ConversionError, match=r"generation_config.num_loops=8 .* \[1, 4\] \(max_loops=4\)"):
        build_model(read_source(source), max_loops=4)


def test_unknown_override_fields_and_a_missing_gguf_file_are_refused(tmp_path):
    source = _copy_source("ouro-tiny", tmp_path)
    with pytest.raises(ConversionError, match=r"unknown TinyLoopConfig fields \['num_lops'\]"):
        convert_checkpoint(source, tmp_path / "dst", num_lops=4)
    with pytest.raises(ValueError, match="TinyLoopConfig.num_loops must be an integer >= 1, got '4'"):
        build_model(read_source(source), num_loops="4")
    with pytest.raises(ConversionError, match="--gguf-file 'nope.gguf': no such file"):
        read_source(source, "nope.gguf")
    assert not (tmp_path / "dst").exists()


def test_huginn_generation_stops_on_its_end_of_text_and_turn_tokens(tmp_path):
    from tinyloop_hf.convert.core import generation_config

    source = read_source(_copy_source("huginn-tiny", tmp_path))
    config = build_model(source).config
    assert 65504 >= config.vocab_size  # the fixture's vocabulary has no such ids: its eos stays as it was
    assert generation_config(source, config).eos_token_id == config.eos_token_id
    config.vocab_size, config.eos_token_id = 65536, 65505
    source.generation = None
    assert generation_config(source, config).eos_token_id == [65505, 65504, 65508]
