"""The model as it runs here (vLLM's ``model_executor``): loading transformers models offline
(``model_loader``, the family table ``model_families``), the attention bridge to transformers
(``forward_context``), tensor-parallel layers and weight sharding (``tensor_parallel``, ``parallel_layers``,
``tp_weights``), oneDNN-prepacked linears (``prepack``), CPU allocator tuning (``cpu_malloc``) and the
drafters' embedding loader (``embeddings``). Imports the kernel and ``framework.distributed`` only."""
