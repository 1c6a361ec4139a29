"""``python -m jaxdd.crosscheck``: dump PyTorch traces,
compare jaxdd against them, and catch a broken jaxdd."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jaxdd.models.attention
from jaxdd.crosscheck.__main__ import main
from jaxdd.crosscheck.compare import compare
from jaxdd.crosscheck.trace import load_traces
from jaxdd.testing.reference import TINY_K2, drafter_config, save_random_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("crosscheck")
    save_random_pair(root, TINY_K2, drafter_config(block_size=4), seed=5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 250, n).tolist() for n in (7, 12)]
    (root / "prompts.json").write_text(json.dumps(prompts))
    return root


@pytest.fixture(scope="module")
def references(models):
    """One reference file per method, dumped through the CLI."""
    out = {}
    for method in ("ar", "dflash", "ddtree"):
        out[method] = models / f"{method}.npz"
        args = [
            "dump",
            "--target",
            str(models / "target"),
            "--prompts",
            str(models / "prompts.json"),
        ]
        args += [
            "--method",
            method,
            "--out",
            str(out[method]),
            "--max-new-tokens",
            "12",
            "--stop-ids",
            "-1",
        ]
        if method != "ar":
            args += ["--drafter", str(models / "drafter")]
        if method == "ddtree":
            args += ["--budget", "6"]
        assert main(args) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_dump_then_compare_passes(references, method, capsys):
    meta, traces = load_traces(references[method])
    assert meta["method"] == method and len(traces) == 2
    assert all(len(t.tokens) == 12 for t in traces)
    if method == "ddtree":
        assert traces[0].tree_tokens.shape[1] == 7 and (traces[0].tree_tokens[:, 0] >= 0).all()
    capsys.readouterr()
    assert main(["compare", str(references[method]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    for prompt in report["prompts"]:
        assert prompt["divergence"] is None and prompt["acceptance_equal"]
        assert prompt["logits_max_rel"] < 1e-5 and prompt["first_hidden_excess"] is None
        if method != "ar":
            assert prompt["draft_rounds"] == len(traces[prompt["prompt"]].acceptance)
            assert prompt["draft_top1_agree"] == prompt["draft_rounds"]
        if method == "ddtree":
            assert prompt["tree_rounds"] > 0 and prompt["first_tree_difference"] is None


@pytest.mark.slow
@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_compare_on_eight_devices(references, moe, capsys):
    """The DDTree reference compared with the pair sharded over the suite's 8 simulated
    devices passes as on one; asking for more devices than there are is one line, exit 2."""
    assert (
        main(["compare", str(references["ddtree"]), "--devices", "8", "--moe", moe, "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["compare", str(references["ddtree"]), "--devices", "16"]) == 2
    assert capsys.readouterr().err == "jaxdd: devices: expected 1..8, got 16\n"


@pytest.fixture
def fresh_compilations():
    """Jitted functions are cached by module structure; a
    patched module must be traced again (and not leak)."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.slow
def test_wrong_rope_layout_is_caught_and_localised(
    references, monkeypatch, fresh_compilations, capsys
):
    """Rotating the rope channels as halves instead of interleaved pairs:
    position 0 (angle 0) is unaffected, so the hidden states must point at
    position 1, layer 0; the logits fail from the first stored position."""
    apply_rope = jaxdd.models.attention.apply_rope
    monkeypatch.setattr(
        jaxdd.models.attention,
        "apply_rope",
        lambda x, cos, sin, interleaved: apply_rope(x, cos, sin, False),
    )
    report = compare(references["ddtree"])
    assert not report.ok
    _, traces = load_traces(references["ddtree"])
    for prompt, trace in zip(report.prompts, traces, strict=True):
        assert prompt.unexplained
        assert prompt.first_logit_excess["position"] == len(trace.prompt) - 1
        assert (
            prompt.first_hidden_excess["layer"] == 0 and prompt.first_hidden_excess["position"] == 1
        )
    assert main(["compare", str(references["ddtree"])]) == 1
    text = capsys.readouterr().out
    assert "target logits first exceed tolerance at position 6" in text
    assert "hidden states first exceed it after layer 0 at position 1" in text
    assert "result: FAIL" in text


