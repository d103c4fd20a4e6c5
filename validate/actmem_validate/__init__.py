"""actmem's measured-validation harness: real tensor + sequence parallel layers, measured.

Builds the transformer layer of the paper's Figure 5 the way Megatron-LM builds it, runs
the first pipeline stage's schedule, records every tensor the forward pass saves for the
backward pass, and compares the bytes per term with actmem's term table. Needs torch
(`pip install 'actmem[harness]'`). This package imports actmem; actmem never imports it.
"""
