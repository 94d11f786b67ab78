"""Quality: lm-eval parity, quantization, EAGLE head training."""
