"""Faults from around the command lines (jaxdd.cli): the platform and device count a
user sets, closed and broken standard streams, Ctrl-C, a job whose other process
never comes, NaN weights and unreadable files. Each is made for real in a subprocess
where it can be, and answers with one ``jaxdd: ...`` line and its exit code."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxdd
from jaxdd import cli
from jaxdd.cli import DEMO
from jaxdd.crosscheck.compare import PromptReport, Report, first_hidden_excess
from jaxdd.planning.fit import PlanOptions
from jaxdd.runtime.backend_start import device_present, simulated_device_limit
from jaxdd.testing.server import START_SECONDS, free_port, started_server
from jaxdd.weights.hf_reader import HFCheckpoint

GENERATE = [sys.executable, "-m", "jaxdd.generate"]
PLAN = [sys.executable, "-m", "jaxdd.plan", "--config", "tests/fixtures/kimi_k25_config.json"]
PLAN += [
    "--drafter-config",
    "tests/fixtures/kimi_k26_dflash_config.json",
    "--layers",
    "2",
    "--traffic",
]
QUICK = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
SERVE = [sys.executable, "-m", "jaxdd.serve", "--host", "127.0.0.1"]


def environment(changes: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with ``changes`` (a None value: unset)."""
    out = {k: v for k, v in os.environ.items() if k not in changes}
    return out | {k: v for k, v in changes.items() if v is not None}


def run(argv: list[str], env: dict[str, str | None] | None = None, shell_redirect: str = ""):
    """``argv`` in a fresh process with ``env``'s changes, its streams captured;
    ``shell_redirect``: what sh does to its streams first (``<&-``: stdin closed)."""
    if shell_redirect:
        argv = ["sh", "-c", f'exec "$@" {shell_redirect}', "sh", *argv]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=environment(env or {})
    )


def one_line(process, code: int = 2) -> str:
    assert process.returncode == code, (process.returncode, process.stderr)
    assert process.stderr.count("\n") == 1 and process.stderr.startswith("jaxdd: "), process.stderr
    return process.stderr


@pytest.mark.slow
def test_closed_stdin_and_stdout(tmp_path):
    closed_in = run([*GENERATE, "--prompt-file", "-"], {"JAXDD_COMPILATION_CACHE": "off"}, "<&-")
    assert one_line(closed_in) == "jaxdd: --prompt-file -: standard input is closed\n"
    closed_out = run([*GENERATE, *QUICK], shell_redirect=">&-")
    assert "standard output is closed" in one_line(closed_out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("platforms", "said"),
    [
        ("cuda", "this host has no GPU"),
        ("tpu", "this host has no TPU"),
        ("metal", "'metal' is not a platform"),
    ],
)
def test_platform_asked_for_where_there_is_none(platforms, said):
    if platforms != "metal" and device_present(cli.PLATFORMS[platforms]):
        pytest.skip(f"this host has a {platforms} device")
    assert said in one_line(run([*GENERATE, *QUICK], {"JAX_PLATFORMS": platforms}))


def test_accelerator_runtime_missing():
    """Simulated: a GPU device file 'present' (the root directory stands in for /dev/nvidiactl) on
    a host whose CUDA libraries are not there; the CUDA plugin's failure is said in one line."""
    code = (
        "import jaxdd.runtime.backend_start as b; b.DEVICE_FILES['gpu'] = ('/',); "
        "from jaxdd import cli; from jaxdd.generate import main; cli.run(main)"
    )
    process = run([sys.executable, "-c", code, *QUICK], {"JAX_PLATFORMS": "cuda"})
    if process.returncode == 0:
        pytest.skip("this host runs CUDA")
    assert "JAX_PLATFORMS=cuda: no backend started" in one_line(process)


def test_plan_ignores_platform_and_needs_no_jax_platforms():
    """The README's plan for a GPU works without
    JAX_PLATFORMS=cpu set first, and with a GPU asked for."""
    for platforms in (None, "cuda"):
        process = run([*PLAN, "--target", "rtx-pro-6000"], {"JAX_PLATFORMS": platforms})
        assert process.returncode == 0 and process.stderr == "", process.stderr
        assert "8 x RTX PRO 6000" in process.stdout


@pytest.mark.slow
def test_more_devices_than_the_host_can_simulate():
    process = run([*GENERATE, *QUICK, "--devices", "100000"])
    assert "--devices 100000: this host has 1 CPU device; simulating 100000 would take" in one_line(
        process
    )
    assert "--devices 100000" in one_line(run([*PLAN, "--devices", "100000"]))
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=100000"}
    assert one_line(run([*GENERATE, *QUICK], flags)).startswith(
        f"jaxdd: XLA_FLAGS={flags['XLA_FLAGS']}: this host"
    )
    assert simulated_device_limit(64 * 2**30) == 692  # sqrt(32 GiB / 70 KiB per device pair)


