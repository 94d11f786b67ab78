"""Turning logits into tokens (vLLM V1's ``v1/sample``): the sampler (greedy, temperature, top-k/p, min-p,
penalties, logprobs), speculative decoding's rejection sampler and prompt logprobs."""
