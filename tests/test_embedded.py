"""The trained looped model shipped in the package: loads offline, generates, and depth changes its predictions."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from tokenizers import Tokenizer, processors
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinyloop_hf import TinyLoopForCausalLM, embedded_model_path
from tinyloop_hf.convert.__main__ import main as convert_main
from tinyloop_hf.convert.report import perplexity, text_windows
from tinyloop_hf.generate_cli import main as generate_main


@pytest.fixture(scope="module")
def embedded():
    directory = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def test_ships_inside_the_size_budget_with_its_card():
    directory = embedded_model_path()
    size = sum(path.stat().st_size for path in directory.iterdir())
    assert size <= 30 * 2**20
    card = (directory / "README.md").read_text()
    assert "held-out perplexity" in card.lower() and "shakespeare" in card.lower()
    config = json.loads((directory / "config.json").read_text())
    assert config["num_prelude_layers"] == 1 and config["num_loop_layers"] == 2 and config["num_coda_layers"] == 1


def test_loads_offline_with_its_tokenizer(embedded):
    model, tokenizer = embedded
    assert isinstance(model, TinyLoopForCausalLM) and model.config.exit_gate
    assert tokenizer("To be, or not to be").input_ids[:3] == [2068, 325, 28]


def test_depth_matters_on_held_out_text(embedded):
    model, tokenizer = embedded
    windows = text_windows(tokenizer, (embedded_model_path() / "heldout_sample.txt").read_text(), 256, limit=12)
    shallow, default = perplexity(model, windows, 1), perplexity(model, windows, 4)
    assert default < shallow and math.isfinite(default)


def test_generates_readable_text_at_several_depths(embedded, capsys):
    assert generate_main(["--loops", "1", "4", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "num_loops=1" in printed and "num_loops=4" in printed


def test_cli_takes_the_decoding_fields(embedded, capsys):
    arguments = ["--max-new-tokens", "12", "--draft-loops", "1", "--num-draft-tokens", "3", "--regex", r" (yes|no)\."]
    assert generate_main(arguments) == 0
    printed = capsys.readouterr().out
    assert "drafts at 1 loops:" in printed and ("\nyes." in printed or "\nno." in printed)
    assert generate_main(["--max-new-tokens", "2", "--loops", "4", "--early-exit", "kl"]) == 2
    assert "early_exit_threshold must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [(["--loops", "17"], "num_loops must be an integer in [1, max_loops=16]"),
     (["--draft-loops", "9"], "draft_loops must be an integer in [1, num_loops=4]"),
     (["--early-exit-threshold", "0.3"], "early_exit_threshold needs early_exit")],
)  # fmt: skip
def test_cli_names_a_bad_field_without_a_traceback(embedded, capsys, arguments, message):
    assert generate_main(["--max-new-tokens", "2", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_cli_on_a_checkpoint_without_tokenizer_says_so(tmp_path, capsys):
    shutil.copytree(embedded_model_path(), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "model" / name).unlink()
    assert generate_main(["--model", str(tmp_path / "model"), "--max-new-tokens", "2"]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err


def test_cli_chat_prompt_starts_with_one_bos(tmp_path, monkeypatch):
    """A tokenizer that prepends BOS and a template that writes it (Llama style): the prompt keeps one BOS."""
    directory = tmp_path / "model"
    shutil.copytree(embedded_model_path(), directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", bos)])  # fmt: skip
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                  "{% endfor %}")  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = []
    generate = TinyLoopForCausalLM.generate

    def spy(self, **kwargs):
        prompts.append(kwargs["input_ids"][0].tolist())
        return generate(self, **kwargs)

    monkeypatch.setattr(TinyLoopForCausalLM, "generate", spy)
    arguments = ["--model", str(directory), "--loops", "1", "--max-new-tokens", "1", "--prompt", "To be"]
    assert generate_main(arguments) == 0 and generate_main([*arguments, "--chat"]) == 0
    plain, chat = prompts
    assert plain[0] == bos and plain[1] != bos and chat == plain


def test_quantizing_converter_reports_per_depth(tmp_path, capsys):
    directory = embedded_model_path()
    arguments = [
        str(directory),
        str(tmp_path / "int4"),
        "--bits",
        "4",
        "--group-size",
        "64",
        "--method",
        "gptq",
        "--calib",
        str(directory / "calibration_sample.txt"),
        "--calib-samples",
        "4",
        "--calib-length",
        "64",
        "--eval-text",
        str(directory / "heldout_sample.txt"),
        "--eval-windows",
        "2",
        "--report-depths",
        "1",
        "4",
        "--device",
        "cpu",
    ]
    assert convert_main(arguments) == 0
    printed = capsys.readouterr().out
    assert "top-1 agree" in printed and "quantized: prelude=4/g64/asym" in printed
    rows = [line.split() for line in printed.splitlines() if line.strip().startswith(("1 ", "4 "))]
    assert [row[0] for row in rows] == ["1", "4"]
    assert all(0.5 < float(row[1]) <= 1.0 for row in rows)  # top-1 agreement with the fp model
    quantized = TinyLoopForCausalLM.from_pretrained(tmp_path / "int4")
    assert quantized.model.loop_layers[0].mlp.up_proj.format.bits == 4
    size = sum(p.stat().st_size for p in (tmp_path / "int4").glob("*.safetensors"))
    assert size < sum(p.stat().st_size for p in directory.glob("*.safetensors"))