@pytest.mark.slow
def test_server_start_up_faults(tmp_path):
    """The server's start-up answers as the other CLIs do, before it loads or compiles anything."""
    serve = [*SERVE, "--port", str(free_port())]
    if not device_present(cli.PLATFORMS["cuda"]):
        assert "this host has no GPU" in one_line(run(serve, {"JAX_PLATFORMS": "cuda"}))
    devices = run([*serve, "--devices", "100000"])
    assert "--devices 100000: this host has 1 CPU device" in one_line(devices)
    absent = run([*serve, "--checkpoint", str(tmp_path / "absent")])
    assert one_line(absent).endswith("not a directory\n")
    wrapped = "jaxdd: argument --port: must be in 1..65535, got 70000 (--help for usage)\n"
    assert one_line(run([*SERVE, "--port", "70000"])) == wrapped
    unknown = one_line(run([*serve, "--host", "no-such-host.invalid"]))
    assert unknown.startswith("jaxdd: --host no-such-host.invalid: ")
    template = tmp_path / "absent.jinja"
    missing = one_line(run([*serve, "--chat-template", str(template)]))
    assert missing == f"jaxdd: --chat-template {template}: No such file or directory\n"


def test_server_port_in_use_is_said_before_loading(tmp_path):
    """With the port taken, the address is named, not the checkpoint (an empty directory, which
    loading would refuse)."""
    (tmp_path / "empty").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        empty = ["--checkpoint", str(tmp_path / "empty"), "--drafter", str(tmp_path / "empty")]
        process = run([*SERVE, "--port", str(port), *empty])
    assert one_line(process) == f"jaxdd: 127.0.0.1:{port}: Address already in use\n"


def jax_loaded(process: subprocess.Popen) -> bool:
    """Whether ``process`` has loaded jaxlib's extension (its ``import jax`` is under way), or
    ended."""
    with contextlib.suppress(OSError):
        return "jaxlib" in Path(f"/proc/{process.pid}/maps").read_text()
    return process.poll() is not None


def test_ctrl_c_while_jax_imports():
    argv = [*GENERATE, *QUICK]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 120
    while not jax_loaded(process) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == cli.INTERRUPTED, (process.returncode, err)
    assert err == "jaxdd: interrupted\n"


def test_a_command_line_reaches_stderr_whole():
    """Unbuffered (PYTHONUNBUFFERED=1, as CI sets it), print writes a line's text and its newline
    apart; under ``cli.run`` another thread's line (``end_now``'s) can no longer land between."""
    main = (
        "import os, sys\n"
        "from jaxdd import cli\n"
        "def main():\n"
        "    sys.stderr.write('jaxdd: access: GET /health 503')\n"
        "    os.write(2, b'jaxdd: interrupted\\n')\n"
        "    sys.stderr.write(' tokens -\\n')\n"
        "    return 0\n"
        "cli.run(main)\n"
    )
    process = run([sys.executable, "-c", main], {"PYTHONUNBUFFERED": "1"})
    assert process.returncode == 0, process.stderr
    assert process.stderr.splitlines() == [
        "jaxdd: interrupted",
        "jaxdd: access: GET /health 503 tokens -",
    ]


