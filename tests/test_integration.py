"""Ordinary Hugging Face tooling on TinyLoop models: pipeline, lm-eval (Python API and command line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from helpers import REFERENCE, byte_tokenizer, tiny_model
from tinyloop_hf import TinyLoopForCausalLM
from tinyloop_hf.convert import convert_checkpoint
from tinyloop_hf.eval import TASKS_DIR

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the [test] extra")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The Ouro reference fixture converted, with a byte-level tokenizer (its vocabulary is 256 bytes)."""
    work = tmp_path_factory.mktemp("integration")
    source = work / "ouro"
    shutil.copytree(REFERENCE / "ouro-tiny", source)
    for path in source.iterdir():
        path.chmod(0o644)
    byte_tokenizer().save_pretrained(source)
    return convert_checkpoint(source, work / "tl")


def test_text_generation_pipeline_batched_and_with_loops(tokenizer):
    model = tiny_model("huginn")
    model.generation_config.do_sample = False  # pipelines sample unless the model's generation config says not
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["Once", "A longer prompt here"]
    outputs = generator(prompts, max_new_tokens=6, batch_size=2, num_loops=2, return_full_text=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = model.generate(ids, max_new_tokens=6, num_loops=2, pad_token_id=0)
        assert output[0]["generated_text"] == tokenizer.decode(alone[0, ids.shape[1] :], skip_special_tokens=True)
    deeper = generator(prompts[1], max_new_tokens=6, num_loops=3, return_full_text=False)
    assert deeper[0]["generated_text"] != outputs[1][0]["generated_text"]


def _loglikelihood(model, tokenizer, context: str, continuation: str, loops: int) -> float:
    context_ids = tokenizer(context).input_ids
    continuation_ids = tokenizer(continuation).input_ids
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = model(ids, num_loops=loops).logits.log_softmax(-1)[0, len(context_ids) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()


def test_hflm_loglikelihood_and_generate_until(converted):
    tokenizer = byte_tokenizer()
    model = TinyLoopForCausalLM.from_pretrained(converted, num_loops=2)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=256, backend="causal")
    pairs = [("Question: What is two plus two?\nAnswer:", " four"), ("The sky is", " blue")]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    for (context, continuation), (score, _) in zip(pairs, lm.loglikelihood(requests), strict=True):
        assert score == pytest.approx(_loglikelihood(model, tokenizer, context, continuation, 2), abs=1e-4)
    request = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)
    (text,) = lm.generate_until([request])
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :])
    assert text == expected.split("\n")[0]


def test_simple_evaluate_on_the_offline_tasks(converted):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = TinyLoopForCausalLM.from_pretrained(converted)
    lm = HFLM(pretrained=model, tokenizer=byte_tokenizer(), batch_size=4, max_length=256, backend="causal")
    results = simple_evaluate(
        model=lm,
        tasks=["tinyloop_mc", "tinyloop_gen", "tinyloop_ppl"],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        gen_kwargs="num_loops=2",
    )
    assert 0.0 <= results["results"]["tinyloop_mc"]["acc,none"] <= 1.0
    assert "exact_match,strip" in results["results"]["tinyloop_gen"]
    assert results["results"]["tinyloop_ppl"]["byte_perplexity,none"] > 1.0


def test_lm_eval_command_line_with_trust_remote_code(converted, tmp_path):
    """The CLI never imports tinyloop_hf itself: it loads the checkpoint's auto_map shims."""
    output = tmp_path / "results"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={converted},trust_remote_code=True,dtype=float32,num_loops=2",
        "--tasks",
        "tinyloop_mc",
        "--include_path",
        str(TASKS_DIR),
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(output),
        "--log_samples",
    ]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = [
        json.loads(line)
        for path in Path(output).rglob("samples_tinyloop_mc_*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert len(samples) == 12
    model = TinyLoopForCausalLM.from_pretrained(converted)
    tokenizer = byte_tokenizer()
    first = samples[0]
    context = first["arguments"]["gen_args_0"]["arg_0"]
    continuation = first["arguments"]["gen_args_0"]["arg_1"]
    logged = float(first["resps"][0][0][0])
    assert logged == pytest.approx(_loglikelihood(model, tokenizer, context, continuation, 2), abs=1e-4)
    assert logged != pytest.approx(_loglikelihood(model, tokenizer, context, continuation, 4), abs=1e-3)


def test_the_offline_tasks_give_a_perfect_model_full_marks():
    """A stand-in LM that answers every question right, as a model would (" Paris" after "Answer:"): tinyloop_gen's
    exact match and tinyloop_mc's accuracy are 1.0, and the multiple-choice continuations carry one space."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    answers = {}
    for line in (TASKS_DIR / "mc.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[f"Question: {row['question']}\nAnswer:"] = row["choices"][row["label"]]
    continuations = []

    class Oracle(LM):
        def generate_until(self, requests):
            return [answers[request.args[0]] for request in requests]

        def loglikelihood(self, requests):
            continuations.extend(request.args[1] for request in requests)
            return [(0.0 if cont == answers[ctx] else -10.0, True) for ctx, cont in (r.args for r in requests)]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    results = simple_evaluate(model=Oracle(), tasks=["tinyloop_gen", "tinyloop_mc"],
                              task_manager=TaskManager(include_path=str(TASKS_DIR)))["results"]  # fmt: skip
    assert results["tinyloop_gen"]["exact_match,strip"] == 1.0
    assert results["tinyloop_mc"]["acc,none"] == 1.0
    assert continuations and all(c.startswith(" ") and not c.startswith("  ") for c in continuations)
