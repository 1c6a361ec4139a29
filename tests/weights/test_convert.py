"""Conversion HF -> jaxdd -> HF on synthetic mini checkpoints
in the real layouts (jaxdd/testing/hf_layouts.py)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3ForCausalLM

import jaxdd
from convert.__main__ import main as convert_main
from convert.hf_to_jaxdd import convert
from convert.jaxdd_to_hf import export
from jaxdd.models.quant import Fp8Experts, Int4Experts
from jaxdd.testing.hf_layouts import (
    CONVERT_TINY,
    write_k2_instruct_fp8,
    write_k25_int4,
    write_reference,
)
from jaxdd.testing.kimi_tokenizer import write_kimi_tokenizer
from jaxdd.testing.reference import drafter_config, hf_drafter, hf_model, rel_err
from jaxdd.testing.synthetic_checkpoint import measure_conversion, write_synthetic_target
from jaxdd.weights.tokenizer import load_tokenizer

IDS = np.array([[5, 17, 3, 250, 9, 1, 77, 200]])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{layout: (HF dir, reference HF model holding the
    dequantized weights)} for plain, fp8 and int4."""
    root = tmp_path_factory.mktemp("layouts")
    plain = root / "plain"
    # several shards + index
    hf_model(CONVERT_TINY, seed=3).save_pretrained(plain, max_shard_size="300KB")
    assert len(list(plain.glob("*.safetensors"))) > 1
    out = {"plain": (plain, DeepseekV3ForCausalLM.from_pretrained(plain).eval())}
    for name, write in (("fp8", write_k2_instruct_fp8), ("int4", write_k25_int4)):
        reference = write_reference(plain, write(plain, root / name), root / f"{name}_reference")
        out[name] = (root / name, DeepseekV3ForCausalLM.from_pretrained(reference).eval())
    return out


def hf_logits(model: DeepseekV3ForCausalLM) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.numpy()


def nothing_written(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not [
        p for p in parent.iterdir() if p.name.startswith(f".{name}.")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["plain", "fp8", "int4"])
def test_converted_logits_equal_hf(layouts, layout, tmp_path):
    source, reference = layouts[layout]
    summary = convert(source, tmp_path / "ckpt", dtype="float32", progress=False)
    assert summary.experts == {"plain": "dense", "fp8": "fp8", "int4": "int4"}[layout]
    target = jaxdd.load_target(tmp_path / "ckpt", dtype="float32")
    # The routers' gates as stored (bf16 in the real layouts);
    # HF computes with the same values upcast to fp32.
    router = target.model.layers[1].mlp.router.weight.dtype
    assert router == (jnp.float32 if layout == "plain" else jnp.bfloat16)
    assert rel_err(target.logits(IDS), hf_logits(reference)) < 1e-5
    # On the device, not numpy (which every jitted call would
    # copy there again: 0.9 GB per step for a 1 GB model).
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(target.model)))


@pytest.mark.parametrize("layout", ["fp8", "int4"])
def test_experts_stay_quantized_and_dequantize_exactly(layouts, layout, tmp_path):
    """Stored pieces are the source's bits; dequantized
    inside the model they equal the reference exactly."""
    source, reference = layouts[layout]
    convert(source, tmp_path / "ckpt", dtype="float32", progress=False)
    moe = jaxdd.load_target(tmp_path / "ckpt", dtype="float32").model.layers[1].mlp
    assert isinstance(moe.gate, Int4Experts if layout == "int4" else Fp8Experts)
    stored = {
        p: np.asarray(getattr(moe.gate, p)[...])
        for p in ("packed", "scale", "weight", "scale_inv")
        if hasattr(moe.gate, p)
    }
    assert {a.dtype.name for a in stored.values()} == (
        {"int32", "bfloat16"} if layout == "int4" else {"float8_e4m3fn", "float32"}
    )
    hf_experts = reference.model.layers[1].mlp.experts
    for proj, ours in (("gate", moe.gate), ("up", moe.up), ("down", moe.down)):
        if proj == "down":
            expected = hf_experts.down_proj.detach().numpy()  # [E, out, in]
        else:
            gate_up = hf_experts.gate_up_proj.detach().numpy()
            half = gate_up.shape[1] // 2
            expected = gate_up[:, :half] if proj == "gate" else gate_up[:, half:]
        np.testing.assert_array_equal(np.asarray(ours()), expected.swapaxes(-1, -2))


