"""Everything ``engine.compile`` (vLLM's ``compilation``): the decoder compiled one layer kind at a time
(``decoder``, ``regions``, ``layer_stack``), CUDA graphs of decode steps (``cuda_graphs``), and
``engine.compile=auto``'s rule (``policy``) with this machine's measured numbers (``calibration``)."""
