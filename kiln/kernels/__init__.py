"""Compute kernels. `reference` holds the pure-PyTorch versions (the oracle, and the CPU path);
`triton/` holds GPU kernels with the very same signatures."""
