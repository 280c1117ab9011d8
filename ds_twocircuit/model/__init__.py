"""The model side: HF causal LM as a DeepSpeed PipelineModule, weight I/O, the embedded base model."""
