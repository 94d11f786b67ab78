"""The simulator's models (``executor=sim``): step features, step-time predictors fit on measured profiles or
derived from a roofline, the KV memory of a simulated device, synthetic outputs and draft acceptance.

Nothing here loads weights or runs a model; ``servelab profile`` (``framework.entrypoints.profile``)
measures the real engine to make the profiles these models are fit on.
"""
