"""Who talks to whom (vLLM ``vllm/distributed``): the collectives the tensor-parallel layers call by
group name (``communication_op``) and the shared-memory communicator of CPU ranks on one host
(``shm_communicator``). Imports nothing of ``framework`` but the kernel; the worker (model layers,
weight loading) and the executors import it."""
