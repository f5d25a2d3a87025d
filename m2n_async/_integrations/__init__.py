"""Ecosystem integrations: torch modules in, plan files in, nothing on the wire.

Theory of operation: the engine speaks ``ParamSpec``/``Layout`` and plain tensors; RL
frameworks hold ``torch.nn.Module``s whose parameters are DTensors (FSDP2, tensor parallel)
or plain tensors. This package translates between the two *at the edges* and adds no state of
its own to the protocol:

- ``_integrations.sources`` — the trainer side: ``specs_from_module`` reads names, dtypes,
  global shapes and placements off a module; ``module_shards`` hands the engine each local
  shard lazily, by name, when the bucket pipeline asks for it.
- ``_integrations.targets`` — the worker side: ``targets_from_module`` declares destination
  tensors and placements from a module plus a tensor-parallel plan; ``LoadTarget`` is the
  callback form for fused or quantized layouts the engine must not write in place.
- ``_integrations.planfile`` — ``m2n-async plan SPEC``: a plan described in TOML/JSON,
  validated offline with the same core the engine agrees on, and summarized.

torch is imported lazily inside functions so that ``import m2n_async`` and the ``plan``
command stay torch-free.
"""
