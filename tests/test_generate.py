"""python -m jaxdd.generate: greedy AR / DFlash from checkpoints, text or id prompts, JSON, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
from reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jaxdd.generate import main

PROMPT = [7, 100, 42, 3, 9]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    target = hf_model(TINY_K2, seed=5)
    target.save_pretrained(root / "target")
    hf_drafter(drafter_config(block_size=4), seed=5).save_pretrained(root / "drafter")
    return target, root / "target", root / "drafter"


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--dtype", "float32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ar_and_dflash_match_hf_greedy(checkpoints, capsys):
    model, target, drafter = checkpoints
    expected = hf_greedy(model, PROMPT, 12)
    common = ["--checkpoint", str(target), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12"]
    common += ["--stop-ids", "0"]  # token 0 never comes up here; keeps the default EOS from cutting the output
    ar = run_json(capsys, *common)
    assert ar["method"] == "ar" and ar["output_ids"] == expected
    dflash = run_json(capsys, *common, "--drafter", str(drafter))
    assert dflash["method"] == "dflash" and dflash["output_ids"] == expected
    assert sum(dflash["acceptance_lengths"]) == len(expected) - 1  # the first token comes from the prefill
    assert dflash["timings"]["decode_seconds"] > 0
    tree = run_json(capsys, *common, "--drafter", str(drafter), "--method", "ddtree", "--budget", "16")
    assert tree["method"] == "ddtree" and tree["output_ids"] == expected


def test_text_prompt_with_tokenizer(checkpoints, tmp_path, capsys):
    model, target, _ = checkpoints
    tokenized = tmp_path / "with_tokenizer"
    shutil.copytree(target, tokenized)
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    tokenizer.save(str(tokenized / "tokenizer.json"))
    text = "def add(a, b):"
    out = run_json(capsys, "--checkpoint", str(tokenized), "--prompt", text, "--max-new-tokens", "4", "--stop-ids", "0")
    assert out["prompt_ids"] == tokenizer.encode(text).ids
    assert out["output_ids"] == hf_greedy(model, out["prompt_ids"], 4)


def test_no_checkpoint_says_no_model_is_bundled(capsys):
    assert main([]) == 0
    assert "no default model is bundled yet" in capsys.readouterr().out


def test_bad_arguments(checkpoints, tmp_path, capsys):
    _, target, drafter = checkpoints
    assert main(["--checkpoint", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(target), "--prompt-ids", "1,999"]) == 2
    assert "id 999 at (0, 1) outside the vocabulary" in capsys.readouterr().err
    assert main(["--checkpoint", str(target), "--prompt", "hello"]) == 2
    assert "no tokenizer.json; pass --prompt-ids" in capsys.readouterr().err
    assert main(["--checkpoint", str(target), "--drafter", str(tmp_path / "none"), "--prompt-ids", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err
    for argv, message in [
        (["--prompt-ids", "a,b"], "expected comma-separated integers"),
        ([], "give --prompt TEXT or --prompt-ids"),
        (["--prompt-ids", "1", "--method", "dflash"], "--method dflash needs --drafter"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt-ids", "1", "--method", "tree"], "invalid choice: 'tree'"),
        (["--prompt-ids", "1", "--method", "ddtree"], "--method ddtree needs --drafter"),
    ]:
        with pytest.raises(SystemExit):
            main(["--checkpoint", str(target), *argv])
        assert message in capsys.readouterr().err
    assert drafter.exists()


def test_sampling_options(checkpoints, capsys):
    _, target, drafter = checkpoints
    common = ["--checkpoint", str(target), "--drafter", str(drafter), "--prompt-ids", "7,100,42", "--stop-ids", "0"]
    common += ["--max-new-tokens", "8", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9"]
    first = run_json(capsys, *common, "--seed", "4")
    again = run_json(capsys, *common, "--seed", "4")
    other = run_json(capsys, *common, "--seed", "5")
    assert first["output_ids"] == again["output_ids"] != other["output_ids"]
    assert len(first["output_ids"]) == 8
    assert main([*common, "--top-p", "1.5"]) == 2
    assert "top_p: must be in (0, 1]" in capsys.readouterr().err
