"""RoPE as an HF config states it: theta and YaRN scaling, classic or v5 spelling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxdd.config.fields import FieldReader


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (``rope_scaling`` / ``rope_parameters`` with type ``yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_rope(
    data: Mapping[str, Any], r: FieldReader, hf_defaults: bool = False
) -> tuple[float, YarnConfig | None]:
    """Read theta and YaRN from either the classic
    ``rope_theta`` + ``rope_scaling`` or v5 ``rope_parameters``.

    Targets must spell out every YaRN field. Drafters (Qwen3 configs) get transformers'
    defaults for absent ones when ``hf_defaults``: beta_fast 32, beta_slow 1, no mscale
    pair (amplitude 0.1 ln(factor) + 1), original length = max_position_embeddings.
    """
    if isinstance(data.get("rope_parameters"), Mapping):
        params = data["rope_parameters"]
        where = "rope_parameters"
        rope_theta = FieldReader(params, f"{r.prefix}{where}.").get("rope_theta", float)
    else:
        params = data.get("rope_scaling") or {}
        where = "rope_scaling"
        rope_theta = r.get("rope_theta", float)
    if not isinstance(params, Mapping):
        raise r.fail(where, f"expected an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        raise r.fail(f"{where}.type", f"only 'yarn' rope scaling is supported, got {kind!r}")
    y = FieldReader(params, f"{r.prefix}{where}.")

    def field(key: str, kind: type, default: Any) -> Any:
        return y.get(key, kind, default) if hf_defaults else y.get(key, kind)

    yarn = YarnConfig(
        factor=y.get("factor", float),
        original_max_position_embeddings=field(
            "original_max_position_embeddings", int, data.get("max_position_embeddings")
        ),
        beta_fast=field("beta_fast", float, 32.0),
        beta_slow=field("beta_slow", float, 1.0),
        mscale=field("mscale", float, 0.0),
        mscale_all_dim=field("mscale_all_dim", float, 0.0),
    )
    return rope_theta, yarn
