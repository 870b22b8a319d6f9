"""Plans for the `transformers` text encoders diffusers pipelines instantiate, one short module per family, found
like the transformer families (a module defining `MODEL_CLASSES`). Their `tensor_parallel_plan(config,
model_class)` takes the class name too: the same decoder sits at different paths in a bare text model, a causal-LM
wrapper and a vision-language model."""
