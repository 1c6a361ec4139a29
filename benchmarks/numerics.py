"""Max relative error of each jaxdd module against HF
transformers DeepseekV3 (fp32, CPU), per config flavour.

    python benchmarks/numerics.py

Relative error = max |jaxdd - HF| / max |HF|, over the same random inputs the tests use. Writes
benchmarks/results/numerics.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch

import jaxdd
from jaxdd.cache import CacheView
from jaxdd.models.layers import rope_cos_sin
from jaxdd.models.target import target_rope
from jaxdd.runtime.backend import Backend
from jaxdd.testing.benchmark import write_result
from jaxdd.testing.reference import FLAVOURS, additive_mask, hf_model, rel_err

RESULTS = Path(__file__).parent / "results" / "numerics.json"


def measure(flavour: str, seed: int) -> dict:
    model = hf_model(FLAVOURS[flavour], seed)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        target = jaxdd.load_target(directory, dtype="float32")
    jx, c = target.model, target.config
    rng = np.random.default_rng(seed)
    b, t = 2, 12
    x = rng.standard_normal((b, t, c.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(t), (b, t))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    inv_freq, amplitude = target_rope(c)
    cos_sin = rope_cos_sin(jnp.asarray(positions), inv_freq, amplitude, jnp.float32)
    empty = (jnp.zeros((b, t, c.kv_lora_rank)), jnp.zeros((b, t, c.qk_rope_head_dim)))
    view = CacheView(jnp.zeros((b,), jnp.int32))  # an empty cache of t slots
    mask = jnp.asarray(causal)
    moe = c.num_hidden_layers - 1
    errors = {}
    with torch.no_grad():
        tx = torch.from_numpy(x)
        cos, sin = model.model.rotary_emb(tx, torch.from_numpy(np.array(positions)))
        half = cos.shape[-1] // 2
        errors["rope_cos"] = rel_err(cos_sin[0], cos[..., :half].numpy())
        errors["rms_norm"] = rel_err(jx.final_norm(jnp.asarray(x)), model.model.norm(tx).numpy())
        hf_mask = additive_mask(causal)
        for form in ("naive", "absorbed"):
            ours = jx.layers[1].attn(
                jnp.asarray(x), cos_sin, empty, view, mask, form, Backend.local()
            )[0]
            errors[f"attention_{form}"] = rel_err(
                ours, model.model.layers[1].self_attn(tx, (cos, sin), hf_mask)[0].numpy()
            )
        flat = x.reshape(-1, c.hidden_size)
        _, weights, _ = model.model.layers[moe].mlp.gate(torch.from_numpy(flat))
        ours_w, _ = jx.layers[moe].mlp.router(jnp.asarray(flat))
        errors["router_weights_sorted"] = rel_err(
            np.sort(np.asarray(ours_w), -1), np.sort(weights.numpy(), -1)
        )
        errors["moe"] = rel_err(
            jx.layers[moe].mlp(jnp.asarray(x), Backend.local()),
            model.model.layers[moe].mlp(tx).numpy(),
        )
        for name, i in (("dense_layer", 0), ("moe_layer", moe)):
            ours = jx.layers[i](
                jnp.asarray(x), cos_sin, empty, view, mask, "absorbed", Backend.local()
            )[0]
            hf = model.model.layers[i](tx, attention_mask=hf_mask, position_embeddings=(cos, sin))
            errors[name] = rel_err(ours, hf.numpy())
        ids = rng.integers(0, c.vocab_size, (b, t))
        hf_logits = model(torch.from_numpy(ids)).logits.numpy()
    for form in ("naive", "absorbed"):
        errors[f"model_logits_{form}"] = rel_err(target.logits(ids, attention=form), hf_logits)
    return errors


def main() -> None:
    report = {
        f"{flavour}_seed{seed}": measure(flavour, seed) for flavour in FLAVOURS for seed in (0, 1)
    }
    worst = {k: max(r[k] for r in report.values()) for k in next(iter(report.values()))}
    for name, value in worst.items():
        print(f"{name:24s} {value:.2e}")
    write_result(RESULTS, {"max_over_runs": worst, "runs": report}, torch=torch.__version__)


if __name__ == "__main__":
    main()
