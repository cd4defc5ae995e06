"""The ``triton_symm`` backend: the all-reduce fused into one Triton kernel over torch symmetric memory."""
