"""python -m jaxdd.generate: the bundled demo, greedy AR / DFlash / DDTree from checkpoints,
text (argument, file, stdin, chat template) or id prompts, streamed text, JSON, clear errors."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jaxdd.generate import DEFAULT_PROMPT, main
from jaxdd.testing.kimi_tokenizer import SPECIAL, write_kimi_tokenizer
from jaxdd.testing.reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model
from jaxdd.testing.server import START_SECONDS

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


@pytest.mark.slow
def test_ar_and_dflash_match_hf_greedy(checkpoints, capsys):
    model, target, drafter = checkpoints
    expected = hf_greedy(model, PROMPT, 12)
    common = [
        "--checkpoint",
        str(target),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "12",
    ]
    # token 0 never comes up here; keeps the default EOS from cutting the output
    common += ["--stop-ids", "0"]
    ar = run_json(capsys, *common)
    assert ar["method"] == "ar" and ar["output_ids"] == expected
    dflash = run_json(capsys, *common, "--drafter", str(drafter))
    assert dflash["method"] == "dflash" and dflash["output_ids"] == expected
    # the first token comes from the prefill
    assert sum(dflash["acceptance_lengths"]) == len(expected) - 1
    assert (
        dflash["decode_seconds"] > 0
        and dflash["target_forwards"] == len(dflash["acceptance_lengths"]) + 1
    )
    tree = run_json(
        capsys, *common, "--drafter", str(drafter), "--method", "ddtree", "--budget", "16"
    )
    assert tree["method"] == "ddtree" and tree["output_ids"] == expected
    block = dflash["options"]["block"]  # the drafter's block size, filled in by the decoder
    assert ar["options"] == {} and block > 1 and tree["options"] == {"block": block, "budget": 16}
    assert tree["rounds_by_spec"] == {"ddtree-16": len(tree["acceptance_lengths"])}


@pytest.mark.slow
def test_budget_auto_decodes_plain_greedy_tokens_and_counts_its_rounds(checkpoints, capsys):
    model, target, drafter = checkpoints
    expected = hf_greedy(model, PROMPT, 24)
    common = ["--checkpoint", str(target), "--drafter", str(drafter), "--stop-ids", "0"]
    common += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "24"]
    for method, names in (
        ("ddtree", {"ddtree-3", "ddtree-1", "ar"}),
        ("dflash", {"dflash-4", "ar"}),
    ):
        auto = run_json(capsys, *common, "--method", method, "--budget", "auto")
        assert auto["output_ids"] == expected, method
        rounds = auto["rounds_by_spec"]
        assert set(rounds) == names and sum(rounds.values()) == len(auto["acceptance_lengths"])
        assert all(count >= 1 for count in rounds.values())  # each measured before choosing


def test_text_prompt_from_argument_file_and_stdin_streams(
    checkpoints, tmp_path, capsys, monkeypatch
):
    model, target, _ = checkpoints
    tokenized = tmp_path / "with_tokenizer"
    shutil.copytree(target, tokenized)
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    tokenizer.save(str(tokenized / "tokenizer.json"))
    text = "def add(a, b):"
    common = ["--checkpoint", str(tokenized), "--max-new-tokens", "4", "--stop-ids", "0"]
    out = run_json(capsys, *common, text)
    assert out["prompt_ids"] == tokenizer.encode(text).ids
    assert out["output_ids"] == hf_greedy(model, out["prompt_ids"], 4)
    assert out["text"] == tokenizer.decode(out["output_ids"])
    (tmp_path / "prompt.txt").write_text(text)
    assert (
        run_json(capsys, *common, "--prompt-file", str(tmp_path / "prompt.txt"))["output_ids"]
        == out["output_ids"]
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert run_json(capsys, *common, "--prompt-file", "-")["output_ids"] == out["output_ids"]
    # Without --json: the prompt, then the text of the
    # accepted tokens on stdout; the summary on stderr.
    assert main([*common, "--dtype", "float32", text]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == text + out["text"] + "\n"
    assert re.search(
        r"\[ar\] 4 tokens, [0-9.]+ tokens/s, mean acceptance 1.00, 4 target forwards", streamed.err
    )


@pytest.mark.slow
def test_kimi_tiktoken_checkpoint_uses_its_chat_template(tmp_path, capsys):
    """A Kimi-layout checkpoint (tiktoken.model + tokenizer_config.json,
    special ids after the 256 byte ranks): the prompt becomes a user
    turn, and <|im_end|> stops generation besides the config's EOS."""
    model = hf_model(dict(TINY_K2, vocab_size=512), seed=3)
    model.save_pretrained(tmp_path)
    write_kimi_tokenizer(tmp_path, {bytes([b]): b for b in range(256)})
    out = run_json(capsys, "--checkpoint", str(tmp_path), "2+3=", "--max-new-tokens", "6")
    im = {t: 256 + i for i, t in enumerate(SPECIAL)}
    user = [im["<|im_user|>"], *b"user", im["<|im_middle|>"], *b"2+3=", im["<|im_end|>"]]
    assert out["prompt_ids"] == [*user, im["<|im_assistant|>"], *b"assistant", im["<|im_middle|>"]]
    expected = hf_greedy(model, out["prompt_ids"], 6)
    stops = {TINY_K2["eos_token_id"], im["[EOS]"], im["<|im_end|>"]}
    cut = next((i + 1 for i, t in enumerate(expected) if t in stops), len(expected))
    assert out["output_ids"] == expected[:cut]
    raw = run_json(
        capsys, "--checkpoint", str(tmp_path), "2+3=", "--max-new-tokens", "1", "--no-chat"
    )
    assert raw["prompt_ids"] == list(b"2+3=")


