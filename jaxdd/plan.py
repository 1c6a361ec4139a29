"""``python -m jaxdd.plan``: will a full-size target +
drafter fit a target's devices, and how are the bytes spread?

    python -m jaxdd.plan --config CONFIG.json --drafter-config DRAFTER.json \\
        --hardware rtx-pro-6000 --devices 8 --moe tp|ep --budget 64 --max-len 8192 --batch 1 \\
        [--method ddtree] [--sampled] [--layers N] [--cache-layout striped|replicated] \\
        [--drafter-kv model|fp8] [--json]

Builds both models abstractly (shapes and shardings only, nothing allocated), lowers the
round ``jaxdd.generate`` would run on the target (its attention form and MoE dispatch,
chosen from the target's platform) and compiles it ahead of time with the target's own
compiler: ``cpu`` (this host's simulated devices), a GPU by name (``h200``,
``rtx-pro-6000``, ``b200``: ``jaxdd.planning.hardware``) or a TPU slice by JAX's topology
name (``v5p:2x2x2``), deviceless (``jaxdd.planning.aot``). Reports per device: weights as
stored (INT4 or FP8 routed experts included), caches (the target's MLA latent rows and
the drafter's K/V), the compiler's temporaries, the total, and whether it fits the
device's memory. Beside it, the roofline of one row's AR / DFlash / DDTree rounds at
``--max-len`` tokens of context on each named GPU (``jaxdd.planning.traffic``, ``roofline``): bytes
and FLOPs per device, memory, compute and link time, which bound holds (``--json``: ``flops`` per
round, ``compute_s`` and ``bound`` per target) and the round with the most tokens/s.
``--layers`` keeps the full width but fewer layers (for quick checks).
``--cache-layout`` lays the target's latent cache out replicated on every device or striped
over them (``jaxdd.planning.cache_layout``) in the account and the compiled round, and reports
both layouts' capacity in context tokens; ``--drafter-kv fp8`` stores the drafter's K/V in 8-bit
floats there (half its bytes per token).
"""

from __future__ import annotations

import dataclasses
import json

from jaxdd import cli
from jaxdd.errors import ConfigError, InputError
from jaxdd.planning.aot import names
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.report import report
from jaxdd.types import ATTENTION_CHOICES, DRAFTER_KVS, LAYOUTS, METHODS, MOE_MODES


def main(argv: list[str] | None = None) -> int:
    parser = cli.OneLineParser(prog="python -m jaxdd.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="target HF config.json (kimi_k25 / kimi_k2 / deepseek_v3)"
    )
    parser.add_argument("--drafter-config", required=True, help="DFlash drafter config.json")
    parser.add_argument(
        "--hardware", "--target", default="cpu", help=f"what to compile for: {', '.join(names())}"
    )
    parser.add_argument(
        "--devices", type=int, help="devices (default: 8 GPUs or CPUs, a TPU topology's chips)"
    )
    parser.add_argument(
        "--moe",
        choices=MOE_MODES,
        default="tp",
        help="split each routed expert's width (tp, the default, as in python -m "
        "jaxdd.generate) or place whole "
        "experts (ep)",
    )
    parser.add_argument("--method", choices=METHODS, default="ddtree", help="the round compiled")
    parser.add_argument("--sampled", action="store_true", help="a sampled round (default: greedy)")
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="verify attention (auto: the hardware's own)",
    )
    parser.add_argument("--budget", type=int, default=64, help="DDTree nodes per round")
    parser.add_argument("--max-len", type=int, default=8192, help="prompt + generated tokens")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--layers", type=int, help="keep the full width but only this many layers")
    parser.add_argument(
        "--traffic", action="store_true", help="only the traffic account: no compile"
    )
    parser.add_argument(
        "--cache-layout",
        choices=LAYOUTS,
        help="the target's latent cache under TP: striped (pages dealt over the devices) or "
        "replicated (default: the faster floor of the round for the hardware and context)",
    )
    parser.add_argument(
        "--drafter-kv",
        choices=DRAFTER_KVS,
        default="model",
        help="the drafter's context K/V in the models' dtype or in 8-bit floats (fp8)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    # Planning runs on the host: deviceless compiles
    # for GPUs and TPUs, simulated devices for the CPU.
    cli.choose_platform(cpu_only=True)
    try:
        if args.hardware == "cpu":
            cli.simulate_cpu_devices(max(args.devices or 8, 1))
        options = PlanOptions(
            **{
                f.name: getattr(args, f.name)
                for f in dataclasses.fields(PlanOptions)
                if f.name != "compile_round"
            },
            compile_round=not args.traffic,
        )
        result = plan(args.config, args.drafter_config, options)
    except (ConfigError, InputError, cli.Refusal) as error:
        return cli.fail(error)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    cli.run(main)
