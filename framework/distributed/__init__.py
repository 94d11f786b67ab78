"""Who talks to whom (vLLM ``vllm/distributed``): the process groups of tensor and data parallelism
(``parallel_state``: the TP group's ``GroupCoordinator``, the DP replica's description), the
collectives the tensor-parallel layers call by group name (``communication_op``) and the shared-memory
communicator of CPU ranks on one host (``shm_communicator``). Imports nothing of ``framework`` but the
kernel; the worker (model layers, weight loading) and the executors import it."""
