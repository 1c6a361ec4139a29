"""What the weights compute: layers, MLA attention, the MoE and its dispatches, the target,
the DFlash drafter, the latent cache and the quantized expert formats. No host I/O."""
