"""Layout searches: the exact branch and bound over layouts, stages and DP degrees, and TP / FSDP2 / checkpointing /
offload on top; what they are asked (Machine, SearchSpace) and NoPlanFits in types."""
