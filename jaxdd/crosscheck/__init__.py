"""Portability checks: dump PyTorch reference traces once,
then compare any jaxdd backend and dtype against them.

    python -m jaxdd.crosscheck dump --target DIR [--drafter DIR] --prompts FILE
                               --method ar|dflash|ddtree --out REF
    python -m jaxdd.crosscheck compare REF [--dtype fp32|bf16] [--json]

``dump`` needs the PyTorch references (torch, transformers,
dflash: the ``reference`` extra); ``compare`` needs only jaxdd.
"""
