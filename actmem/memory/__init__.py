"""What a GPU holds: the term table, the engine that composes it, the stage model, the estimate."""