@pytest.mark.slow
def test_bundled_demo_runs_with_no_arguments(capsys):
    """The bundled kimi-mini pair and the default prompt;
    its trained drafter gets several tokens per round."""
    assert main([]) == 0
    streamed = capsys.readouterr()
    assert streamed.out.startswith(DEFAULT_PROMPT) and len(streamed.out) > len(DEFAULT_PROMPT) + 20
    summary = re.search(
        r"\[dflash block 8\] (\d+) tokens, .* mean acceptance ([0-9.]+), (\d+) target forwards",
        streamed.err,
    )
    assert summary, streamed.err
    tokens, acceptance, forwards = int(summary[1]), float(summary[2]), int(summary[3])
    assert tokens == 64 and acceptance > 1.5 and forwards < tokens / 1.5


def test_bad_arguments(checkpoints, tmp_path, capsys):
    _, target, drafter = checkpoints
    assert main(["--checkpoint", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(target), "--prompt-ids", "1,999"]) == 2
    assert "id 999 at (0, 1) outside the vocabulary" in capsys.readouterr().err
    assert main(["--checkpoint", str(target), "hello"]) == 2
    assert (
        "no tokenizer (tokenizer.json or tiktoken.model); pass --prompt-ids"
        in capsys.readouterr().err
    )
    assert main(["--checkpoint", str(target), "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    assert (
        main(
            ["--checkpoint", str(target), "--drafter", str(tmp_path / "none"), "--prompt-ids", "1"]
        )
        == 2
    )
    assert "not a directory" in capsys.readouterr().err
    # the directory, not a missing tokenizer
    assert main(["--checkpoint", str(tmp_path / "none"), "hello"]) == 2
    assert "none: not a directory" in capsys.readouterr().err
    for argv, message in [
        (["--prompt-ids", "a,b"], "expected comma-separated integers"),
        ([], "give a prompt: TEXT, --prompt-file FILE (- for stdin) or --prompt-ids"),
        (["text", "--prompt-ids", "1"], "not allowed with argument"),
        (["--prompt-ids", "1", "--method", "dflash"], "--method dflash needs --drafter"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt-ids", "1", "--budget", "fast"], "--budget: expected an integer, got 'fast'"),
        (["--prompt-ids", "1", "--method", "tree"], "invalid choice: 'tree'"),
        (["--prompt-ids", "1", "--method", "ddtree"], "--method ddtree needs --drafter"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["--checkpoint", str(target), *argv])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and message in err, (argv, err)
    assert drafter.exists()


def test_sampling_options(checkpoints, capsys):
    _, target, drafter = checkpoints
    common = [
        "--checkpoint",
        str(target),
        "--drafter",
        str(drafter),
        "--prompt-ids",
        "7,100,42",
        "--stop-ids",
        "0",
    ]
    common += ["--max-new-tokens", "8", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9"]
    first = run_json(capsys, *common, "--seed", "4")
    again = run_json(capsys, *common, "--seed", "4")
    other = run_json(capsys, *common, "--seed", "5")
    assert first["output_ids"] == again["output_ids"] != other["output_ids"]
    assert len(first["output_ids"]) == 8
    assert main([*common, "--top-p", "1.5"]) == 2
    assert "top_p: must be in (0, 1]" in capsys.readouterr().err


def corrupt_copy(source, destination, name: str, content: bytes):
    """A copy of checkpoint ``source`` whose file ``name`` holds ``content`` instead."""
    shutil.copytree(source, destination)
    (destination / name).write_bytes(content)
    return destination


def test_faults_are_one_line_errors(checkpoints, tmp_path, capsys, monkeypatch):
    """Broken files and inputs that the checkpoint cannot take end in one
    `jaxdd: ...` line naming the file or field, exit code 2, no traceback (each
    fault is made here: bad JSON, a corrupt tokenizer, binary prompts)."""
    _, target, drafter = checkpoints
    bad_json = b'{"model_type": "deepseek_v3",'
    binary = bytes(range(128, 256))
    (tmp_path / "binary.txt").write_bytes(binary)
    cases = [
        (
            [
                "--checkpoint",
                str(corrupt_copy(target, tmp_path / "t1", "config.json", bad_json)),
                "--prompt-ids",
                "1",
            ],
            "t1/config.json: not valid JSON",
        ),
        (
            [
                "--checkpoint",
                str(target),
                "--drafter",
                str(corrupt_copy(drafter, tmp_path / "d1", "config.json", bad_json)),
                "--prompt-ids",
                "1",
            ],
            "d1/config.json: not valid JSON",
        ),
        (
            [
                "--checkpoint",
                str(corrupt_copy(target, tmp_path / "t2", "tokenizer.json", b"{not json")),
                "hello",
            ],
            "t2/tokenizer.json: not a tokenizers file",
        ),
        (
            ["--checkpoint", str(target), "--prompt-ids", "1", "--stop-ids", "0,4096"],
            "stop_token_ids: 4096 outside the vocabulary [0, 256)",
        ),
        (
            ["--checkpoint", str(target), "--prompt-ids", "1", "--budget", "8"],
            "--budget does not apply to --method ar",
        ),
        (
            [
                "--checkpoint",
                str(target),
                "--prompt-ids",
                "1",
                "--drafter",
                str(drafter),
                "--budget",
                "8",
            ],
            "--budget does not apply to --method dflash",
        ),
        (
            ["--checkpoint", str(target), "--prompt-ids", "1", "--block-size", "4"],
            "--block-size does not apply to --method ar",
        ),
        (
            ["--checkpoint", str(target), "--prompt-ids", "1", "--budget", "auto"],
            "--budget does not apply to --method ar",
        ),
    ]
    tokenized = corrupt_copy(target, tmp_path / "t3", "tokenizer.json", b"")
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(tokenized / "tokenizer.json")
    )
    cases.append(
        (
            ["--checkpoint", str(tokenized), "--prompt-file", str(tmp_path / "binary.txt")],
            "binary.txt: not UTF-8 text",
        )
    )
    for argv, message in cases:
        assert main([*argv, "--dtype", "float32"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("jaxdd: ") and err.count("\n") == 1 and message in err, (argv, err)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(binary), encoding="utf-8"))
    assert main(["--checkpoint", str(tokenized), "--prompt-file", "-"]) == 2
    assert capsys.readouterr().err == "jaxdd: --prompt-file -: standard input is not UTF-8 text\n"


def test_help_reads_as_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "``" not in help_text and "generate at most this many tokens" in help_text
    assert "prefill_seconds and decode_seconds include" in help_text


def test_the_wrong_drafter_is_refused_by_name(checkpoints, tmp_path, capsys):
    """A target directory given as the drafter, and a drafter for another vocabulary: errors
    naming the file or the mismatch, not a missing field or silently wrong drafts."""
    _, target, drafter = checkpoints
    assert (
        main(
            [
                "--checkpoint",
                str(target),
                "--drafter",
                str(target),
                "--prompt-ids",
                "1",
                "--dtype",
                "float32",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdd: {target / 'config.json'}: ") and "missing" in err
    other = tmp_path / "other_vocab"
    shutil.copytree(drafter, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 512}))
    assert (
        main(
            [
                "--checkpoint",
                str(target),
                "--drafter",
                str(other),
                "--prompt-ids",
                "1",
                "--dtype",
                "float32",
            ]
        )
        == 2
    )
    assert "drafter vocab_size 512 != target vocab_size 256" in capsys.readouterr().err


@pytest.mark.slow
def test_rounds_past_memory_are_refused_and_oversized_ones_noted(checkpoints, capsys):
    """A DDTree budget whose round needs more working memory than the device
    has (the compiler's own figure) is refused before the first round;
    rounds that verify far more than they can accept run, with a note."""
    _, target, drafter = checkpoints
    common = [
        "--checkpoint",
        str(target),
        "--drafter",
        str(drafter),
        "--prompt-ids",
        "7,100,42",
        "--dtype",
        "float32",
    ]
    assert main([*common, "--method", "ddtree", "--budget", "400000", "--max-new-tokens", "4"]) == 2
    # after the "compiling ..." status line: the compile tells the size
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.fullmatch(
        r"jaxdd: the ddtree round verifies 400001 tokens per request \(budget 400000\) and "
        r"needs [\d.]+ GB of "
        r"working memory per device, [\d.]+ GB is free; lower budget",
        err.splitlines()[-1],
    ), err
    for flags, note in [
        (
            ["--method", "ddtree", "--budget", "64"],
            "(budget 64) to accept at most 4: over 16 nodes per drafted",
        ),
        (["--block-size", "12"], "(block_size 12) past the drafter's trained block of 4"),
    ]:
        assert main([*common, *flags, "--max-new-tokens", "8", "--stop-ids", "0", "--json"]) == 0
        out, err = capsys.readouterr()
        assert len(json.loads(out)["output_ids"]) == 8
        notes = [line for line in err.splitlines() if line.startswith("jaxdd: note: ")]
        assert (
            len(notes) == 1 and note in notes[0] and "B of working memory per device" in notes[0]
        ), notes
    assert (
        main([*common, "--method", "ddtree", "--budget", "8", "--max-new-tokens", "4", "--json"])
        == 0
    )
    assert "note" not in capsys.readouterr().err


@pytest.mark.slow
def test_devices_and_moe_flags_shard_the_pair(checkpoints, capsys):
    """`--devices 8 --moe ep|tp` (the suite's 8 simulated CPU devices) gives one device's tokens
    (DFlash in EP, DDTree in TP, DDTree with the latent cache striped); more devices than the
    host has, or --moe or --cache-layout on one device, is one line and exit code 2."""
    _, target, drafter = checkpoints
    common = [
        "--checkpoint",
        str(target),
        "--drafter",
        str(drafter),
        "--prompt-ids",
        "7,100,42",
        "--stop-ids",
        "0",
    ]
    common += ["--max-new-tokens", "12"]
    ddtree = ["--method", "ddtree", "--budget", "6"]
    for method, placement in (
        (["--method", "dflash"], ["--moe", "ep"]),
        (ddtree, ["--moe", "tp"]),
        (ddtree, ["--cache-layout", "striped"]),
    ):
        alone = run_json(capsys, *common, *method)["output_ids"]
        sharded = run_json(capsys, *common, *method, "--devices", "8", *placement)
        assert sharded["output_ids"] == alone
    for flags, message in [
        (["--devices", "16"], "jaxdd: --devices 16: this host has 8\n"),
        (["--moe", "ep"], "jaxdd: --moe applies to several devices (--devices N)\n"),
        (
            ["--cache-layout", "striped"],
            "jaxdd: --cache-layout applies to several devices (--devices N)\n",
        ),
    ]:
        assert main([*common, *flags]) == 2
        assert capsys.readouterr().err == message


@pytest.mark.slow
def test_bundled_demo_on_eight_simulated_devices_from_a_fresh_process():
    """`python -m jaxdd.generate --devices 8 --moe ep` on a host with one CPU device: the flag
    itself makes the 8 simulated devices, and the bundled pair gives the single-device tokens."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    runs = {}
    for name, flags in {"one": [], "eight": ["--devices", "8", "--moe", "ep"]}.items():
        command = [
            sys.executable,
            "-m",
            "jaxdd.generate",
            "--max-new-tokens",
            "24",
            "--json",
            *flags,
        ]
        run = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=START_SECONDS
        )
        assert run.returncode == 0, run.stderr
        runs[name] = json.loads(run.stdout)["output_ids"]
    assert runs["eight"] == runs["one"] and len(runs["one"]) == 24
