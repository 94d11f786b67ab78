"""One rank of the model (vLLM V1 ``v1/worker``): the :class:`~framework.worker.worker.Worker` (device, model
shard, attention backend, KV cache tensors), its model runner (the flattened batch of a step: inputs, forward,
sampling) and the input batch that owns the block tables. Imports the model executor, compilation and sampling
packages and the kernel."""