def test_dequantize_experts_option(layouts, tmp_path):
    source, _ = layouts["int4"]
    convert(source, tmp_path / "kept", dtype="float32", progress=False)
    convert(source, tmp_path / "dense", dtype="float32", dequantize_experts=True, progress=False)
    kept = jaxdd.load_target(tmp_path / "kept", dtype="float32")
    dense = jaxdd.load_target(tmp_path / "dense", dtype="float32")
    assert dense.model.layers[1].mlp.gate.weight.dtype == jnp.float32
    np.testing.assert_array_equal(dense.model.layers[1].mlp.gate(), kept.model.layers[1].mlp.gate())
    # same weights; XLA may fuse the dequant differently
    assert rel_err(dense.logits(IDS), kept.logits(IDS)) < 1e-6


@pytest.mark.parametrize("layout", ["plain", "int4"])
def test_export_round_trip(layouts, layout, tmp_path):
    """jaxdd -> HF loads in transformers with the same
    logits; HF -> jaxdd again gives identical arrays."""
    source, _ = layouts[layout]
    convert(source, tmp_path / "ckpt", dtype="float32", progress=False)
    export(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    ours = jaxdd.load_target(tmp_path / "ckpt", dtype="float32")
    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert rel_err(hf_logits(exported), ours.logits(IDS)) < 1e-5
    convert(tmp_path / "hf", tmp_path / "again", dtype="float32", progress=False)
    again = jaxdd.load_target(tmp_path / "again", dtype="float32").model
    dense = (
        ours.model
        if layout == "plain"
        else jaxdd.load_target(tmp_path / "hf", dtype="float32").model
    )
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(again)), nnx.to_flat_state(nnx.state(dense)), strict=True
    ):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
    if layout == "plain":  # bit-exact back to the original HF tensors too
        original = {}
        for file in source.glob("*.safetensors"):
            original |= load_file(file)
        exported_tensors = {}
        for file in (tmp_path / "hf").glob("*.safetensors"):
            exported_tensors |= load_file(file)
        assert exported_tensors.keys() == original.keys()
        for name, tensor in original.items():
            np.testing.assert_array_equal(exported_tensors[name], tensor, err_msg=name)


def test_drafter_convert_and_export(tmp_path):
    reference = hf_drafter(drafter_config(yarn=True), seed=4)
    reference.save_pretrained(tmp_path / "zlab")
    assert (
        convert_main(
            [
                "hf-to-jaxdd",
                str(tmp_path / "zlab"),
                str(tmp_path / "ckpt"),
                "--dtype",
                "float32",
                "--quiet",
            ]
        )
        == 0
    )
    converted = jaxdd.load_drafter(tmp_path / "ckpt", dtype="float32")
    direct = jaxdd.load_drafter(tmp_path / "zlab", dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(converted), nnx.state(direct))
    assert (
        convert_main(["jaxdd-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--quiet"])
        == 0
    )
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "back").float()
    expected = reference.state_dict()
    for name, tensor in loaded.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name].numpy(), err_msg=name)


