"""Where a model comes from: presets, Hugging Face config.json files, Megatron-LM launch scripts and arguments."""
