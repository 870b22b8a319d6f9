"""The entry points: from_pretrained, enable_parallelism, load_pipeline, parallelize_vae."""
