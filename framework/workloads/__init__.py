"""Research workloads: prompts files and synthetic generators (random, shared-prefix, long-tail,
multi-turn) with their arrival processes. Imports the kernel only."""
