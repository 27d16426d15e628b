"""The Hugging Face side of `colibri convert`: config, checkpoint reading, adapters, quantizer."""
