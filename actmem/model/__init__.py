"""What the model and its run are: the architecture, the code that runs it, the typed spec and its rules, recompute, the optimizer's state, the GPUs."""