def test_bad_reference_file(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, header=np.array(json.dumps({"format": "something else"})))
    assert main(["compare", str(bad)]) == 2
    assert "not a jaxdd cross-check reference" in capsys.readouterr().err


def test_text_prompts_use_the_target_tokenizer(tmp_path):
    from jaxdd.cli import DEMO
    from jaxdd.crosscheck.dump import read_prompts
    from jaxdd.weights.tokenizer import load_tokenizer

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):", [5, 6, 7]]))
    expected = load_tokenizer(DEMO / "target").encode("def f(x):")
    assert read_prompts(prompts, DEMO / "target") == [expected, [5, 6, 7]]
    with pytest.raises(jaxdd.InputError, match="prompt 0 is text but .* has no tokenizer"):
        read_prompts(prompts, tmp_path)


def test_unreadable_references_are_refused_by_name(references, tmp_path, capsys):
    """A truncated, empty, random or foreign file given to compare: exit
    code 2 (1 is for a divergence) and one line naming the file."""
    whole = references["ar"].read_bytes()
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.zeros(3))
    cases = {
        "truncated.npz": whole[: len(whole) // 2],
        "empty.npz": b"",
        "random.npz": bytes(range(256)) * 8,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    for path in [*(tmp_path / name for name in cases), foreign]:
        assert main(["compare", str(path)]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1
            and f"{path}: not a" in err
            and "jaxdd cross-check reference" in err
        ), err


def test_dump_refuses_a_prompt_outside_the_vocabulary(models, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3], [4, 256]]))  # TINY_K2 has 256 tokens
    args = ["dump", "--target", str(models / "target"), "--prompts", str(prompts), "--method", "ar"]
    assert main([*args, "--out", str(tmp_path / "r.npz")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "prompt 1: token_ids: id 256 at (0, 1) outside the vocabulary [0, 256)" in err
    )
    assert not (tmp_path / "r.npz").exists()


def edited_reference(source, destination, edit):
    """A copy of reference ``source`` with ``edit(header,
    arrays)`` applied (the fault is made here)."""
    with np.load(source) as data:
        arrays = {key: data[key] for key in data.files}
    header = json.loads(str(arrays["header"]))
    edit(header, arrays)
    arrays["header"] = np.array(json.dumps(header))
    np.savez_compressed(destination, **arrays)
    return destination


def test_a_tampered_reference_fails_and_says_what_differs(references, tmp_path, capsys):
    """Same tokens are not enough: a reference whose method was switched
    (greedy DDTree and DFlash emit the same tokens), whose acceptance array
    was cut, or whose hidden states were scaled must fail with exit code 1."""
    ddtree, ar = references["ddtree"], references["ar"]

    def as_dflash(header, arrays):
        header["method"] = "dflash"

    def cut_acceptance(header, arrays):
        arrays["0/acceptance"] = arrays["0/acceptance"][:-1]

    def scale_hidden(header, arrays):
        arrays["1/hidden"] = arrays["1/hidden"] * 1.5

    cases = [(ddtree, as_dflash, "reference: method 'dflash', but it holds DDTree trees")]
    cases.append((ddtree, cut_acceptance, "acceptance first differs in round"))
    cases.append((ar, scale_hidden, "hidden states first exceed it after layer 0"))
    for i, (source, edit, message) in enumerate(cases):
        path = edited_reference(source, tmp_path / f"edited{i}.npz", edit)
        assert main(["compare", str(path)]) == 1, edit.__name__
        text = capsys.readouterr().out
        assert message in text and "result: FAIL" in text, (edit.__name__, text)


def test_a_reference_from_another_machine_runs_on_local_models(
    references, models, tmp_path, capsys
):
    """The reference names the directories it was dumped
    from; --target / --drafter point at local copies."""
    moved = edited_reference(
        references["dflash"],
        tmp_path / "moved.npz",
        lambda header, arrays: header.update(
            target="/elsewhere/target", drafter="/elsewhere/drafter"
        ),
    )
    assert main(["compare", str(moved)]) == 2
    assert "/elsewhere/target" in capsys.readouterr().err
    local = ["--target", str(models / "target"), "--drafter", str(models / "drafter")]
    assert main(["compare", str(moved), *local]) == 0
