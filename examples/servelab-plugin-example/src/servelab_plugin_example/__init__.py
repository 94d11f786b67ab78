"""servelab-plugin-example: ``scheduler=lifo`` and ``kv_cache=peak_paged`` for servelab."""
