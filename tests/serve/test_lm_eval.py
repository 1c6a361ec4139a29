"""lm-evaluation-harness scores a backend unchanged: its `local-completions` model with its
defaults (token-id batches, echo + logprobs for loglikelihood) and `local-chat-completions`
against the demo server, each equal to lm-eval's `hf` model on the same weights (float32, CPU).
The tasks are local JSONL files (tests/fixtures/lm_eval/), so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from jaxdd.cli import DEMO
from jaxdd.testing.server import running_server

# the fast tier (-m 'not slow') leaves it out: every test needs a server's and the hf model's runs
pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parents[1] / "fixtures" / "lm_eval"
TARGET = str(DEMO / "target")
# The demo target answers a chat turn with blank lines first: its chat task stops at a period.
TASKS = {
    "jaxdd_generate": ("generate.jsonl", "generate_until", '["\\n"]'),
    "jaxdd_chat": ("generate.jsonl", "generate_until", '["."]'),
    "jaxdd_choice": ("choice.jsonl", "multiple_choice", None),
}
TOLERANCE = 2e-3  # float32 on both sides; the sums run over a few tokens


def task_yaml(name: str, data: Path, cache: Path) -> str:
    """One lm-eval task over a local JSONL file, its dataset cache kept under the test's folder."""
    file, kind, until = TASKS[name]
    lines = [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        f"  data_files: {{test: '{data / file}'}}",
        f"  cache_dir: '{cache}'",
        "test_split: test",
        f"output_type: {kind}",
        "doc_to_text: '{{prompt}}'",
    ]
    if kind == "generate_until":
        lines += ["doc_to_target: '{{answer}}'"]
        lines += [f"generation_kwargs: {{until: {until}, max_gen_toks: 12, do_sample: false}}"]
        lines += ["metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]"]
    else:
        lines += ["doc_to_choice: '{{choices}}'", "doc_to_target: '{{answer}}'"]
        lines += ["metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> TaskManager:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name in TASKS:
        (folder / f"{name}.yaml").write_text(task_yaml(name, FIXTURES, folder / "datasets"))
    return TaskManager(include_path=str(folder))


def evaluate(model: str, model_args: dict, names: list[str], tasks: TaskManager, **extra) -> dict:
    """{task: (score, [each document's responses])} of one lm-eval run."""
    run = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        task_manager=tasks,
        log_samples=True,
        **extra,
    )
    out = {}
    for name in names:
        metric = "exact_match,none" if TASKS[name][1] == "generate_until" else "acc,none"
        samples = sorted(run["samples"][name], key=lambda s: s["doc_id"])
        out[name] = (run["results"][name][metric], [s["resps"] for s in samples])
    return out


@pytest.fixture(scope="module")
def hf(tasks) -> dict:
    """lm-eval's own `hf` model on the demo target: the reference for every server run."""
    args = {"pretrained": TARGET, "dtype": "float32", "device": "cpu"}
    plain = evaluate("hf", args, ["jaxdd_generate", "jaxdd_choice"], tasks)
    chat = evaluate("hf", args, ["jaxdd_chat"], tasks, apply_chat_template=True)
    return {**plain, **chat}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("lm_eval_server") / "server.log"
    # the prompts and their 12 tokens fit 64: four prompt buckets to warm, not twelve
    args = ["--max-batch", "4", "--max-len", "64", "--dtype", "float32"]
    with running_server(args, log) as process:
        yield process.url


def completions(url: str) -> dict:
    """lm-eval's defaults for `local-completions`: token-id prompts from the model's tokenizer."""
    return {"model": "kimi-mini", "base_url": f"{url}/v1/completions", "tokenizer": TARGET}


def test_generate_until_equals_hf(server, tasks, hf):
    ours = evaluate("local-completions", completions(server), ["jaxdd_generate"], tasks)
    assert ours["jaxdd_generate"] == hf["jaxdd_generate"]


def test_loglikelihood_equals_hf(server, tasks, hf):
    """Multiple choice: each choice's loglikelihood (echoed prompt logprobs) within TOLERANCE of
    the hf model's, whether it is the greedy continuation the same, and so the score."""
    ours = evaluate("local-completions", completions(server), ["jaxdd_choice"], tasks)
    score, docs = ours["jaxdd_choice"]
    hf_score, hf_docs = hf["jaxdd_choice"]
    assert score == hf_score
    for choices, hf_choices in zip(docs, hf_docs, strict=True):
        for [(value, greedy)], [(hf_value, hf_greedy)] in zip(choices, hf_choices, strict=True):
            assert abs(value - hf_value) <= TOLERANCE and greedy == hf_greedy


def test_chat_equals_hf(server, tasks, hf):
    args = {"model": "kimi-mini", "base_url": f"{server}/v1/chat/completions"}
    ours = evaluate("local-chat-completions", args, ["jaxdd_chat"], tasks, apply_chat_template=True)
    assert ours["jaxdd_chat"] == hf["jaxdd_chat"]
    assert any(responses != [""] for responses in ours["jaxdd_chat"][1])