def compiling(server) -> bool:
    """Whether the server answers /health with 503, "compiling"."""
    with contextlib.suppress(httpx.HTTPError):
        health = httpx.get(f"{server.url}/health", timeout=5)
        return health.status_code == 503 and health.json()["error"]["message"] == "compiling"
    return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "phase"),
    [
        (signal.SIGTERM, "import"),
        (signal.SIGTERM, "join"),
        (signal.SIGTERM, "compile"),
        (signal.SIGINT, "compile"),
    ],
)
def test_server_signal_during_start_up(tmp_path, sig, phase):
    """SIGTERM or Ctrl-C while the server imports JAX, while it waits in C++ for a job's other
    process (which Python's handlers cannot interrupt), or while it compiles (/health answers 503;
    a cold cache keeps it compiling, and a request is refused as not_ready): its one line, exit 143
    / 130 within seconds, no abort; the port is free again at once."""
    said = {signal.SIGTERM: "jaxdd: terminated", signal.SIGINT: "jaxdd: interrupted"}[sig]
    cold = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    log = tmp_path / "server.log"
    args = ["--max-batch", "2", "--max-len", "256"]
    if phase == "join":
        job = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
        args += [*job, "--process-id", "0", "--coordinator-timeout", "300"]
    with started_server(args, log, cold) as server:
        if phase == "import":
            assert server.wait_until(lambda: jax_loaded(server.process), 120, 0.01)
        elif phase == "join":
            waiting = lambda: "waiting for 2" in log.read_text()
            assert server.wait_until(waiting, 120), log.read_text()
        else:
            assert server.wait_until(lambda: compiling(server), START_SECONDS, 0.2), log.read_text()
            body = {"prompt": [1, 2], "max_tokens": 2}
            refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503
            assert server.metric('request_refused_total{reason="not_ready"}') == 1
        server.process.send_signal(sig)
        assert server.exit_code(30) == 128 + sig, log.read_text()
        access = "jaxdd: access: "  # the test's own requests, one line each
        lines = [line for line in log.read_text().splitlines() if not line.startswith(access)]
        assert lines[-1] == said and len(lines) == (2 if phase == "join" else 1), lines
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds its own
        again.bind(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))


@pytest.mark.slow
def test_plan_names_hardware_and_unknown_xla_flags_are_one_line():
    hardware = one_line(run([*PLAN, "--hardware", "quantum-9000"]))
    assert hardware.startswith("jaxdd: --hardware: expected one of cpu")
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_no_such_flag=1"}
    for argv in (PLAN, [*GENERATE, *QUICK], [*SERVE, "--port", str(free_port())]):
        assert one_line(run(argv, flags)) == "jaxdd: XLA_FLAGS: unknown flag --xla_no_such_flag=1\n"
    crosscheck = [sys.executable, "-m", "jaxdd.crosscheck", "dump", "--method", "xyz"]
    assert one_line(run(crosscheck)).startswith("jaxdd: argument --method: invalid choice: 'xyz'")


