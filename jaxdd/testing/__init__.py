"""Helpers shared by the tests and the benchmarks: the PyTorch reference builders (HF
DeepseekV3, z-lab DFlash), the oracle drafter, INT4/FP8 checkpoint writers, synthetic
checkpoints, timing and result files. They need the ``test`` extra (torch,
transformers, dflash, compressed-tensors); nothing in ``jaxdd`` proper imports them."""
