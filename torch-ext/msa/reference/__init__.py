"""Pure-PyTorch references of every msa op: the test oracle and the fallback backend."""