@pytest.mark.slow
def test_broken_pipe_is_quiet_libtpu_never_speaks_and_compiles_are_cached(tmp_path):
    """With no JAX_PLATFORMS (libtpu and the CUDA plugin installed, neither device here) the
    run is the CPU's, silent on stderr but for its status line; its output into a reader that
    closes after 10 bytes ends it quietly; its compiles land in the user's cache directory."""
    env = environment(
        {"JAX_PLATFORMS": None, "JAX_COMPILATION_CACHE_DIR": None, "XDG_CACHE_HOME": str(tmp_path)}
    )
    argv = [*GENERATE, "--method", "ar", "--max-new-tokens", "8", "--stop-ids", "-1"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    head = process.stdout.read(10)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert len(head) == 10 and process.returncode == cli.BROKEN_PIPE
    stderr = err.decode()
    assert (
        "Traceback" not in stderr
        and "libtpu" not in stderr
        and "TPU_" not in stderr
        and "cuda" not in stderr
    )
    assert all(line.startswith("[ar]") for line in stderr.splitlines()), stderr
    assert any((tmp_path / "jaxdd" / "compiles").iterdir())


@pytest.mark.slow
def test_ctrl_c_after_the_first_tokens():
    argv = [
        *GENERATE,
        "--method",
        "ddtree",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4000",
        "--stop-ids",
        "-1",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = process.stdout.read(3)  # the first tokens' text is out
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=30)
    # On a failure, what came after the signal says whether it
    # landed during the run (exit 0 seen twice under load).
    assert len(first) == 3 and process.returncode == cli.INTERRUPTED, (
        process.returncode,
        len(rest),
        err[-2000:],
    )
    assert err.splitlines()[-1] == "jaxdd: interrupted" and "Traceback" not in err


def test_coordinator_without_its_peer():
    argv = [
        *GENERATE,
        *QUICK,
        "--coordinator",
        "127.0.0.1:1",
        "--num-processes",
        "2",
        "--process-id",
        "1",
    ]
    process = run([*argv, "--coordinator-timeout", "3"])
    assert process.returncode == 2 and "Traceback" not in process.stderr
    waiting, gave_up = process.stderr.splitlines()[-2:]
    assert (
        waiting
        == "jaxdd: waiting for 2 processes at 127.0.0.1:1 (at most 3 s: --coordinator-timeout)"
    )
    assert gave_up == "jaxdd: 2 processes at 127.0.0.1:1: the job did not assemble within 3 s"


@pytest.fixture(scope="module")
def nan_target(tmp_path_factory) -> tuple[Path, str, str]:
    """The bundled target with one NaN in one tensor of one shard: (directory, shard, tensor)."""
    root = tmp_path_factory.mktemp("nan") / "target"
    shutil.copytree(DEMO / "target", root)
    shard = sorted(root.glob("*.safetensors"))[2]
    tensors = load_file(shard)
    name = sorted(n for n, t in tensors.items() if np.issubdtype(t.dtype, np.floating))[0]
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[np.random.default_rng(0).integers(tensors[name].size)] = np.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    return root, shard.name, name


@pytest.mark.slow
def test_nan_weights_are_named_by_generate_and_convert(nan_target, tmp_path):
    root, shard, name = nan_target
    said = f"{root / shard}: tensor {name} holds NaN or infinite values\n"
    assert one_line(
        run([*GENERATE, *QUICK, "--checkpoint", str(root), "--drafter", str(DEMO / "drafter")])
    ) == (f"jaxdd: {said}")
    out = tmp_path / "converted"
    assert one_line(
        run([sys.executable, "-m", "convert", "hf-to-jaxdd", str(root), str(out), "--quiet"])
    ) == (f"jaxdd: {said}")
    assert not out.exists()


def test_nan_weights_in_a_jaxdd_checkpoint(tmp_path):
    model = jaxdd.load_target(DEMO / "target", dtype="float32").model
    model.layers[1].attn.o_proj[...] = model.layers[1].attn.o_proj[...].at[0, 0, 0].set(jnp.inf)
    jaxdd.save_target(model, tmp_path / "bad")
    with pytest.raises(
        jaxdd.CheckpointError, match=r"state/layers\.1: tensor layers\.1\.attn\.o_proj holds NaN"
    ):
        jaxdd.load_target(tmp_path / "bad", dtype="float32")


def test_unreadable_files_name_their_cause(tmp_path, monkeypatch):
    """Tests run as root, whom permissions do not stop: a directory stands in a shard's
    place, and opening the config raises PermissionError as it would for another user."""
    root = tmp_path / "target"
    shutil.copytree(DEMO / "target", root)
    shard = sorted(root.glob("*.safetensors"))[0]
    shard.unlink()
    shard.mkdir()
    with pytest.raises(jaxdd.CheckpointError, match=f"^{shard}: Is a directory$"):
        HFCheckpoint(root)
    config = root / "config.json"
    real_read_text = Path.read_text

    def denied(self, *args, **kwargs):
        if self == config:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(jaxdd.ConfigError, match=f"^{config}: Permission denied$"):
        HFCheckpoint(root)


def test_plan_refuses_bad_sizes_and_configs(tmp_path, capsys):
    from jaxdd.plan import main

    for flag, value in (("--layers", "0"), ("--batch", "0"), ("--max-len", "-1")):
        assert main([*PLAN[3:], flag, value]) == 2
        assert capsys.readouterr().err == f"jaxdd: {flag}: expected at least 1, got {value}\n"
    (tmp_path / "config.json").write_text("not json")
    process = run([*PLAN[:4], str(tmp_path / "config.json"), *PLAN[5:]])
    assert one_line(process).startswith(f"jaxdd: {tmp_path / 'config.json'}: not valid JSON")
    assert PlanOptions().moe == "tp"


def test_compare_json_has_no_bare_nan_and_names_the_first_non_finite_layer():
    # [layers - 1, T, D]
    hidden = np.random.default_rng(1).normal(size=(3, 5, 4)).astype(np.float32)
    ref = types.SimpleNamespace(hidden=hidden[:, [1, 3]], hidden_positions=np.array([1, 3]))
    assert first_hidden_excess(hidden, ref, 1e-4) is None
    hidden[1:, 3] = np.nan  # from layer 1 on, at position 3
    excess = first_hidden_excess(hidden, ref, 1e-4)
    assert excess["layer"] == 1 and excess["position"] == 3 and excess["non_finite"]
    prompt = PromptReport(
        0,
        4,
        4,
        None,
        True,
        None,
        0,
        0,
        1.0,
        None,
        0,
        None,
        float("nan"),
        float("inf"),
        float("nan"),
        None,
        excess,
    )
    report = Report("ar", "float32", "cpu", 1e-4, [prompt])
    text = json.dumps(report.to_json(), allow_nan=False)
    entry = json.loads(text)["prompts"][0]
    assert entry["logits_max_abs"] == "NaN" and entry["logits_mean_abs"] == "Infinity"
    assert entry["first_hidden_excess"]["rel"] == "NaN" and not json.loads(text)["ok"]
    assert "hidden states are NaN or infinite after layer 1 (position 3)" in str(report)
