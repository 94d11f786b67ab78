"""What runs the model (vLLM V1 ``v1/worker`` + ``v1/sample``): loading, the model runner with its
flattened batch and paged KV tensors, the attention bridge to transformers, torch.compile, prepacked
linears and the samplers. Imports the kernel (``framework.core``, ``framework.interfaces``) only."""
