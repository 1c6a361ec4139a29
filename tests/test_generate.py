"""python -m jaxdd.generate: greedy output equals HF greedy decoding; clear errors for bad arguments."""

from __future__ import annotations

import json

import pytest
import torch
from reference import TINY_K2, hf_model

from jaxdd.generate import main


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    model = hf_model(TINY_K2, seed=5)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory)
    return model, directory


def test_greedy_matches_hf_generate(hf_pair, capsys):
    model, directory = hf_pair
    prompt = [7, 100, 42, 3, 9]
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=TINY_K2["eos_token_id"]
        )[0, len(prompt) :].tolist()
    argv = ["--checkpoint", str(directory), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12"]
    assert main([*argv, "--dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == expected


def test_no_checkpoint_says_no_model_is_bundled(capsys):
    assert main([]) == 0
    assert "no default model is bundled yet" in capsys.readouterr().out


def test_bad_arguments(hf_pair, tmp_path, capsys):
    _, directory = hf_pair
    assert main(["--checkpoint", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(directory), "--prompt-ids", "1,999"]) == 2
    assert "id 999 at (0, 1) outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(directory), "--prompt-ids", "a,b"])
    assert "expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(directory)])
    assert "--prompt-ids is required" in capsys.readouterr().err