def test_interrupted_conversion_leaves_nothing_and_rerun_works(layouts, tmp_path, monkeypatch):
    source, _ = layouts["fp8"]
    calls = {"n": 0}
    real_read = jaxdd.weights.hf_reader.HFCheckpoint.read

    def read_then_interrupt(self, mapping):
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        return real_read(self, mapping)

    monkeypatch.setattr(jaxdd.weights.hf_reader.HFCheckpoint, "read", read_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(source, tmp_path / "ckpt", progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    convert(source, tmp_path / "ckpt", progress=False)
    assert jaxdd.load_target(tmp_path / "ckpt").config.hidden_size == CONVERT_TINY["hidden_size"]


@pytest.mark.slow
def test_ctrl_c_during_a_real_conversion_leaves_nothing(tmp_path):
    """SIGINT to a converting process once it has begun writing: it stops after
    the group in hand (orbax's background writes finished, so none lands in the
    removed staging directory), says so in one line, exits 130 and leaves nothing.
    Without holding the interrupt, 4 of 11 such runs left a staging directory."""
    source, _ = write_synthetic_target(tmp_path / "hf", layers=16, experts=16, width=512)
    runs = tmp_path / "runs"
    out = runs / "out"
    command = [sys.executable, "-m", "convert", "hf-to-jaxdd", str(source), str(out), "--quiet"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(runs.glob(".out.*/state/layers.1*")) and process.poll() is None:
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        err = process.communicate(timeout=120)[1]
    finally:
        process.kill()
    assert process.returncode == 130 and err == f"jaxdd: interrupted; {out} was not written\n", err
    assert list(runs.iterdir()) == []


def _copy(source: Path, directory: Path) -> Path:
    directory.mkdir()
    for file in source.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


def _edit_shard(directory: Path, edit) -> None:
    """Apply ``edit`` to the tensors of the shard that holds layer 1's experts."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = (
        directory
        / index["weight_map"]["language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed"]
    )
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    index["weight_map"] = {
        n: f for n, f in index["weight_map"].items() if n in tensors or f != file.name
    }
    index["weight_map"] |= dict.fromkeys(tensors, file.name)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


BAD_INPUTS = {
    "missing": (
        lambda t: t.pop("language_model.model.layers.1.mlp.experts.0.up_proj.weight_scale"),
        "missing tensor: model.layers.1.mlp.experts.0.up_proj.weight_scale",
    ),
    "unexpected": (
        lambda t: t.update(
            {"language_model.model.layers.1.mlp.extra.weight": np.zeros(2, np.float32)}
        ),
        "unexpected tensor: model.layers.1.mlp.extra.weight",
    ),
    "shape": (
        lambda t: t.update(
            {
                "language_model.model.layers.1.mlp.experts.0.up_proj.weight_scale": np.zeros(
                    (3, 3), np.float32
                )
            }
        ),
        r"model.layers.1.mlp.experts.0.up_proj.weight_scale: shape \[3, 3\], the config "
        r"needs \[32, 5\]",
    ),
    "dtype": (
        lambda t: t.update(
            {
                "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed": np.zeros(
                    (32, 20), np.int64
                )
            }
        ),
        "model.layers.1.mlp.experts.0.up_proj.weight_packed: dtype I64, expected I32",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_checkpoint_is_refused_before_writing(layouts, case, tmp_path):
    broken = _copy(layouts["int4"][0], tmp_path / "broken")
    edit, message = BAD_INPUTS[case]
    _edit_shard(broken, edit)
    with pytest.raises(jaxdd.CheckpointError, match=message):
        convert(broken, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, "out")


def test_corrupt_header_and_missing_shard(layouts, tmp_path, capsys):
    broken = _copy(layouts["fp8"][0], tmp_path / "broken")
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + shard.read_bytes()[24:])
    assert convert_main(["hf-to-jaxdd", str(broken), str(tmp_path / "out"), "--quiet"]) == 2
    assert f"{shard}: corrupt safetensors file" in capsys.readouterr().err
    assert nothing_written(tmp_path, "out")
    shard.unlink()
    with pytest.raises(jaxdd.CheckpointError, match=f"names missing shard\\(s\\): {shard.name}"):
        convert(broken, tmp_path / "out", progress=False)
    assert nothing_written(tmp_path, "out")


@pytest.mark.slow
def test_conversion_memory_stays_bounded(tmp_path):
    """Converting a checkpoint ~40x larger than one
    layer grows the process by a few layers at most."""
    source, layer_mb = write_synthetic_target(
        tmp_path / "big", layers=40, experts=32, width=256, dtype="float32"
    )
    size_mb = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2**20
    measured = measure_conversion(source, tmp_path / "out")
    growth = measured["peak_rss_mb"] - measured["rss_before_mb"]
    print(
        f"checkpoint {size_mb:.0f} MB, largest layer {layer_mb:.0f} MB, RSS growth {growth:.0f} MB"
    )
    assert growth < size_mb / 4
    # numpy holds ~2.4 layers at peak; the rest is allocator and tensorstore buffers
    assert growth < 8 * layer_mb + 32


def test_restore_lands_in_target_shardings(layouts, tmp_path):
    """Each array is restored straight into the sharding
    asked for (here: experts split over 8 devices)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxdd.weights.checkpoint import abstract_model, load_checkpoint

    convert(layouts["int4"][0], tmp_path / "ckpt", dtype="float32", progress=False)
    mesh = Mesh(np.array(jax.devices()[:8]), ("experts",))
    abstract = nnx.to_pure_dict(abstract_model(tmp_path / "ckpt", "target")[1])

    def sharding(leaf):
        split = leaf.ndim == 3 and leaf.shape[0] % 8 == 0  # stacked routed experts
        return NamedSharding(mesh, PartitionSpec("experts") if split else PartitionSpec())

    model = load_checkpoint(tmp_path / "ckpt", "target", shardings=jax.tree.map(sharding, abstract))
    packed = model.layers[1].mlp.gate.packed[...]
    assert packed.sharding.spec == PartitionSpec("experts") and len(packed.addressable_shards) == 8
    assert packed.addressable_shards[0].data.shape[0] == CONVERT_TINY["n_routed_experts"] // 8
    reference = jaxdd.load_target(tmp_path / "ckpt", dtype="float32")
    # sharded sums reassociate
    assert rel_err(jaxdd.Target(model).logits(IDS), reference.logits(IDS)) < 1e-6


def test_export_refuses_a_directory_that_is_not_a_jaxdd_checkpoint(layouts, tmp_path, capsys):
    """jaxdd-to-hf on an HF directory (here one of the real layouts):
    one line naming the directory, exit code 2, nothing written."""
    source = layouts["int4"][0]
    assert convert_main(["jaxdd-to-hf", str(source), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{source}: not a jaxdd checkpoint (no jaxdd.json)" in err
    assert nothing_written(tmp_path, "out")


def test_a_killed_run_leaves_nothing_and_a_live_one_is_not_overrun(layouts, tmp_path, capsys):
    """A process writing OUT is killed with SIGKILL (no cleanup can run):
    while it lives, a second conversion into OUT is refused by name; after,
    a rerun removes the dead run's staging directory and leaves only OUT."""
    source, out = layouts["int4"][0], tmp_path / "runs" / "out"
    writer = (
        "import sys, time\nfrom jaxdd.weights.atomic import atomic_directory\n"
        "with atomic_directory(sys.argv[1]) as staging:\n"
        "    (staging / 'partial').write_bytes(bytes(1000))\n    print('staging', "
        "flush=True)\n    time.sleep(120)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", writer, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "staging"
        assert convert_main(["hf-to-jaxdd", str(source), str(out), "--quiet"]) == 2
        assert f"{out} is being written by another run" in capsys.readouterr().err
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    # the killed run's staging directory is still there
    assert [p.name for p in out.parent.iterdir()] != ["out"]
    assert convert_main(["hf-to-jaxdd", str(source), str(out), "--quiet"]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert jaxdd.load_target(out, dtype="float32").config.num_hidden_layers > 0


def test_tokenizer_and_chat_template_survive_both_conversions(layouts, tmp_path):
    """Kimi's tokenizer files (tiktoken.model + tokenizer_config.json
    with its chat template) go along HF -> jaxdd -> HF: text prompts,
    the chat turn and the <|im_end|> stop work on every copy."""
    source = tmp_path / "with_tokenizer"
    shutil.copytree(layouts["int4"][0], source)
    write_kimi_tokenizer(source, {bytes([i]): i for i in range(256)})
    convert(source, tmp_path / "jaxdd", progress=False)
    export(tmp_path / "jaxdd", tmp_path / "back", progress=False)
    original = load_tokenizer(source)
    for copy in (tmp_path / "jaxdd", tmp_path / "back"):
        tokenizer = load_tokenizer(copy)
        assert tokenizer.chat_prompt("hello") == original.chat_prompt("hello")
        assert tokenizer.stop_ids == original.stop_ids and len(original.stop_ids) == 2


def test_damaged_checkpoints_are_named(layouts, tmp_path, capsys):
    """Faults made to a converted checkpoint: 64 flipped bytes (found by `convert
    verify` and by loading with verify, named by file), a truncated data file and
    a deleted group (found by the size check of every load), a broken jaxdd.json;
    each one line, exit code 2. The undamaged checkpoint verifies."""
    from jaxdd.generate import main as generate_main

    good = tmp_path / "good"
    convert(layouts["int4"][0], good, progress=False)
    assert convert_main(["verify", str(good), "--quiet"]) == 0
    assert "sizes and sha256 checksums match" in capsys.readouterr().out
    files = json.loads((good / "jaxdd.json").read_text())["files"]
    assert "config.json" in files and all(size > 0 for size, _ in files.values())
    data = max(files, key=lambda name: files[name][0])  # a layer's packed experts
    assert data.startswith("state/layers.")

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy)
        return copy

    def flip(copy: Path) -> None:
        content = bytearray((copy / data).read_bytes())
        content[100:164] = bytes(b ^ 0xFF for b in content[100:164])
        (copy / data).write_bytes(bytes(content))

    flipped = damaged("flipped", flip)
    truncated = damaged(
        "truncated", lambda c: (c / data).write_bytes((good / data).read_bytes()[:-1])
    )
    no_group = damaged("no_group", lambda c: shutil.rmtree(c / "state" / "layers.1"))
    broken_marker = damaged(
        "broken_marker", lambda c: (c / "jaxdd.json").write_text('{"format": 2')
    )
    size = (good / data).stat().st_size
    verify_cases = [
        (flipped, f"{flipped / data}: sha256 differs from the one recorded at conversion"),
        (truncated, f"{truncated / data}: {size - 1} bytes, {size} recorded at conversion"),
        (no_group, f"{no_group}/state/layers.1/"),
        (broken_marker, f"{broken_marker / 'jaxdd.json'}: not valid JSON"),
    ]
    for directory, message in verify_cases:
        assert convert_main(["verify", str(directory), "--quiet"]) == 2, directory
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    generate = ["--prompt-ids", "5,17,3", "--max-new-tokens", "2", "--dtype", "float32", "--json"]
    # Sizes agree, so without the digests the flip goes unseen (garbage out) or
    # surfaces where the data is compressed (zstd finds the corruption): then
    # our line comes first (tensorstore's late callbacks may add noise after
    # it), so --verify-checksums, which checks before reading, is the clean way.
    code = generate_main(["--checkpoint", str(flipped), *generate])
    err = capsys.readouterr().err
    assert code == 0 or (
        code == 2 and err.startswith("jaxdd: ") and "unreadable" in err.splitlines()[0]
    ), err
    for directory, message in [(flipped, "sha256 differs"), *verify_cases[1:]]:
        extra = ["--verify-checksums"] if directory == flipped else []
        assert generate_main(["--checkpoint", str(directory), *generate, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert convert_main(["jaxdd-to-hf", str(truncated), str(tmp_path / "out"), "--quiet"]) == 2
    assert "recorded at conversion" in capsys.readouterr().err and nothing_written(tmp_path, "out")


def in_small_disk(
    disk: Path, mount_options: str, command: list[str]
) -> subprocess.CompletedProcess:
    """Run ``command`` with a tmpfs of ``mount_options`` at ``disk`` (a user + mount
    namespace: no root needed, gone when the command ends), then list what is left on it."""
    script = (
        f'mount -t tmpfs -o {mount_options} none "$1" && shift && "$@"; code=$?; ls -A '
        f'"{disk}"; exit $code'
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(disk), *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


def unshare_works() -> bool:
    try:
        return (
            subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not unshare_works(), reason="needs unshare -rm (user namespaces) to mount a small tmpfs"
)
def test_a_small_or_read_only_disk_is_refused_before_writing(layouts, tmp_path):
    """Conversion onto a real 64 KB disk is refused from the sizes before anything is written;
    onto a read-only disk the write fails as one line. Both exit 2 and leave the disk empty."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [
        sys.executable,
        "-m",
        "convert",
        "hf-to-jaxdd",
        str(layouts["int4"][0]),
        str(disk / "out"),
        "--quiet",
    ]
    for options, message in [
        ("size=64k", r"needs up to [\d.]+ MB, 0.1 MB free on "),
        ("ro", "Read-only file system"),
    ]:
        run = in_small_disk(disk, options, command)
        assert run.returncode == 2 and run.stdout == "", (options, run.stdout, run.stderr)
        assert run.stderr.count("\n") == 1 and re.search(message, run.stderr), run.stderr


def test_a_write_that_fails_midway_leaves_nothing(layouts, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) makes a write fail while the first
    group is written: one line naming the output and the OS's reason, exit
    2, no staging directory left (orbax's logged traceback is not shown)."""
    limited = (
        "import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
        "from convert.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "runs" / "out"
    argv = ["hf-to-jaxdd", str(layouts["int4"][0]), str(out), "--quiet"]
    run = subprocess.run(
        [sys.executable, "-c", limited, *argv], capture_output=True, text=True, timeout=120
    )
    assert (
        run.returncode == 2
        and run.stderr == f"jaxdd: {out}: cannot write (File too large); nothing was kept\n"
    )
    assert list(out.parent.iterdir()) == []
