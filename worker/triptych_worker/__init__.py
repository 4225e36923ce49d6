"""Role workers: the stages of a diffusion pipeline, the model-family adapters that build
them from stock diffusers components, the Mooncake transfer layer and the worker process."""
